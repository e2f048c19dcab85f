"""The connector contract: how a request's KV blocks get from P's paged cache into D's.

A connector has two halves, both driven by the instances' event loops over one ZMQ link per
(P, D) pair (P's DEALER connected to D's ROUTER data socket). The engine drives; the connector
is called at fixed points (as vLLM's ``start_load_kv`` / ``save_kv_layer`` / ``wait_for_save``).

What P's serve calls (:mod:`kvflow.serve.prefill`), on :class:`KVSender`:

1. at start-up, before any socket: :meth:`~KVSender.make_cache`, then
   :meth:`~KVSender.warmup` (dummy runs through steps 3-5 with nothing sent);
2. at pairing: :meth:`~KVSender.attach` / :meth:`~KVSender.detach` of each D;
3. per request, before its prefill: ``hook = sender.begin(job)``, which decides, here only,
   whether the KV moves layer by layer during the prefill or after it (``hook`` is None then);
4. ``logits = engine.prefill(job.token_ids, job.blocks, chunk_size=..., on_chunk=hook)``
   (:meth:`Engine.prefill <kvflow.engine.Engine.prefill>`, the only chunk loop); serve samples
   the first token from ``logits``;
5. ``handoff = sender.finish(job, first_token)``: the send after the prefill, or the end of the
   layerwise one; serve keeps P's blocks until D's ack when ``handoff`` says so;
6. :meth:`~KVSender.fail` when any of 3-5 raised (or the request ends before them),
   :meth:`~KVSender.release` on D's ack, an abort or the end of the lease.

What a kind implements on its sender: :meth:`~KVSender.send_prefilled` (the send after the
prefill; a transfer benchmark calls it alone, on a cache it filled itself); optionally
:meth:`~KVSender.prepare` (checks before any compute), and, for a kind that moves layers during
the prefill, :attr:`~KVSender.layerwise_ready`, :meth:`~KVSender.chunk_hook` (the per-chunk /
per-layer hook), :meth:`~KVSender.send_layerwise` and :meth:`~KVSender.cancel`.

On D, :class:`KVReceiver` builds D's cache (exported when P writes it), meets each paired P,
and turns what arrives into blocks of D's cache at the block ids D allocated
(:meth:`~KVReceiver.receive`).

Layerwise: prompts of at least ``layerwise_min_tokens`` tokens move layer by layer during the
prefill, shorter ones after it; a threshold above ``max_model_len`` creates nothing layerwise; a
D whose cache spec differs from P's gets the prompt after the prefill, re-blocked. D always
writes into the block table it allocated itself; P's ids only name where to read. Nothing is
sent inside a dummy/profile run (:func:`kvflow.context.sends_allowed`).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Callable

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import forward_context, sends_allowed
from kvflow.layout import KVCacheSpec


class TransferError(RuntimeError):
    """A transfer that cannot be done (bad frames, unmapped peer, size mismatch)."""


class SlotsTaken(TransferError):
    """A pairing refused for now: D's receiver has no free slot for another P (nixl staged);
    D keeps the pairing and makes it once a slot frees."""


@dataclasses.dataclass
class TransferStats:
    """What one request's transfer moved, as D saw it.

    Attributes
    ----------
    blocks : int
        Prompt blocks written into D's cache (a prefix hit's blocks excluded).
    payload_bytes : int
        Bytes moved (``blocks`` x :attr:`KVCacheSpec.bytes_per_block` for whole blocks).
    copy_ms : float
        Copy time (ms): D's copy for ipc-pull / tcp, P's copy calls for ipc-push.
    layerwise : bool
        The request moved layer by layer during the prefill.
    """
    blocks: int
    payload_bytes: int
    copy_ms: float
    layerwise: bool = False


@dataclasses.dataclass
class Peer:
    """The other instance of a pairing (from :class:`~kvflow.protocol.Pair`).

    Attributes
    ----------
    id : str
        Its instance id.
    spec : KVCacheSpec
        Its KV cache spec (equal to ours: checked before attaching).
    num_blocks : int
        Blocks of its cache.
    shm_name : str
        Its exported cache ('' if it exports none).
    data_addr : str
        D's data socket (P connects its link there; '' for a P).
    connector_md : bytes
        What its connector published for peers (nixl: an encoded
        :class:`~kvflow.protocol.NixlAgentInfo`; b'' for other kinds).
    """
    id: str
    spec: KVCacheSpec
    num_blocks: int
    shm_name: str = ""
    data_addr: str = ""
    connector_md: bytes = b""


@dataclasses.dataclass
class PrefillJob:
    """One request as P's connector sees it.

    Attributes
    ----------
    req_id : str
    token_ids : list[int]
        The prompt.
    blocks : list[int]
        P's block table (covers the prompt).
    decode_id : str
        The D that allocated ``decode_block_ids`` (attached).
    decode_block_ids : list[int]
        D's block table of the request (logical block ``i`` is ``decode_block_ids[i]`` there).
    num_cached_blocks : int
        D's prefix hit: D already holds logical blocks ``0..num_cached_blocks-1``; not sent.
    """
    req_id: str
    token_ids: list[int]
    blocks: list[int]
    decode_id: str
    decode_block_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0


#: :meth:`Engine.prefill <kvflow.engine.Engine.prefill>`'s ``on_chunk``: called as
#: ``on_chunk(start, end)`` before the forward of positions ``[start, end)``; returns the
#: chunk's per-layer hook ``on_layer(layer)`` or None.
ChunkHook = Callable[[int, int], Callable[[int], None] | None]


@dataclasses.dataclass
class Prefilling:
    """A request between :meth:`KVSender.begin` and :meth:`KVSender.finish` (or
    :meth:`KVSender.fail`).

    Attributes
    ----------
    layerwise : bool
        Its KV moves during the prefill (through :meth:`KVSender.chunk_hook`).
    t_begin : float
        ``time.perf_counter()`` at :meth:`KVSender.begin` (s).
    state : object
        What the kind's :meth:`KVSender.prepare` returned (ipc-push, nixl: its ``PushStats``).
    """
    layerwise: bool
    t_begin: float
    state: Any = None


@dataclasses.dataclass
class Handoff:
    """What P keeps for a request after :meth:`KVSender.finish` until D's
    :class:`~kvflow.protocol.KVAck` or the lease ends.

    Attributes
    ----------
    holds_blocks : bool
        D reads P's blocks after the prefill returned (or parts still go out): keep them.
    keep : object
        Memory ZMQ still reads (a staging buffer), or None.
    """
    holds_blocks: bool
    keep: Any = None


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` with an index on CUDA (``"cuda"`` is the current GPU,
    ``cuda:N``), so two names of one GPU compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_send_allowed(what: str) -> None:
    """Raise RuntimeError if called during a dummy/profile run (nothing may be sent then)."""
    if not sends_allowed():
        raise RuntimeError(f"{what} during a dummy/profile run: nothing may be sent "
                           f"while is_dummy_or_profile_run is set")


def as_ids(ids: Any) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor."""
    return torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids,
                           dtype=torch.int64).reshape(-1)


class KVSender(abc.ABC):
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
        """A chunked prefill of ``num_tokens`` dummy tokens (two chunks at most
        ``chunk_size``) through :meth:`begin` -> ``engine.prefill`` -> :meth:`finish` inside
        ``forward_context(is_dummy_or_profile_run=True)``: the kind's layerwise hooks run where
        it has them, and nothing is registered, copied, signalled or sent (the warm-up; also
        callable after real traffic)."""
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
        """Fields for P's :class:`~kvflow.protocol.Register` (e.g. ``shm_name``,
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
        """Before ``job``'s prefill: decide how its KV moves and return the ``on_chunk`` hook
        for :meth:`Engine.prefill <kvflow.engine.Engine.prefill>`.

        It moves layer by layer during the prefill when the kind can
        (:attr:`layerwise_ready`), D's spec equals P's (not :meth:`reblocks`) and the prompt
        has at least ``layerwise_min_tokens`` tokens (:meth:`goes_layerwise`) -- or, inside a
        dummy run, at any length, so the warm-up runs the hooks (they send nothing). Else it
        moves after the prefill (:meth:`send_prefilled`) and the hook is None.

        Raises
        ------
        TransferError
            ``job`` cannot go to D (``job.decode_id`` not attached, bad block tables, no
            staging slot...), before any compute (nothing is kept for it); ``job.req_id``
            already begun and not finished.
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
        (:meth:`send_prefilled`) or end its layerwise move (:meth:`send_layerwise`). Inside a
        dummy run nothing is sent: None.

        Returns
        -------
        Handoff or None
            What to keep until D's ack; None when D sends no ack (P's blocks are free now).

        Raises
        ------
        TransferError
            ``job`` was not begun (or failed), or a failed send. The caller frees P's blocks
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
        """Check ``job`` before any compute (:meth:`begin`); returns the kind's per-request
        state (:attr:`Prefilling.state`). Default: ``job.decode_id`` is attached (not checked
        inside a dummy run, whose job names no D).

        Raises
        ------
        TransferError
            ``job`` cannot go to D.
        """
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
        """The link to attached D ``decode_id``.

        Raises
        ------
        TransferError
            ``decode_id`` is not attached.
        """
        link = self.links.get(decode_id)
        if link is None:
            raise TransferError(f"decode instance {decode_id!r} is not paired with this "
                                f"prefill instance (paired: {sorted(self.links)})")
        return link

    def close(self) -> None:
        """Close the links and release exports, threads and sockets."""
        for peer_id in list(self.links):
            KVSender.detach(self, peer_id)


class KVReceiver(abc.ABC):
    """D's half of a connector.

    Parameters
    ----------
    spec : KVCacheSpec
        D's cache spec.
    device : str or torch.device
    backend : str
        Kernel backend of the block copies.
    """

    name: str = ""
    #: D acks each transfer (P keeps blocks or buffers until then).
    acks: bool = True
    #: D reads P's memory after P sent the pointer: check P's lease first.
    reads_peer_memory: bool = False
    #: P writes D's blocks: blocks of a request that ends early stay lent until P is done.
    peer_writes: bool = False
    #: P and D share one host (their processes can be judged by pid).
    host_local: bool = True

    def __init__(self, spec: KVCacheSpec, device: Any = "cpu", *, backend: str = "auto") -> None:
        self.spec, self.device, self.backend = spec, as_device(device), backend
        self.cache: PagedKVCache | None = None

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        """D's cache of ``num_blocks`` blocks (exported when P writes into it)."""
        self.cache = PagedKVCache(self.spec, num_blocks, device=self.device)
        return self.cache

    def warmup(self) -> None:
        """Compile the copy kernels on scratch caches (no socket exists yet)."""

    def export(self) -> dict[str, Any]:
        """Fields for D's :class:`~kvflow.protocol.Register` (``shm_name``: '' if none;
        ``connector_md``)."""
        return {"shm_name": ""}

    def describe(self) -> dict[str, Any]:
        """The connector fields of a request's ``kvflow`` response block: ``kv_connector``
        (the kind; the metrics' ``connector`` label)."""
        return {"kv_connector": self.name}

    def attach(self, peer: Peer) -> None:
        """Meet P ``peer`` (at pairing): map its cache if D reads it directly."""

    def detach(self, peer_id: str) -> None:
        """Forget P ``peer_id`` (it died): drop its mapping, if the connector keeps one."""

    @abc.abstractmethod
    def receive(self, header: Any, frames: list[Any], cache: PagedKVCache,
                dst_ids: list[int], peer_id: str | None = None) -> TransferStats | None:
        """Put the KV described by ``header`` (+ raw ``frames``) into ``cache`` at ``dst_ids``
        (D's own block ids, one per prompt block not in D's prefix hit). ``peer_id``: the P
        that sent it (None: the last paired one). Returns None while layerwise parts are
        missing, the request's totals when its KV is complete.

        Raises
        ------
        TransferError
            For frames that do not match the header or the spec, or an unattached peer.
        """

    def expect(self, req_id: str) -> None:
        """D allocated blocks for ``req_id``: its KV may come from now on (until
        :meth:`receive` of it or :meth:`forget`)."""

    def forget(self, req_id: str) -> None:
        """Drop the state of a partly received layerwise transfer (D ended the request)."""

    def close(self) -> None:
        """Unmap the peers and remove this side's export."""
