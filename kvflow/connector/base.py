"""The connector contract: how a request's KV blocks get from P's paged cache into D's.

Two halves, driven by the instances' event loops over one ZMQ link per (P, D) pair (P's DEALER
to D's ROUTER data socket). The engine drives; the connector is called at fixed points (as
vLLM's ``start_load_kv`` / ``save_kv_layer`` / ``wait_for_save``).

What P's serve (:mod:`kvflow.serve.prefill`) calls on :class:`KVSender`:

1. start-up, before any socket: :meth:`~KVSender.make_cache`, :meth:`~KVSender.warmup` (dummy
   runs through steps 3-5, nothing sent); pairing: :meth:`~KVSender.attach` / ``detach``;
2. per request, before its prefill: ``hook = sender.begin(job)``, where (only) it is decided
   whether the KV moves layer by layer during the prefill or after it (``hook`` None);
3. ``logits = engine.prefill(job.token_ids, job.blocks, chunk_size=..., on_chunk=hook)``
   (:meth:`Engine.prefill <kvflow.engine.Engine.prefill>`, the only chunk loop); serve samples
   the first token;
4. ``handoff = sender.finish(job, first_token)``: the send after the prefill or the end of the
   layerwise one; P keeps its blocks until D's ack when ``handoff`` says so;
5. :meth:`~KVSender.fail` when 2-4 raised or the request ends before them;
6. ``freed = sender.hold(req_id, blocks, handoff)`` (:mod:`.held`): the sender keeps what D
   still reads and answers which of P's block ids serve frees (serve keeps the allocator):
   now, on ``sender.on_message(msg, frames, peer)`` for each data-plane message from D (D's
   ack frees, its lease renewal renews), on ``sender.expire(lease_s)`` (a lease that ended)
   and on ``sender.drop(req_id)`` (an abort, a failed transfer; it calls
   :meth:`~KVSender.release`). Serve names no data-plane message.

What a kind implements on P: :meth:`~KVSender.send_prefilled` (the send after the prefill; a
transfer benchmark calls it alone, on a cache it filled itself), optionally
:meth:`~KVSender.prepare` (checks before any compute); a kind that moves layers during the
prefill sets :attr:`~KVSender.layerwise_ready` and gives :meth:`~KVSender.chunk_hook` (its
per-chunk / per-layer hook), :meth:`~KVSender.send_layerwise` and :meth:`~KVSender.cancel`.

What D's serve calls on :class:`~kvflow.connector.receiver.KVReceiver`: ``make_cache``,
``warmup``, ``export``, ``attach`` / ``detach`` of each P, ``expect`` when it allocates a
request's blocks, ``on_message`` for each data-plane message (:mod:`.arrival`: it answers an
``Arrival`` — done, part, failed or ignored — acks P, checks P's lease (:mod:`.lease`) and keeps
lent blocks (:mod:`.lent`); the kind's ``receive`` does the copy, at the block ids D allocated;
P's ids only name where to read), ``end`` when it ends a request. The records both
sides pass (:class:`PrefillJob`, :class:`Handoff`, :class:`Peer`, ...) are in :mod:`.records`.

Layerwise: prompts of at least ``layerwise_min_tokens`` tokens move layer by layer, shorter
ones after the prefill; a threshold above ``max_model_len`` creates nothing layerwise; a D
whose cache spec differs from P's gets the prompt after the prefill, re-blocked. Nothing is
sent inside a dummy/profile run (:func:`kvflow.context.sends_allowed`).
"""

from __future__ import annotations

import abc
import time
from typing import Any

from kvflow.cache import PagedKVCache
from kvflow.context import forward_context, sends_allowed
from kvflow.layout import KVCacheSpec

from .held import HeldSide
from .receiver import KVReceiver
from .records import (ChunkHook, Handoff, Peer, Prefilling, PrefillJob, SlotsTaken,
                      TransferError, TransferStats, as_device, as_ids, check_send_allowed)

__all__ = ["ChunkHook", "Handoff", "KVReceiver", "KVSender", "Peer", "Prefilling", "PrefillJob",
           "SlotsTaken", "TransferError", "TransferStats", "as_device", "as_ids",
           "check_send_allowed"]


class KVSender(HeldSide, abc.ABC):
    """P's half of a connector.

    Parameters
    ----------
    spec : KVCacheSpec
        P's cache spec.
    device : str or torch.device
    instance_id : str
        P's id (D acks layerwise parts to it; names P's segments).
    backend : str
        Kernel backend of the block copies.
    layerwise_min_tokens : int or None
        Prompts of at least this many tokens move layer by layer; None: the connector's
        :attr:`default_layerwise_min_tokens`.
    max_model_len : int
        Longest prompt + output (tokens); a threshold above it creates nothing layerwise.
    """

    name: str = ""
    #: ``layerwise_min_tokens`` when the config leaves it None.
    default_layerwise_min_tokens: int = 16384
    #: The kind moves layers during the prefill (:meth:`chunk_hook`, :meth:`send_layerwise`).
    layerwise_ready: bool = False

    def __init__(self, spec: KVCacheSpec, device: Any = "cpu", *, instance_id: str = "p",
                 backend: str = "auto", layerwise_min_tokens: int | None = None,
                 max_model_len: int = 2048) -> None:
        self.spec, self.device = spec, as_device(device)
        self.instance_id, self.backend, self.max_model_len = instance_id, backend, max_model_len
        self.layerwise_min_tokens = (self.default_layerwise_min_tokens
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
        """A prompt of this length moves layer by layer."""
        return self.layerwise_enabled and num_prompt_tokens >= self.layerwise_min_tokens

    def reblocks(self, decode_id: str) -> bool:
        """D ``decode_id``'s cache spec differs from P's: its KV moves after the prefill,
        re-blocked (:mod:`.reblocked`)."""
        return False

    # ---- set-up ------------------------------------------------------------------------
    def make_cache(self, num_blocks: int) -> PagedKVCache:
        """P's cache of ``num_blocks`` blocks (exported when D reads it)."""
        self.cache = PagedKVCache(self.spec, num_blocks, device=self.device)
        return self.cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the connector's kernels on scratch caches and run any prefill path it needs
        inside a dummy run (:meth:`dummy_run`: nothing registered, signalled or sent). Called
        before any socket."""

    def dummy_run(self, engine: Any, chunk_size: int, num_tokens: int = 32) -> None:
        """A prefill of ``num_tokens`` dummy tokens in two chunks through :meth:`begin` ->
        ``engine.prefill`` -> :meth:`finish` inside a dummy run: the layerwise hooks run, and
        nothing is registered, copied, signalled or sent (the warm-up; also after traffic)."""
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
        """Fields for P's :class:`~kvflow.serve.protocol.Register` (e.g. ``shm_name``,
        ``connector_md``)."""
        return {}

    def attach(self, peer: Peer, ctx: Any = None, link: Any = None) -> Any:
        """Meet D ``peer`` (at pairing; replaces an earlier attachment of that D only): open the
        link to its data socket (a DEALER of ``ctx``, or ``link`` as given) and anything else
        the connector needs (a mapping of D's cache, a layerwise socket). Returns the link
        (P polls it for D's acks and lease renewals).

        Raises
        ------
        TransferError
            D's cache cannot be mapped (nothing stays attached).
        """
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

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """What the connector adds to a pairing beyond the link."""

    def detach(self, peer_id: str) -> None:
        """Forget D ``peer_id`` (unpaired or paired anew): close its link; others stay."""
        link = self.links.pop(peer_id, None)
        if link is not None:
            link.close(0)

    # ---- per request: what P's serve calls ---------------------------------------------
    def begin(self, job: PrefillJob) -> ChunkHook | None:
        """Before ``job``'s prefill: decide how its KV moves; the ``on_chunk`` hook for
        :meth:`Engine.prefill <kvflow.engine.Engine.prefill>` (None: it moves after the
        prefill, :meth:`send_prefilled`). Layer by layer when the kind can
        (:attr:`layerwise_ready`), D's spec is P's (not :meth:`reblocks`) and the prompt has
        ``layerwise_min_tokens`` tokens (:meth:`goes_layerwise`), or at any length inside a
        dummy run (the warm-up runs the hooks; they send nothing).

        Raises
        ------
        TransferError
            Before any compute, nothing kept: ``job`` cannot go to D (not attached, bad block
            tables, no staging slot...), or ``job.req_id`` is begun and not finished.
        """
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

    def finish(self, job: PrefillJob, first_token: int) -> Handoff | None:
        """After ``job``'s prefill (P sampled ``first_token``): send its KV
        (:meth:`send_prefilled`) or end its layerwise move (:meth:`send_layerwise`). Returns
        what P keeps until D's ack (:class:`Handoff`), or None: D sends no ack, or a dummy run
        (nothing sent); P's blocks are free then.

        Raises
        ------
        TransferError
            ``job`` was not begun (or failed), or a failed send: the caller frees P's blocks
            and calls :meth:`fail`.
        """
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
        begun for it (:meth:`cancel`); a kind whose D waits for P's word (ipc-push: D keeps
        the blocks P may write until then) tells D."""
        rec = self.prefilling.pop(req_id, None)
        if rec is not None:
            self.cancel(req_id, rec)

    def release(self, req_id: str) -> None:
        """D acked ``req_id``, it was aborted or its lease ended: drop what is kept for it."""

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        """Requests whose transfer failed after :meth:`finish` returned: ``(req_id, error)``."""
        return []

    # ---- per request: what a kind implements --------------------------------------------
    def prepare(self, job: PrefillJob, layerwise: bool) -> Any:
        """Check ``job`` before any compute (:meth:`begin`; TransferError if it cannot go to
        D); returns the kind's per-request state (:attr:`Prefilling.state`). Default:
        ``job.decode_id`` is attached (not checked inside a dummy run: its job names no D)."""
        if sends_allowed():
            self.link_to(job.decode_id)
        return None

    def chunk_hook(self, job: PrefillJob, state: Any) -> ChunkHook | None:
        """The ``on_chunk`` hook that moves ``job``'s layers during its prefill (only when
        :attr:`layerwise_ready`); inside a dummy run it must send nothing."""
        raise NotImplementedError(f"{type(self).__name__} moves no layers during the prefill")

    def send_layerwise(self, job: PrefillJob, first_token: int, state: Any, *,
                       prefill_ms: float = 0.0) -> Handoff | None:
        """After a layerwise prefill: what is left to send (the last part with the first
        token, or the wait for the copies then D's notice). Returns and raises as
        :meth:`finish`."""
        raise NotImplementedError(f"{type(self).__name__} moves no layers during the prefill")

    @abc.abstractmethod
    def send_prefilled(self, job: PrefillJob, first_token: int, *,
                       prefill_ms: float = 0.0) -> Handoff | None:
        """Send ``job``'s KV, already computed into P's blocks ``job.blocks``, to D
        ``job.decode_id`` with its first token: :meth:`finish` of a prompt that did not go
        layerwise. A transfer benchmark calls it alone, on a cache it filled itself.
        ``prefill_ms``: P's prefill before it (ms), reported to D by kinds whose message
        carries it. Returns and raises as :meth:`finish`.
        """

    def cancel(self, req_id: str, rec: Prefilling) -> None:
        """A begun prefill ends without :meth:`finish` (an error, an abort): its hooks send
        nothing more; copies already issued are waited for."""

    def link_to(self, decode_id: str) -> Any:
        """The link to attached D ``decode_id`` (TransferError when it is not attached)."""
        link = self.links.get(decode_id)
        if link is None:
            raise TransferError(f"decode instance {decode_id!r} is not paired with this "
                                f"prefill instance (paired: {sorted(self.links)})")
        return link

    def close(self) -> None:
        """Close the links and release exports, threads and sockets."""
        for peer_id in list(self.links):
            KVSender.detach(self, peer_id)
