"""Shared-memory caches (CPU): P's cache for ipc-pull, D's for ipc-push; and on either device a
cache another process of this host maps (:func:`export_new_cache`, :func:`map_decode_cache`).

Segments are files under ``/dev/shm`` named, created and cleaned by :mod:`kvflow.segments`
(``kvflow-<role>-<owner>-<random hex>``: unique per instance, ``O_EXCL``, mode 0600, every
page reserved at creation, so a cache larger than the free shared memory is refused at start-up
instead of dying with SIGBUS later); unlinked by the owner on exit (and by the parent server if
the owner is killed); :func:`kvflow.segments.clean_stale` removes those whose owner is judged dead.

A segment holds the cache's blocks, then (fp8) its float32 scales at
:func:`kvflow.scales.scales_offset`, :func:`kvflow.scales.shared_nbytes` bytes in all: the owner
and every mapping share one scales tensor (D sees the per-block scales P's push computed; a
pulling D reads P's).
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
    """A :class:`PagedKVCache` laid over a shared-memory segment.

    Parameters
    ----------
    spec : KVCacheSpec
    num_blocks : int
    role : str
        Part of the segment name (``prefill``, ``decode``...).

    Attributes
    ----------
    name : str
        Segment name, to hand to the peer.
    cache : PagedKVCache
        The cache (``cache.buffer`` is the mapping; fp8 scales, 1.0 at first, lie in it).

    Raises
    ------
    ValueError
        ``role`` not lowercase letters.
    kvflow.segments.SegmentSpaceError
        The cache (:func:`kvflow.scales.shared_nbytes` bytes: ``num_blocks *
        spec.bytes_per_block``, plus fp8 scales) does not fit in the free shared memory; the
        message gives both sizes and the flags that lower the first.
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
    """Map a peer's segment as a :class:`PagedKVCache`: read-only (D pulls from P's cache), or
    ``writable`` (P pushes into D's cache, ipc-push). An fp8 cache's scales are the segment's
    (:class:`SharedCache`): what one side writes there the other reads.

    Raises
    ------
    TransferError
        If the segment is missing or smaller than :func:`kvflow.scales.shared_nbytes`
        (``num_blocks * spec.bytes_per_block``, plus fp8 scales); the message names both sizes.
    """
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
    """A new cache of ``num_blocks`` blocks that another process on this host can map, and the
    name it finds it by: on CUDA one allocation whose IPC export is published as
    ``kvflow-<role>cuda-...`` (:mod:`.cuda_ipc`), on CPU a :class:`SharedCache` segment
    ``kvflow-<role>-...``. Stale segments of dead owners are removed first. The owner calls
    :func:`kvflow.segments.unlink` on the name when it closes. Either way an fp8 cache's
    scales lie in the exported memory, after the blocks (``scales_in_buffer``).

    Raises
    ------
    kvflow.segments.SegmentSpaceError
        The cache does not fit in the free shared memory (CPU).
    """
    if device.type == "cuda":
        from .cuda_ipc import export_cache, publish_export
        cache = PagedKVCache(spec, num_blocks, device=device, scales_in_buffer=True)
        return cache, publish_export(export_cache(cache), role=f"{role}cuda")
    from kvflow.segments import clean_stale
    clean_stale()
    shared = SharedCache(spec, num_blocks, role=role)
    return shared.cache, shared.name


def map_decode_cache(shm_name: str, spec, num_blocks: int, device: torch.device) -> PagedKVCache:
    """Map D's exported cache writable in P's process, usable by kernels on ``device``.

    CPU: the shared-memory segment ``shm_name``; CUDA: the IPC export published under that name,
    mapped into ``device``'s context (``import_cache(map_on=device)``), so P's kernels write D's
    GPU memory over NVLink.

    Raises
    ------
    TransferError
        Missing segment or export, size or spec mismatch, a GPU this process cannot see.
    """
    if device.type == "cuda":
        from .cuda_ipc import import_cache, read_export
        return import_cache(read_export(shm_name), spec, num_blocks, map_on=device)
    return map_peer_cache(shm_name, spec, num_blocks, writable=True)
