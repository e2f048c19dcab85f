"""The connector contract: P's :class:`KVSender` and D's
:class:`~kvflow.connector.receiver.KVReceiver` (:mod:`.arrival`), over one ZMQ link per (P, D)
pair (P's DEALER to D's data socket). Serve calls ``make_cache``, ``warmup``, ``attach``; per
request ``begin`` -> ``engine.prefill(on_chunk=hook)`` -> ``finish`` or ``fail``, then ``hold``
and D's messages (:mod:`.held`). A kind implements :meth:`~KVSender.send_prefilled` and, to move
layers during the prefill, :meth:`~KVSender.chunk_hook` and :meth:`~KVSender.send_layerwise`.
The flow: docs/design.md, "One request, from the router to D's cache"; records: :mod:`.records`.
"""

from __future__ import annotations

import abc
import time
from typing import Any

from kvflow.cache import PagedKVCache
from kvflow.context import forward_context, sends_allowed
from kvflow.layout import KVCacheSpec

from .held import HeldSide
from .kept import Kept
from .kinds import default_layerwise_min_tokens
from .receiver import KVReceiver
from .records import (ChunkHook, Peer, Prefilling, PrefillJob, SlotsTaken, TransferError,
                      TransferStats, as_device, as_ids, check_send_allowed)

__all__ = ["ChunkHook", "KVReceiver", "KVSender", "Kept", "Peer", "Prefilling", "PrefillJob",
           "SlotsTaken", "TransferError", "TransferStats", "as_device", "as_ids",
           "check_send_allowed"]


class KVSender(HeldSide, abc.ABC):
    """P's half of a connector for P's cache ``spec``: ``instance_id`` (D acks layerwise parts to
    it), ``backend`` (of the copies), ``layerwise_min_tokens`` (None: the kind's default) and
    ``max_model_len`` (tokens; a threshold above it creates nothing layerwise)."""

    name: str = ""
    #: The kind moves layers during the prefill (:meth:`chunk_hook`, :meth:`send_layerwise`).
    layerwise_ready: bool = False

    def __init__(self, spec: KVCacheSpec, device: Any = "cpu", *, instance_id: str = "p",
                 backend: str = "auto", layerwise_min_tokens: int | None = None,
                 max_model_len: int = 2048) -> None:
        self.spec, self.device = spec, as_device(device)
        self.instance_id, self.backend, self.max_model_len = instance_id, backend, max_model_len
        self.layerwise_min_tokens = (default_layerwise_min_tokens(self.name)
                                     if layerwise_min_tokens is None else layerwise_min_tokens)
        self.links: dict[str, Any] = {}  # paired D -> the link to its data socket
        self.cache: PagedKVCache | None = None
        self.messages_sent = 0
        self.prefilling: dict[str, Prefilling] = {}  # begun, not finished or failed

    @property
    def layerwise_enabled(self) -> bool:
        """Some prompt (``<= max_model_len`` tokens) can move layer by layer."""
        return self.layerwise_min_tokens <= self.max_model_len

    def goes_layerwise(self, num_prompt_tokens: int) -> bool:
        return self.layerwise_enabled and num_prompt_tokens >= self.layerwise_min_tokens

    def reblocks(self, decode_id: str) -> bool:
        """D ``decode_id``'s cache spec differs from P's: its KV moves after the prefill,
        re-blocked (:mod:`.reblocked`)."""
        return False

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        self.cache = PagedKVCache(self.spec, num_blocks, device=self.device)
        return self.cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the connector's kernels and run any prefill path it needs inside a dummy
        run (:meth:`dummy_run`). Called before any socket."""

    def dummy_run(self, engine: Any, chunk_size: int, num_tokens: int = 32) -> None:
        """A prefill of ``num_tokens`` dummy tokens in two chunks through :meth:`begin` ->
        ``engine.prefill`` -> :meth:`finish` inside a dummy run (nothing sent)."""
        n = min(num_tokens, self.max_model_len, self.cache.num_blocks * self.spec.block_size)
        blocks = list(range(self.spec.num_blocks_for(n)))
        job = PrefillJob("dummy", [0] * n, blocks, "", blocks)
        with forward_context(is_dummy_or_profile_run=True):
            hook = self.begin(job)
            try:
                engine.prefill(job.token_ids, blocks, chunk_size=max(1, min(chunk_size, n // 2)),
                               on_chunk=hook)
            except BaseException:
                self.fail(job.req_id, job.decode_id, "dummy run failed")
                raise
            self.finish(job, 0)

    def export(self) -> dict[str, Any]:
        """Fields for P's :class:`~kvflow.serve.protocol.Register` (``shm_name``, ``connector_md``)."""
        return {}

    def attach(self, peer: Peer, ctx: Any = None, link: Any = None) -> Any:
        """Meet D ``peer``, replacing an earlier attachment of that D only: open the link to its
        data socket (a DEALER of ``ctx``, or ``link`` as given) and what the kind needs
        (:meth:`_attach`). Returns the link (P polls it for D's acks and renewals); TransferError
        (nothing stays attached): D's cache cannot be mapped."""
        self.detach(peer.id)
        if link is None:
            import zmq
            link = ctx.socket(zmq.DEALER)
            link.setsockopt(zmq.IDENTITY, self.instance_id.encode())
            link.connect(peer.data_addr)
        self.links[peer.id] = link
        try:
            self._attach(peer, ctx)
        except BaseException:
            self.detach(peer.id)
            raise
        return link

    def _attach(self, peer: Peer, ctx: Any) -> None:  # what the kind adds beyond the link
        pass

    def detach(self, peer_id: str) -> None:
        """Forget D ``peer_id``: close its link (and the kind's state of it); others stay."""
        link = self.links.pop(peer_id, None)
        if link is not None:
            link.close(0)

    def begin(self, job: PrefillJob) -> ChunkHook | None:
        """Before ``job``'s prefill: the ``on_chunk`` hook for :meth:`Engine.prefill
        <kvflow.engine.Engine.prefill>`, or None (it moves after the prefill). Layer by layer when
        the kind can (:attr:`layerwise_ready`), D's spec is P's (not :meth:`reblocks`) and
        :meth:`goes_layerwise`, or at any length inside a dummy run. TransferError (before any
        compute, nothing kept): ``job`` cannot go to D (not attached, bad block tables, no staging
        slot...) or is begun already."""
        if job.req_id in self.prefilling:
            raise TransferError(f"request {job.req_id!r} was begun already and is not "
                                f"finished or failed")
        layerwise = (self.layerwise_ready and not self.reblocks(job.decode_id)
                     and (self.goes_layerwise(len(job.token_ids)) or not sends_allowed()))
        rec = self.prefilling[job.req_id] = Prefilling(layerwise, time.perf_counter())
        try:
            rec.state = self.prepare(job, layerwise)
            return self.chunk_hook(job, rec.state) if layerwise else None
        except BaseException:
            self.prefilling.pop(job.req_id, None)
            self.cancel(job.req_id, rec)
            raise

    def finish(self, job: PrefillJob, first_token: int) -> Kept | None:
        """After ``job``'s prefill: send its KV (:meth:`send_prefilled`) or end its layerwise move
        (:meth:`send_layerwise`). Returns what P keeps until D's ack (:class:`Kept`, for
        :meth:`hold`), or None (D sends no ack, or a dummy run): P's blocks are free then.
        TransferError: ``job`` was not begun (or failed), or the send failed (the caller frees P's
        blocks and calls :meth:`fail`)."""
        rec = self.prefilling.pop(job.req_id, None)
        if rec is None:
            raise TransferError(f"finish of request {job.req_id!r}, which was not begun or "
                                f"failed")
        if not sends_allowed():
            return None
        prefill_ms = (time.perf_counter() - rec.t_begin) * 1e3
        if rec.layerwise:
            return self.send_layerwise(job, first_token, rec.state, prefill_ms=prefill_ms)
        return self.send_prefilled(job, first_token, prefill_ms=prefill_ms)

    def fail(self, req_id: str, decode_id: str, error: str) -> None:
        """Request ``req_id`` will not be (completely) sent to D ``decode_id``: end a prefill
        begun for it (:meth:`cancel`); a kind whose D waits for P's word tells D."""
        rec = self.prefilling.pop(req_id, None)
        if rec is not None:
            self.cancel(req_id, rec)

    def release(self, req_id: str) -> None:
        """D acked ``req_id``, it was aborted or its lease ended: drop what the kind keeps."""

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        """Requests whose transfer failed after :meth:`finish` returned: ``(req_id, error)``."""
        return []

    def prepare(self, job: PrefillJob, layerwise: bool) -> Any:
        """Check ``job`` before any compute (TransferError: it cannot go to D; by default, D is not
        attached, unchecked in a dummy run); returns the kind's per-request state."""
        if sends_allowed():
            self.link_to(job.decode_id)
        return None

    def chunk_hook(self, job: PrefillJob, state: Any) -> ChunkHook | None:
        """The ``on_chunk`` hook that moves ``job``'s layers during its prefill (sends nothing
        inside a dummy run)."""
        raise NotImplementedError(f"{type(self).__name__} moves no layers during the prefill")

    def send_layerwise(self, job: PrefillJob, first_token: int, state: Any, *,
                       prefill_ms: float = 0.0) -> Kept | None:
        """After a layerwise prefill: what is left to send. Returns and raises as
        :meth:`finish`."""
        raise NotImplementedError(f"{type(self).__name__} moves no layers during the prefill")

    @abc.abstractmethod
    def send_prefilled(self, job: PrefillJob, first_token: int, *,
                       prefill_ms: float = 0.0) -> Kept | None:
        """Send ``job``'s KV to D ``job.decode_id`` with its first token (``prefill_ms``: P's, for
        kinds whose message carries it). Returns and raises as :meth:`finish`."""

    def cancel(self, req_id: str, rec: Prefilling) -> None:
        """A begun prefill ends without :meth:`finish`: its hooks send nothing more; copies
        already issued are waited for."""

    def link_to(self, decode_id: str) -> Any:
        """The link to attached D ``decode_id`` (TransferError when not attached)."""
        link = self.links.get(decode_id)
        if link is None:
            raise TransferError(f"decode instance {decode_id!r} is not paired with this "
                                f"prefill instance (paired: {sorted(self.links)})")
        return link

    def close(self) -> None:
        """Close the links and release exports, threads and sockets."""
        for peer_id in list(self.links):
            KVSender.detach(self, peer_id)
