"""Transport ``ipc-push`` (one host): D exports a staging cache of its own spec, P maps it once
and writes the request's blocks into it; D copies them on into its blocks, ``staging_blocks`` at
a time. docs/tutorials/vllm.md."""

from __future__ import annotations

import torch

from kvflow.cache import PagedKVCache
from kvflow.connector import TransferError
from kvflow.connector.transport.shm import export_new_cache, map_decode_cache
from kvflow.kernels import copy_blocks
from kvflow.layout import KVCacheSpec
from kvflow.segments import unlink

from .link import Puller, PullError
from .messages import Pull

#: Default bytes of D's staging cache: requests larger than this move in several chunks.
STAGING_BYTES = 256 << 20


def staging_blocks_for(spec: KVCacheSpec, max_blocks: int, budget: int = STAGING_BYTES) -> int:
    """Blocks of D's staging cache: ``max_blocks`` (D's longest prompt), at most ``budget``
    bytes, at least one."""
    return max(1, min(int(max_blocks), budget // spec.bytes_per_block))


def _sync(cache: PagedKVCache) -> None:
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


class StagingMaps(dict):
    """P's writable mappings of D's staging exports, by export name (mapped at first pull)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__()
        self.spec, self.device = spec, device

    def refusal(self, msg: Pull) -> str:
        """Why P cannot serve the ipc-push ``msg`` ('' when it can: D's export is mapped)."""
        if len(msg.block_ids) > msg.staging_blocks:
            return (f"{len(msg.block_ids)} blocks do not fit D's staging cache of "
                    f"{msg.staging_blocks} blocks")
        if msg.staging not in self or self[msg.staging].num_blocks != msg.staging_blocks:
            try:
                self[msg.staging] = map_decode_cache(msg.staging, self.spec, msg.staging_blocks,
                                                     self.device)
            except TransferError as exc:
                return f"cannot map D's staging cache {msg.staging!r}: {exc}"
        return ""

    def copy_in(self, cache: PagedKVCache, msg: Pull, backend: str) -> None:
        """Copy ``msg.block_ids`` of ``cache`` into blocks ``0..k-1`` of D's export; returns
        once the bytes are there."""
        copy_blocks(cache, self[msg.staging], msg.block_ids, list(range(len(msg.block_ids))),
                    backend=backend)
        _sync(cache)


class IpcPuller(Puller):
    """D's end of transport ``ipc-push``: a staging cache of ``staging_blocks`` blocks (ValueError
    unless an int >= 1; CPU: SegmentSpaceError), each chunk P wrote there copied on into D's."""

    def __init__(self, cache: PagedKVCache, *, staging_blocks: int, timeout_s: float = 30.0,
                 backend: str = "auto", corrupt: bool = False) -> None:
        if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) \
                or staging_blocks < 1:
            raise ValueError(f"staging_blocks must be an int >= 1, got {staging_blocks!r}")
        super().__init__(cache, timeout_s=timeout_s, corrupt=corrupt)
        self.backend, self.staging_blocks = backend, staging_blocks
        self.staging, self.name = export_new_cache(cache.spec, staging_blocks, cache.device,
                                                   "staging")
        copy_blocks(*(PagedKVCache(cache.spec, 2, device=cache.device) for _ in range(2)), [0],
                    [1], backend=backend)  # compile the copy now, not in the first TTFT
        self.chunks = 0  # chunks of the last pull

    def _pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> None:
        step, self.chunks = self.staging_blocks, 0
        try:
            for i in range(0, len(remote_ids), step):
                src, dst = remote_ids[i:i + step], local_ids[i:i + step]
                self._ask_pull(addr, Pull(req_id, src, self.cache.spec.to_dict(),
                                          staging=self.name, staging_blocks=step))
                try:
                    copy_blocks(self.staging, self.cache, list(range(len(src))), dst,
                                backend=self.backend)
                except (TypeError, ValueError) as exc:
                    raise PullError(f"request {req_id}: {exc}") from exc
                _sync(self.cache)  # P reuses the staging next
                self.chunks += 1
        finally:
            self.release(addr, req_id)  # P may free its blocks (also after a failure)

    def close(self) -> None:
        super().close()
        unlink(self.name)
