"""D's half of the ``nixl`` kind (:class:`NixlReceiver`, loaded through
:mod:`kvflow.connector.nixl`), and what both halves share: the modes, the size of a staging
slot, the check of a peer's agent info. D publishes its registered memory in
``Register.connector_md``; P WRITEs into it. See docs/nixl.md, "How it works".
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_shape
from kvflow.kernels import scatter_blocks
from kvflow.connector.messages import (KVPushed, NixlAgentInfo, ProtocolError, decode_agent_info,
                             encode_agent_info)

from .base import KVReceiver, Peer, SlotsTaken, TransferError, TransferStats
from .receiver import RECEIVE_MAX_CTAS
from .ipc_push import pushed_stats
from .layer_copy import LAYERS_PER_COPY
from .transport.frames import warm_staging
from .transport.nixl_agent import Agent, mem_type

MODES = ("direct", "staged")
STAGING_SLOTS = 4  # of a staged D: the paired P's it can serve


def check_mode(mode: Any, device: torch.device) -> None:
    """ValueError for a ``mode`` not in :data:`MODES` or a device other than CPU or CUDA."""
    if mode not in MODES:
        raise ValueError(f"kv_connector_config mode must be one of {', '.join(MODES)}; got "
                         f"{mode!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the nixl connector moves host (cpu) or CUDA caches; got device "
                         f"{device}")


def staging_blocks(spec: Any, num_blocks: int, max_model_len: int) -> int:
    """Blocks of one request's staging area: the longest prompt's, at most the cache's."""
    return min(num_blocks, spec.num_blocks_for(max_model_len))


def peer_info(peer: Peer, role: str, mode: str, me: str) -> NixlAgentInfo:
    """``peer``'s decoded agent info, checked to run ``mode``."""
    try:
        info = decode_agent_info(peer.connector_md)
    except ProtocolError as exc:
        raise TransferError(f"{role} instance {peer.id}: {exc}") from None
    if info.mode != mode:
        raise TransferError(f"nixl mode mismatch, pairing refused: {mode} ({me}) vs "
                            f"{info.mode} ({peer.id})")
    return info


class NixlReceiver(KVReceiver):
    """D's half: registers its cache (and, staged, ``staging_slots`` slots) with an agent;
    staged, scatters the sender's slot on ``KVPushed``."""

    name = "nixl"
    acks = False
    peer_writes = True
    host_local = False  # P may live on another host

    def __init__(self, spec=None, device: Any = "cpu", *, backend: str = "auto",
                 mode: str = "direct", staging_slots: int = STAGING_SLOTS,
                 max_model_len: int = 2048, layers_per_copy: int = LAYERS_PER_COPY,
                 receive_max_ctas: int = RECEIVE_MAX_CTAS) -> None:
        super().__init__(spec, device, backend=backend)
        self.receive_max_ctas = receive_max_ctas  # staged: the cap of D's scatter
        check_mode(mode, self.device)
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
            warm_staging(self.spec, self.device, self.backend, scatter=True)

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
        """Staged: load P's agent and give it a free slot (notice ``slot K``). Raises
        SlotsTaken when every slot is taken (the pairing may succeed once one frees), and
        TransferError for bad agent info or another mode."""
        if self.mode != "staged":
            return
        self.detach(peer.id)  # a mode mismatch: P refuses too, but then it holds no slot
        info = peer_info(peer, "prefill", self.mode, "this decode instance")
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
            stats = pushed_stats(header, frames, dst_ids,
                                 "prefill could not write the KV over NIXL")
            if self.mode == "staged" and dst_ids:
                self._scatter(peer_id, dst_ids, cache)
        finally:
            if self.mode == "staged":
                self.received.add(header.req_id)
                if not header.ok:
                    self._resend_slot(pid)
                self._free(pid, header.req_id)
                self.freed[pid] = header.req_id
        return stats

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
        scatter_blocks(src, cache, list(dst_ids), backend=self.backend,
                       max_ctas=self.receive_max_ctas)
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
