"""Shared-memory caches (CPU): P's cache for ipc-pull, D's for ipc-push; and on either device a
cache another process of this host maps (:func:`export_new_cache`, :func:`map_decode_cache`).
Segments are named, created (0600, every page reserved) and cleaned by :mod:`kvflow.segments`;
one holds the blocks, then an fp8 cache's scales (:func:`kvflow.scales.shared_nbytes` bytes),
shared by the owner and every mapping.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from kvflow import segments
from kvflow.cache import PagedKVCache
from kvflow.layout import KVCacheSpec
from kvflow.scales import shared_nbytes, shared_parts
from kvflow.segments import segment_path, unlink

from . import TransferError

__all__ = ["SharedCache", "export_new_cache", "map_peer_cache"]


class SharedCache:
    """A :class:`PagedKVCache` laid over a shared-memory segment: ``role`` (lowercase letters, else
    ValueError) is part of the segment name ``name``; ``cache.buffer`` is the mapping (fp8 scales,
    1.0 at first, lie in it). :class:`kvflow.segments.SegmentSpaceError` when the cache does not fit
    in the free shared memory (naming both sizes and the flags that lower the first).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, role: str = "prefill") -> None:
        nbytes = shared_nbytes(spec, num_blocks)
        scales = f" + {nbytes - num_blocks * spec.bytes_per_block} bytes of scales" \
            if spec.is_fp8 else ""
        self.name, fd = segments.create(
            role, nbytes, what=f"the {role} instance's KV cache ({num_blocks} blocks x "
                               f"{spec.bytes_per_block} bytes{scales})",
            hint="lower --num-blocks or --memory-budget-mb")
        self.path = segment_path(self.name)
        try:
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.cache = PagedKVCache(spec, num_blocks, scales_in_buffer=True,
                                  buffer=torch.frombuffer(self._mmap, dtype=torch.uint8))
        if self.cache.scales is not None:  # a new cache's scales are 1.0
            self.cache.scales.fill_(1.0)
        self._owner = os.getpid()

    def close(self) -> None:
        """Unlink the segment (the mapping stays valid until this process exits)."""
        if self._owner == os.getpid():
            unlink(self.name)


def map_peer_cache(name: str, spec: KVCacheSpec, num_blocks: int, *,
                   writable: bool = False) -> PagedKVCache:
    """Map a peer's segment as a :class:`PagedKVCache`, read-only or ``writable`` (fp8 scales: the
    segment's); TransferError when it is missing or smaller than ``shared_nbytes`` (both named)."""
    path = segment_path(name)
    need = shared_nbytes(spec, num_blocks)
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise TransferError(f"shared-memory segment {name!r} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        if size < need:
            raise TransferError(f"segment {name!r} holds {size} bytes; the peer cache of "
                                f"{num_blocks} blocks needs {need}"
                                + shared_parts(spec, num_blocks))
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, need, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only mapping: we only read through it
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    cache = PagedKVCache(spec, num_blocks, buffer=buf, scales_in_buffer=True)
    cache.backend_state["mmap"] = mm
    return cache


def export_new_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                     role: str) -> tuple[PagedKVCache, str]:
    """A new cache that another process on this host can map, and the name it finds it by (CUDA: a
    published IPC export ``kvflow-<role>cuda-...``; CPU: a :class:`SharedCache`, after removing
    stale segments); the owner unlinks it. :class:`kvflow.segments.SegmentSpaceError` when it does
    not fit (CPU)."""
    if device.type == "cuda":
        from .cuda_ipc import export_cache, publish_export
        cache = PagedKVCache(spec, num_blocks, device=device, scales_in_buffer=True)
        return cache, publish_export(export_cache(cache), role=f"{role}cuda")
    from kvflow.segments import clean_stale
    clean_stale()
    shared = SharedCache(spec, num_blocks, role=role)
    return shared.cache, shared.name


def map_decode_cache(shm_name: str, spec, num_blocks: int, device: torch.device) -> PagedKVCache:
    """Map D's exported cache ``shm_name`` writable in P's process (a CUDA export into ``device``'s
    context); TransferError: missing, size or spec mismatch, a GPU this process cannot see."""
    if device.type == "cuda":
        from .cuda_ipc import import_cache, read_export
        return import_cache(read_export(shm_name), spec, num_blocks, map_on=device)
    return map_peer_cache(shm_name, spec, num_blocks, writable=True)
