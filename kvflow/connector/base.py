"""The connector contract: how a request's KV blocks get from P's paged cache into D's.

A connector has two halves, both driven by the instances' event loops over one ZMQ link per
(P, D) pair (P's DEALER connected to D's ROUTER data socket):

- :class:`KVSender` (P's half) builds P's cache (exported when D reads it), meets each paired D
  (:meth:`~KVSender.attach` / :meth:`~KVSender.detach`), and runs a request's prefill through
  :meth:`Engine.prefill <kvflow.engine.Engine.prefill>` with its per-chunk / per-layer hooks
  (:meth:`~KVSender.prefill`), sending the KV (or a pointer to it) to the request's D.
- :class:`KVReceiver` (D's half) builds D's cache (exported when P writes it), meets each
  paired P, and turns what arrives into blocks of D's cache at the block ids D allocated
  (:meth:`~KVReceiver.on_message`, the kind's :meth:`~KVReceiver.receive`), acking P, checking
  P's lease and keeping lent blocks (:mod:`.arrival`, :mod:`.lease`, :mod:`.lent`).

Layerwise is a property of the sender: prompts of at least ``layerwise_min_tokens`` tokens move
layer by layer during the prefill, shorter ones after it; a threshold above ``max_model_len``
creates nothing layerwise. D always writes into the block table it allocated itself; P's ids only
name where to read. Nothing is sent inside a dummy/profile run
(:func:`kvflow.context.sends_allowed`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.layout import KVCacheSpec

from .arrival import ArrivalSide


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
    chunk_size : int or None
        Prefill chunk (tokens).
    sample : callable
        ``sample(logits) -> int``: the first token from the last prompt token's logits.
    """
    req_id: str
    token_ids: list[int]
    blocks: list[int]
    decode_id: str
    decode_block_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    chunk_size: int | None = None
    sample: Callable[[torch.Tensor], int] = lambda logits: int(logits.argmax())


@dataclasses.dataclass
class Handoff:
    """What P keeps for a request after :meth:`KVSender.prefill` until D's
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

    @property
    def layerwise_enabled(self) -> bool:
        """Some prompt (``<= max_model_len`` tokens) can move layer by layer."""
        return self.layerwise_min_tokens <= self.max_model_len

    def goes_layerwise(self, num_prompt_tokens: int) -> bool:
        """A prompt of this length moves layer by layer."""
        return self.layerwise_enabled and num_prompt_tokens >= self.layerwise_min_tokens

    # ---- set-up ------------------------------------------------------------------------
    def make_cache(self, num_blocks: int) -> PagedKVCache:
        """P's cache of ``num_blocks`` blocks (exported when D reads it)."""
        self.cache = PagedKVCache(self.spec, num_blocks, device=self.device)
        return self.cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the connector's kernels on scratch caches and run any prefill path it needs
        inside a dummy run (nothing registered, signalled or sent). Called before any socket."""

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

    # ---- per request -------------------------------------------------------------------
    @abc.abstractmethod
    def prefill(self, engine: Any, job: PrefillJob) -> Handoff | None:
        """Run ``job``'s prefill on ``engine`` (P's engine over :attr:`cache`) and send its KV
        (or a pointer to it) to D ``job.decode_id``.

        Returns
        -------
        Handoff or None
            What to keep until D's ack; None when D sends no ack (P's blocks are free now).

        Raises
        ------
        TransferError
            ``job.decode_id`` not attached, bad block ids, a failed send. The caller frees
            P's blocks and calls :meth:`fail`.
        """

    @abc.abstractmethod
    def send_prefilled(self, job: PrefillJob, first_token: int) -> Handoff | None:
        """Send ``job``'s KV, already computed into P's blocks ``job.blocks``, to D
        ``job.decode_id`` with its first token: what :meth:`prefill` does after the prefill of
        a prompt that does not go layerwise (it calls this). A transfer benchmark calls it on
        a cache it filled itself.

        Returns and raises as :meth:`prefill`.
        """

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

    def fail(self, req_id: str, decode_id: str, error: str) -> None:
        """Request ``req_id`` will not be (completely) sent to D ``decode_id``: tell D when it
        waits for P's word (ipc-push: D keeps the blocks P may write until then)."""

    def release(self, req_id: str) -> None:
        """D acked ``req_id``, it was aborted or its lease ended: drop what is kept for it."""

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        """Requests whose transfer failed after :meth:`prefill` returned: ``(req_id, error)``."""
        return []

    def close(self) -> None:
        """Close the links and release exports, threads and sockets."""
        for peer_id in list(self.links):
            KVSender.detach(self, peer_id)


class KVReceiver(ArrivalSide, abc.ABC):
    """D's half of a connector: serve hands it every data-plane message
    (:meth:`~kvflow.connector.arrival.ArrivalSide.on_message`, answering an
    :class:`~kvflow.connector.Arrival`); the kind's :meth:`receive` does the copy.

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
        self._init_arrivals()

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
