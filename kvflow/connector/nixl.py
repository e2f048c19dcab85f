"""``nixl``: P writes each request's KV into D's registered memory with one-sided NIXL WRITEs;
P and D may be on different hosts. Caches on the host (``DRAM``: UCX over TCP, RDMA or shared
memory) or on CUDA GPUs (``VRAM``: UCX's cuda_ipc between processes of one host, RDMA across
hosts where the NIC can reach GPU memory).

D registers its whole cache once (one allocation: block ``b`` of tensor ``t`` is at
``cache_addr + (t * num_blocks + b) * block_bytes``) and publishes its agent's metadata and
that address in ``Register.connector_md`` (:class:`~kvflow.protocol.NixlAgentInfo`); the router
hands it to P in ``Pair.peer_connector_md``, and P loads it (``add_remote_agent``) and prepares
D's descriptor list once. No etcd, no metadata server. Then it is
:class:`~kvflow.connector.ipc_push.PushSender`'s flow with NIXL WRITEs instead of
``copy_blocks`` (:mod:`.nixl_writer`): per layer group while P prefills (from
``layerwise_min_tokens``, default 0), P waits for its WRITEs (``check_xfer_state``), then sends
the existing :class:`~kvflow.protocol.KVPushed`; a failed WRITE is ``KVPushed(ok=False)`` and
the request fails (HTTP 502). D's blocks are lent to P until then (docs/reliability.md, item 5).
Staged mode adds a staging buffer on both sides and D scatters on ``KVPushed``; D assigns each
paired P a slot (NIXL notification ``slot K``) and frees it after the scatter (``free REQ``);
after a failed request of a P it sends both again (one may have been lost). P takes the newest
``slot``, keeps a ``free`` that came before its write (D ended that request first), and
refuses a request with more blocks than a slot holds.

Neither agent runs NIXL's progress thread (it polls while idle): kvflow's progress driver
(:mod:`.nixl_progress`) progresses P's agent while its WRITEs are in flight and D's while it
expects a request's KV (:meth:`NixlReceiver.expect`), each every 10 ms otherwise.

A dead or unpaired peer's agent is removed (``remove_remote_agent``). On one host UCX takes
shared memory unless ``UCX_TLS=tcp``: tests of the network path set it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.kernels import gather_blocks, scatter_blocks
from kvflow.connector.messages import (KVPushed, NixlAgentInfo, ProtocolError, decode_agent_info,
                                       encode_agent_info)

from .base import (KVReceiver, KVSender, Peer, PrefillJob, SlotsTaken, TransferError,
                   TransferStats)
from .ipc_push import PushSender
from .layer_copy import LAYERS_PER_COPY
from .transport.nixl_agent import Agent, block_descs, mem_type
from .nixl_writer import NixlPeer, NixlWriter

MODES = ("direct", "staged")
#: Staging slots of a staged D (paired P's it can serve).
STAGING_SLOTS = 4
#: Default bound (seconds) on P's wait for a request's WRITEs (``write_timeout_s``).
WRITE_TIMEOUT_S = 30.0


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
    #: Every prompt goes layerwise: a WRITE crosses a network, slower than P's compute of a
    #: layer group, so overlapping them pays from the first block (ipc-push's copy does not).
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
        cache = KVSender.make_cache(self, num_blocks)
        spec = self.spec
        self.agent = Agent("prefill", progress_thread=False, driven=True)
        self.agent.register(cache.buffer)
        mem, dev = mem_type(cache.buffer)
        local = self.agent.prep("", block_descs(cache.buffer.data_ptr(), spec.num_tensors,
                                                num_blocks, spec.block_bytes, dev), mem)
        staging = local_staging = None
        if self.mode == "staged":
            n = staging_blocks(spec, num_blocks, self.max_model_len) * spec.num_tensors
            staging = torch.zeros(n * spec.block_bytes, dtype=torch.uint8, device=self.device)
            self.agent.register(staging)
            local_staging = self.agent.prep("", block_descs(staging.data_ptr(), 1, n,
                                                            spec.block_bytes, dev), mem)
        self.copier = NixlWriter(self.agent, cache, local, self.mode, self.layers_per_copy,
                                 staging=staging, local_staging=local_staging,
                                 backend=self.backend, timeout_s=self.timeout_s)
        return cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the gather (staged), then a chunked dummy prefill (nothing written)."""
        if self.mode == "staged":
            a = PagedKVCache(self.spec, 2, device=self.device)
            gather_blocks(a, [1], torch.empty((self.spec.num_layers, self.spec.tensors_per_layer,
                                               1, *self.spec.block_shape), dtype=self.spec.dtype,
                                              device=self.device),
                          backend=self.backend)
        self.dummy_run(engine, chunk_size)

    def export(self) -> dict[str, Any]:
        return {"connector_md": encode_agent_info(NixlAgentInfo(
            agent=self.agent.name, metadata=self.agent.metadata(), mode=self.mode))}

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """Load D ``peer``'s agent and prepare its descriptor list.

        Raises
        ------
        TransferError
            D sent no or bad agent info, another mode, or a cache of another size.
        """
        try:
            info = decode_agent_info(peer.connector_md)
        except ProtocolError as exc:
            raise TransferError(f"decode instance {peer.id}: {exc}") from None
        if info.mode != self.mode:
            raise TransferError(f"nixl mode mismatch, pairing refused: {self.mode} "
                                f"({self.instance_id}) vs {info.mode} ({peer.id})")
        spec = self.spec
        if info.num_blocks != peer.num_blocks or \
                info.cache_bytes != peer.num_blocks * spec.bytes_per_block:
            raise TransferError(f"decode instance {peer.id} registered {info.cache_bytes} bytes "
                                f"for {info.num_blocks} blocks; {peer.num_blocks} blocks of "
                                f"{spec.bytes_per_block} bytes need "
                                f"{peer.num_blocks * spec.bytes_per_block}")
        agent = self.agent.add_peer(peer.id, info.metadata)
        p = NixlPeer(peer.id, agent, peer.num_blocks, spec=peer.spec)
        if self.mode == "direct":
            p.remote = self.agent.prep(agent, block_descs(
                info.cache_addr, spec.num_tensors, info.num_blocks, spec.block_bytes,
                info.device_id), info.mem_type)
        else:
            p.slot_descs = info.slot_bytes // spec.block_bytes
            p.remote = self.agent.prep(agent, block_descs(
                info.staging_addr, 1, info.staging_slots * p.slot_descs, spec.block_bytes,
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
        (the last chunk also its partial last block): a WRITE reads P's block after it is
        posted, so a block still being filled is never posted twice."""
        if not sends_allowed():
            return None
        copier, n, bs = self.copier, len(job.token_ids), self.spec.block_size
        stats.layerwise = True

        def on_chunk(start: int, end: int):
            stop = -(-end // bs) if end == n else end // bs
            pairs = copier.pairs(job.blocks, job.decode_block_ids, start // bs, stop,
                                 job.num_cached_blocks, stats.dst)
            if self.mode == "staged" and end == n:  # the hook gathers every block itself
                return copier.layer_hook(pairs, stats, True)
            return None if pairs is None else copier.layer_hook(pairs, stats, end == n)

        return on_chunk


class NixlReceiver(KVReceiver):
    """D's half: registers its cache (and, staged, ``staging_slots`` slots) with an agent;
    a ``KVPushed`` says the KV is in D's blocks (direct) or in the sender's slot (staged:
    scattered here)."""

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
            src = torch.zeros((self.spec.num_layers, self.spec.tensors_per_layer, 1,
                               *self.spec.block_shape), dtype=self.spec.dtype,
                              device=self.device)
            scatter_blocks(src, PagedKVCache(self.spec, 2, device=self.device), [1],
                           backend=self.backend)

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
        try:
            info = decode_agent_info(peer.connector_md)
        except ProtocolError as exc:
            raise TransferError(f"prefill instance {peer.id}: {exc}") from None
        if info.mode != self.mode:  # P refuses too; a P that never writes holds no slot
            raise TransferError(f"nixl mode mismatch, pairing refused: {self.mode} (this "
                                f"decode instance) vs {info.mode} ({peer.id})")
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
        """D allocated ``req_id``'s blocks: P's WRITEs may come, so the agent progresses
        fast until the request's ``KVPushed`` (:meth:`receive`) or its end (:meth:`forget`)."""
        if req_id not in self.expected:
            self.expected.add(req_id)
            self.agent.hold(req_id)

    def _arrived(self, req_id: Any) -> None:
        if req_id in self.expected:
            self.expected.discard(req_id)
            self.agent.release(req_id)

    def receive(self, header: Any, frames, cache, dst_ids, peer_id=None) -> TransferStats:
        self._arrived(getattr(header, "req_id", None))
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
                    self._resend_slot(peer_id or "")
                self.agent.notify(peer_id or "", b"free " + header.req_id.encode())
                self.freed[peer_id or ""] = header.req_id
        return TransferStats(blocks=header.num_blocks, payload_bytes=header.payload_bytes,
                             copy_ms=header.copy_ms, layerwise=header.layerwise)

    def _resend_slot(self, peer_id: str) -> None:
        """P ``peer_id`` failed a request: it may have timed out waiting for a notice that was
        lost (its ``slot``, or the ``free`` of the request before). Send both again: each is
        still true (the slot is P's; this D read that request's slot for the last time), and
        P takes the newest ``slot`` and ignores a ``free`` it does not wait for."""
        slot = self.slots.get(peer_id)
        if slot is None:
            return
        self.agent.notify(peer_id, b"slot %d" % slot)
        if peer_id in self.freed:
            self.agent.notify(peer_id, b"free " + self.freed[peer_id].encode())

    def _scatter(self, peer_id: str | None, dst_ids, cache: PagedKVCache) -> None:
        slot = self.slots.get(peer_id or "")
        if slot is None:
            raise TransferError(f"staged KV from {peer_id!r}, which holds no staging slot here "
                                f"(slots: {self.slots})")
        spec, n = self.spec, len(dst_ids)
        src = self.staging[slot * self.slot_bytes:slot * self.slot_bytes + n * spec.bytes_per_block]
        src = src.view(spec.dtype).view(spec.num_layers, spec.tensors_per_layer, n,
                                        *spec.block_shape)
        scatter_blocks(src, cache, list(dst_ids), backend=self.backend)
        if src.is_cuda:  # the slot is read until the scatter ran: only then may P reuse it
            torch.cuda.current_stream(src.device).synchronize()

    def forget(self, req_id: str) -> None:
        """Staged: a request that ends before its KV was scattered frees its slot (every paired
        P is told: D does not know which one prefills it). Every mode: the agent stops
        progressing fast for it."""
        self._arrived(req_id)
        if self.mode != "staged":
            return
        if req_id in self.received:
            self.received.discard(req_id)
            return
        for peer_id in self.slots:
            self.agent.notify(peer_id, b"free " + req_id.encode())

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
