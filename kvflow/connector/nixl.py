"""``nixl``: P writes each request's KV into D's registered memory (host or CUDA) with
one-sided NIXL WRITEs (:mod:`.nixl_writer`) in :class:`~kvflow.connector.ipc_push.PushSender`'s
flow; D's half: :mod:`.nixl_receiver`. See docs/nixl.md ("How it works", "Progress without a
busy thread") and docs/reliability.md, item 5 (lent blocks).
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.connector.messages import NixlAgentInfo, encode_agent_info

from .base import KVSender, Peer, PrefillJob, TransferError
from .ipc_push import PushSender
from .layer_copy import LAYERS_PER_COPY
from .nixl_receiver import NixlReceiver, check_mode, peer_info, staging_blocks  # noqa: F401
from .nixl_writer import NixlPeer, NixlWriter
from .transport.frames import warm_staging
from .transport.nixl_agent import Agent, mem_type
from .transport.nixl_plan import DescPlan, block_descs

WRITE_TIMEOUT_S = 30.0  # default bound (seconds) on P's wait for a request's WRITEs


class NixlSender(PushSender):
    """P's half. Parameters as :class:`~kvflow.connector.ipc_push.PushSender`, plus ``mode``
    (``direct`` | ``staged``) and ``write_timeout_s`` (seconds P waits for a request's WRITEs).
    ValueError: unknown ``mode``, a device other than CPU or CUDA, ``layers_per_copy`` < 1,
    ``write_timeout_s`` <= 0.
    """

    name = "nixl"

    def __init__(self, spec, device: Any = "cpu", *, mode: str = "direct",
                 layers_per_copy: int = LAYERS_PER_COPY,
                 write_timeout_s: float = WRITE_TIMEOUT_S, **kw: Any) -> None:
        super().__init__(spec, device, layers_per_copy=layers_per_copy, **kw)
        check_mode(mode, self.device)
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
        plan = DescPlan(spec, num_blocks, self.layers_per_copy)
        local = self.agent.register(cache.buffer, plan.rows(cache.buffer.data_ptr(), dev), mem)
        staging = local_staging = None
        if self.mode == "staged":
            n = staging_blocks(spec, num_blocks, self.max_model_len) * spec.num_tensors
            staging = torch.zeros(n * spec.block_bytes, dtype=torch.uint8, device=self.device)
            local_staging = self.agent.register(staging, block_descs(
                staging.data_ptr(), 1, n, spec.block_bytes, dev), mem)
        self.copier = NixlWriter(self.agent, cache, local, self.mode, self.layers_per_copy,
                                 plan=plan, staging=staging, local_staging=local_staging,
                                 backend=self.backend, timeout_s=self.timeout_s)
        return cache

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the gather (staged), then a chunked dummy prefill (nothing written)."""
        if self.mode == "staged":
            warm_staging(self.spec, self.device, self.backend)
        self.dummy_run(engine, chunk_size)

    def export(self) -> dict[str, Any]:
        return {"connector_md": encode_agent_info(NixlAgentInfo(
            agent=self.agent.name, metadata=self.agent.metadata(), mode=self.mode))}

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """Load D's agent and prepare its descriptor list (TransferError: bad info or size)."""
        info, spec = peer_info(peer, "decode", self.mode, self.instance_id), self.spec
        if info.num_blocks != peer.num_blocks or \
                info.cache_bytes != peer.num_blocks * spec.bytes_per_block:
            raise TransferError(f"decode instance {peer.id} registered {info.cache_bytes} bytes "
                                f"for {info.num_blocks} blocks; {peer.num_blocks} blocks of "
                                f"{spec.bytes_per_block} bytes need "
                                f"{peer.num_blocks * spec.bytes_per_block}")
        agent = self.agent.add_peer(peer.id, info.metadata)
        p = NixlPeer(peer.id, agent, peer.num_blocks, spec=peer.spec)
        if self.mode == "direct":  # D's cache, laid out as P's (one spec)
            p.plan = DescPlan(spec, info.num_blocks, self.layers_per_copy)
            descs = p.plan.rows(info.cache_addr, info.device_id)
        else:
            p.slot_descs = info.slot_bytes // spec.block_bytes
            descs = block_descs(info.staging_addr, 1, info.staging_slots * p.slot_descs,
                                spec.block_bytes, info.device_id)
        p.remote = self.agent.prep(agent, descs, info.mem_type)
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
            self.copier.stop()
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
