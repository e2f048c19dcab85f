"""``nixl``: P writes each request's KV into D's registered memory (host or CUDA) with
one-sided NIXL WRITEs (:mod:`.nixl_writer`) in :class:`~kvflow.connector.ipc_push.PushSender`'s
flow; D's agent info travels in ``Register`` / ``Pair`` (:class:`~kvflow.protocol.NixlAgentInfo`).
Modes, staging slots, ``slot K`` / ``free REQ`` notices: docs/nixl.md, "How it works"; progress:
docs/nixl.md, "Progress without a busy thread"; lent blocks: docs/reliability.md, item 5.
On one host UCX takes shared memory unless ``UCX_TLS=tcp`` (tests of the network path set it).
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_shape
from kvflow.context import sends_allowed
from kvflow.kernels import gather_blocks, scatter_blocks
from kvflow.protocol import (KVPushed, NixlAgentInfo, ProtocolError, decode_agent_info,
                             encode_agent_info)

from .base import (KVReceiver, KVSender, Peer, PrefillJob, SlotsTaken, TransferError,
                   TransferStats)
from .ipc_push import PushSender
from .layer_copy import LAYERS_PER_COPY
from .transport.nixl_agent import Agent, block_descs, mem_type
from .nixl_writer import NixlPeer, NixlWriter

MODES = ("direct", "staged")
STAGING_SLOTS = 4  # of a staged D: the paired P's it can serve
WRITE_TIMEOUT_S = 30.0  # default bound (seconds) on P's wait for a request's WRITEs


def _check_mode(mode: Any, device: torch.device) -> None:
    if mode not in MODES:
        raise ValueError(f"kv_connector_config mode must be one of {', '.join(MODES)}; got "
                         f"{mode!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the nixl connector moves host (cpu) or CUDA caches; got device "
                         f"{device}")


def staging_blocks(spec: Any, num_blocks: int, max_model_len: int) -> int:
    """Blocks of one request's staging area: the longest prompt's, at most the cache's."""
    return min(num_blocks, spec.num_blocks_for(max_model_len))


def _peer_info(peer: Peer, role: str, mode: str, me: str) -> NixlAgentInfo:
    """``peer``'s decoded agent info, checked to run ``mode``."""
    try:
        info = decode_agent_info(peer.connector_md)
    except ProtocolError as exc:
        raise TransferError(f"{role} instance {peer.id}: {exc}") from None
    if info.mode != mode:
        raise TransferError(f"nixl mode mismatch, pairing refused: {mode} ({me}) vs "
                            f"{info.mode} ({peer.id})")
    return info


def _one_block(spec: Any, device: torch.device) -> tuple[PagedKVCache, torch.Tensor]:
    """A two-block cache and one block's staging (to compile the gather or scatter)."""
    return (PagedKVCache(spec, 2, device=device),
            torch.zeros(staging_shape(spec, 1), dtype=spec.dtype, device=device))


class NixlSender(PushSender):
    """P's half. Parameters as :class:`~kvflow.connector.ipc_push.PushSender`, plus ``mode``
    (``direct`` | ``staged``) and ``write_timeout_s`` (bound on waiting for a request's WRITEs,
    seconds; ``kv_connector_config`` key, default :data:`WRITE_TIMEOUT_S`).

    Raises
    ------
    ValueError
        Unknown ``mode``, a device other than CPU, ``layers_per_copy`` < 1,
        ``write_timeout_s`` <= 0.
    """

    name = "nixl"
    #: Every prompt goes layerwise: a WRITE is slower than P's compute of a layer group.
    default_layerwise_min_tokens = 0

    def __init__(self, spec, device: Any = "cpu", *, mode: str = "direct",
                 layers_per_copy: int = LAYERS_PER_COPY,
                 write_timeout_s: float = WRITE_TIMEOUT_S, **kw: Any) -> None:
        super().__init__(spec, device, layers_per_copy=layers_per_copy, **kw)
        _check_mode(mode, self.device)
        if not write_timeout_s > 0:
            raise ValueError(f"kv_connector_config write_timeout_s must be > 0 seconds; got "
                             f"{write_timeout_s!r}")
        self.mode, self.timeout_s = mode, float(write_timeout_s)
        self.agent: Agent | None = None
        self.peers: dict[str, NixlPeer] = {}

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        """P's cache, registered with a new agent (and, staged, a staging buffer)."""
        cache, spec = KVSender.make_cache(self, num_blocks), self.spec
        self.agent = Agent("prefill", progress_thread=False, driven=True)
        mem, dev = mem_type(cache.buffer)
        local = self.agent.register(cache.buffer, block_descs(
            cache.buffer.data_ptr(), spec.num_tensors, num_blocks, spec.block_bytes, dev), mem)
        staging = local_staging = None
        if self.mode == "staged":
            n = staging_blocks(spec, num_blocks, self.max_model_len) * spec.num_tensors
            staging = torch.zeros(n * spec.block_bytes, dtype=torch.uint8, device=self.device)
            local_staging = self.agent.register(staging, block_descs(
                staging.data_ptr(), 1, n, spec.block_bytes, dev), mem)
        self.copier = NixlWriter(self.agent, cache, local, self.mode, self.layers_per_copy,
                                 staging=staging, local_staging=local_staging,
                                 backend=self.backend, timeout_s=self.timeout_s)
        return cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the gather (staged), then a chunked dummy prefill (nothing written)."""
        if self.mode == "staged":
            cache, one = _one_block(self.spec, self.device)
            gather_blocks(cache, [1], one, backend=self.backend)
        self.dummy_run(engine, chunk_size)

    def export(self) -> dict[str, Any]:
        return {"connector_md": encode_agent_info(NixlAgentInfo(
            agent=self.agent.name, metadata=self.agent.metadata(), mode=self.mode))}

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """Load D's agent and prepare its descriptor list (TransferError: bad info or size)."""
        info, spec = _peer_info(peer, "decode", self.mode, self.instance_id), self.spec
        if info.num_blocks != peer.num_blocks or \
                info.cache_bytes != peer.num_blocks * spec.bytes_per_block:
            raise TransferError(f"decode instance {peer.id} registered {info.cache_bytes} bytes "
                                f"for {info.num_blocks} blocks; {peer.num_blocks} blocks of "
                                f"{spec.bytes_per_block} bytes need "
                                f"{peer.num_blocks * spec.bytes_per_block}")
        agent = self.agent.add_peer(peer.id, info.metadata)
        p = NixlPeer(peer.id, agent, peer.num_blocks, spec=peer.spec)
        if self.mode == "direct":
            addr, tensors, n = info.cache_addr, spec.num_tensors, info.num_blocks
        else:
            p.slot_descs = info.slot_bytes // spec.block_bytes
            addr, tensors, n = info.staging_addr, 1, info.staging_slots * p.slot_descs
        p.remote = self.agent.prep(agent, block_descs(addr, tensors, n, spec.block_bytes,
                                                      info.device_id), info.mem_type)
        self.peers[peer.id] = p

    def detach(self, peer_id: str) -> None:
        """Drop D ``peer_id``'s link, descriptor list and agent."""
        KVSender.detach(self, peer_id)
        self.peers.pop(peer_id, None)
        if self.agent is not None:
            self.agent.remove_peer(peer_id)

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        KVSender.close(self)
        self.peers.clear()
        if self.agent is not None:
            self.agent.close()

    def plan(self, job: PrefillJob):
        stats = super().plan(job)
        if sends_allowed():
            self.copier.check(job, stats.dst)
            self.copier.begin(job, stats.dst)
        return stats

    def chunk_hook(self, job: PrefillJob, stats: Any) -> Any:
        """As :meth:`PushSender.chunk_hook`, but a chunk writes only the blocks it completes
        (the last chunk also its partial last block)."""
        if not sends_allowed():
            return None
        copier, n, bs = self.copier, len(job.token_ids), self.spec.block_size
        stats.layerwise = True

        def on_chunk(start: int, end: int):
            stop = -(-end // bs) if end == n else end // bs
            pairs = copier.pairs(job.blocks, job.decode_block_ids, start // bs, stop,
                                 job.num_cached_blocks, stats.dst)
            if pairs is None and not (self.mode == "staged" and end == n):
                return None  # staged: the last chunk's hook gathers every block itself
            return copier.layer_hook(pairs, stats, end == n)

        return on_chunk


class NixlReceiver(KVReceiver):
    """D's half: registers its cache (and, staged, ``staging_slots`` slots) with an agent;
    staged, scatters the sender's slot on ``KVPushed``."""

    name = "nixl"
    acks = False
    peer_writes = True
    host_local = False  # P may live on another host

    def __init__(self, spec=None, device: Any = "cpu", *, backend: str = "auto",
                 mode: str = "direct", staging_slots: int = STAGING_SLOTS,
                 max_model_len: int = 2048, layers_per_copy: int = LAYERS_PER_COPY) -> None:
        super().__init__(spec, device, backend=backend)
        _check_mode(mode, self.device)
        self.mode, self.staging_slots, self.max_model_len = mode, staging_slots, max_model_len
        self.agent: Agent | None = None
        self.staging: torch.Tensor | None = None
        self.slot_bytes = 0
        self.slots: dict[str, int] = {}  # paired P -> its staging slot
        self.received: set[str] = set()  # staged: requests scattered (their slot is freed)
        self.freed: dict[str, str] = {}  # staged: paired P -> the last request freed by receive
        self.expected: set[str] = set()  # requests whose KV may come (the agent polls fast)

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        cache = super().make_cache(num_blocks)
        self.agent = Agent("decode", progress_thread=False, driven=True)
        self.agent.register(cache.buffer)
        if self.mode == "staged":
            self.slot_bytes = (staging_blocks(self.spec, num_blocks, self.max_model_len)
                               * self.spec.bytes_per_block)
            self.staging = torch.zeros(self.staging_slots * self.slot_bytes, dtype=torch.uint8,
                                       device=self.device)
            self.agent.register(self.staging)
        return cache

    def warmup(self) -> None:
        if self.mode == "staged":
            cache, one = _one_block(self.spec, self.device)
            scatter_blocks(one, cache, [1], backend=self.backend)

    def export(self) -> dict[str, Any]:
        staged = self.staging is not None
        mem, dev = mem_type(self.cache.buffer)
        return {"shm_name": "", "connector_md": encode_agent_info(NixlAgentInfo(
            agent=self.agent.name, metadata=self.agent.metadata(),
            cache_addr=self.cache.buffer.data_ptr(), cache_bytes=self.cache.nbytes,
            num_blocks=self.cache.num_blocks, mode=self.mode,
            staging_addr=self.staging.data_ptr() if staged else 0,
            staging_slots=self.staging_slots if staged else 0, slot_bytes=self.slot_bytes,
            mem_type=mem, device_id=dev))}

    def attach(self, peer: Peer) -> None:
        """Staged: load P's agent and give it a free slot (notification ``slot K``).

        Raises
        ------
        SlotsTaken
            Every slot is taken (the pairing may succeed once one frees).
        TransferError
            Bad agent info, or P runs another mode.
        """
        if self.mode != "staged":
            return
        self.detach(peer.id)
        # P refuses too; a P that never writes holds no slot
        info = _peer_info(peer, "prefill", self.mode, "this decode instance")
        free = sorted(set(range(self.staging_slots)) - set(self.slots.values()))
        if not free:
            raise SlotsTaken(f"all {self.staging_slots} staging slots of this decode instance "
                                f"are taken (by {sorted(self.slots)}); raise "
                                f"kv_connector_config staging_slots")
        self.agent.add_peer(peer.id, info.metadata)
        self.slots[peer.id] = free[0]
        self.agent.notify(peer.id, b"slot %d" % free[0])

    def detach(self, peer_id: str) -> None:
        self.slots.pop(peer_id, None)
        self.freed.pop(peer_id, None)
        if self.agent is not None:
            self.agent.remove_peer(peer_id)

    def expect(self, req_id: str) -> None:
        """D allocated ``req_id``'s blocks: progress fast until its ``KVPushed`` or end."""
        if req_id not in self.expected:
            self.expected.add(req_id)
            self.agent.hold(req_id)

    def _arrived(self, req_id: Any) -> None:
        if req_id in self.expected:
            self.expected.discard(req_id)
            self.agent.release(req_id)

    def receive(self, header: Any, frames, cache, dst_ids, peer_id=None) -> TransferStats:
        self._arrived(getattr(header, "req_id", None))
        pid = peer_id or ""
        if not isinstance(header, KVPushed):
            raise TransferError(f"nixl expects a KVPushed header, got {type(header).__name__}")
        try:
            if frames:
                raise TransferError(f"KVPushed carries no payload frames, got {len(frames)}")
            if not header.ok:
                raise TransferError(f"prefill could not write the KV over NIXL: "
                                    f"{header.error or 'no reason given'}")
            if header.num_blocks != len(dst_ids):
                raise TransferError(f"KVPushed for {header.req_id} wrote {header.num_blocks} "
                                    f"blocks; D expects {len(dst_ids)}")
            if self.mode == "staged" and dst_ids:
                self._scatter(peer_id, dst_ids, cache)
        finally:
            if self.mode == "staged":
                self.received.add(header.req_id)
                if not header.ok:
                    self._resend_slot(pid)
                self._free(pid, header.req_id)
                self.freed[pid] = header.req_id
        return TransferStats(blocks=header.num_blocks, payload_bytes=header.payload_bytes,
                             copy_ms=header.copy_ms, layerwise=header.layerwise)

    def _free(self, peer_id: str, req_id: str) -> None:
        self.agent.notify(peer_id, b"free " + req_id.encode())

    def _resend_slot(self, peer_id: str) -> None:
        """P failed a request, maybe waiting for a lost notice: send its ``slot`` and the last
        ``free`` again (both still true; P takes the newest ``slot``)."""
        slot = self.slots.get(peer_id)
        if slot is None:
            return
        self.agent.notify(peer_id, b"slot %d" % slot)
        if peer_id in self.freed:
            self._free(peer_id, self.freed[peer_id])

    def _scatter(self, peer_id: str | None, dst_ids, cache: PagedKVCache) -> None:
        slot = self.slots.get(peer_id or "")
        if slot is None:
            raise TransferError(f"staged KV from {peer_id!r}, which holds no staging slot here "
                                f"(slots: {self.slots})")
        spec, n, lo = self.spec, len(dst_ids), slot * self.slot_bytes
        src = self.staging[lo:lo + n * spec.bytes_per_block]
        src = src.view(spec.dtype).view(staging_shape(spec, n))
        scatter_blocks(src, cache, list(dst_ids), backend=self.backend)
        if src.is_cuda:  # the slot is read until the scatter ran: only then may P reuse it
            torch.cuda.current_stream(src.device).synchronize()

    def forget(self, req_id: str) -> None:
        """``req_id`` ended: stop progressing fast for it; staged and not scattered, tell
        every paired P its slot is free (D does not know which one prefills it)."""
        self._arrived(req_id)
        if self.mode != "staged":
            return
        if req_id in self.received:
            self.received.discard(req_id)
            return
        for peer_id in self.slots:
            self._free(peer_id, req_id)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
