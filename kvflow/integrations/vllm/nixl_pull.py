"""Transport ``nixl``: D READs P's blocks with one-sided NIXL once it has allocated its own;
each side registers vLLM's KV storage once, D prepares P's descriptor list once per P (from P's
:class:`~.messages.NixlInfo`). Why D reads: docs/tutorials/vllm.md, "Why D pulls"."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np
import torch

from kvflow.cache import PagedKVCache
from kvflow.connector import TransferError
from kvflow.connector.transport.nixl_agent import Agent, mem_type
from kvflow.connector.transport.nixl_plan import block_descs, coalesce, desc_indices

from .link import PeerTimeout, Puller, PullError
from .messages import NixlHello, NixlInfo, Pull


def register(agent: Agent, cache: PagedKVCache) -> None:
    """Register each distinct storage under ``cache``'s tensors with ``agent``, once, whole."""
    seen: set[int] = set()
    for t in cache.tensors():
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            agent.register(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))


def cache_descs(info: NixlInfo) -> np.ndarray:
    """Descriptors ``(address, bytes, device_id)`` (uint64) of every block ``info`` describes:
    row ``t * num_blocks + b`` is block ``b`` of tensor ``t``."""
    return np.concatenate([block_descs(a, 1, info.num_blocks, info.block_bytes, info.device_id)
                           for a in info.addrs])


def export(cache: PagedKVCache, role: str = "vllm-prefill") -> tuple[Agent, NixlInfo]:
    """A new NIXL agent (no progress thread) with ``cache`` registered, and its :class:`NixlInfo`.
    ImportError without NIXL; TransferError without UCX, or for memory neither host nor CUDA."""
    agent = Agent(role, progress_thread=False)
    register(agent, cache)
    mem, dev = mem_type(cache.tensors()[0])
    return agent, NixlInfo(True, agent=agent.name, metadata=agent.metadata(),
                           addrs=[t.data_ptr() for t in cache.tensors()],
                           num_blocks=cache.num_blocks, block_bytes=cache.spec.block_bytes,
                           mem=mem, device_id=dev)


class _Peer(NamedTuple):
    agent: str           # P's agent name
    remote: Any          # P's prepared descriptor list
    num_blocks: int


class NixlPuller(Puller):
    """D's end of transport ``nixl``: a check with P, one READ, a bounded wait, ``Release``; a P
    that does not answer or whose READ fails is forgotten. Arguments as :class:`.link.Puller`."""

    def __init__(self, cache: PagedKVCache, *, timeout_s: float = 30.0,
                 corrupt: bool = False) -> None:
        super().__init__(cache, timeout_s=timeout_s, corrupt=corrupt)
        self.agent, mine = export(cache, "vllm-decode")  # wait() progresses it
        self.local = self.agent.prep("", cache_descs(mine), mine.mem)
        self.peers: dict[str, _Peer] = {}
        self.last_runs = 0  # coalesced runs of the last READ (descriptors per tensor)

    def _meet(self, addr: str) -> _Peer:
        spec = self.cache.spec
        info, _ = self.ask(addr, NixlHello(spec.to_dict()), NixlInfo, f"NIXL hello to {addr}")
        if not info.ok:
            raise PullError(f"P at {addr} refused the NIXL hello: {info.error}")
        if len(info.addrs) != spec.num_tensors or info.block_bytes != spec.block_bytes:
            raise PullError(f"P at {addr} has {len(info.addrs)} tensors of {info.block_bytes}-"
                            f"byte blocks; D has {spec.num_tensors} of {spec.block_bytes}")
        self.forget(addr)
        try:
            name = self.agent.add_peer(addr, info.metadata)
            remote = self.agent.prep(name, cache_descs(info), info.mem)
        except TransferError as exc:
            self.forget(addr)
            raise PullError(str(exc)) from None
        self.peers[addr] = _Peer(name, remote, info.num_blocks)
        return self.peers[addr]

    def forget(self, addr: str) -> None:
        """Drop P at ``addr``: its prepared list and its agent."""
        if (peer := self.peers.pop(addr, None)) is not None:
            with contextlib.suppress(Exception):  # else NIXL frees it with the agent
                peer.remote.release()
        self.agent.remove_peer(addr)

    def _pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> None:
        peer = self.peers.get(addr) or self._meet(addr)
        try:
            reply, _ = self._ask_pull(addr, Pull(req_id, remote_ids, self.cache.spec.to_dict(),
                                                 nixl=True))
        except PeerTimeout:
            self.forget(addr)  # P is gone (or hangs): its agent goes too
            raise
        if reply.agent != peer.agent:  # P restarted behind the same address
            peer = self._meet(addr)
        tensors = range(self.cache.spec.num_tensors)
        what = f"{len(local_ids)} blocks of request {req_id} from {addr}"
        try:
            handle = self.agent.read(self.local, desc_indices(local_ids, tensors,
                                                              self.cache.num_blocks),
                                     peer.remote, desc_indices(remote_ids, tensors,
                                                               peer.num_blocks), what)
            self.agent.wait([handle], self.timeout_s, what, op="READ")
        except TransferError as exc:
            self.forget(addr)
            raise PullError(str(exc)) from None
        finally:
            self.release(addr, req_id)
        self.last_runs = len(coalesce(remote_ids, local_ids))

    def close(self) -> None:
        for addr in list(self.peers):
            self.forget(addr)
        super().close()
        self.agent.close()
