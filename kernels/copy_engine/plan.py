"""Copy plans: the memcpys of one block op as three arrays, built on the host from addresses.

A plan is what the ``copy_engine`` backend hands to the driver: for every copy, a source
address, a destination address and a byte count (:class:`Plan`). It is built from plain
integers (each per-layer tensor's base address, ``spec.block_bytes``, a staging buffer's
address) and the block ids as a host numpy array, so it never touches a device and the CPU
tests execute the very same plan with ``ctypes.memmove`` (:func:`run_on_host`).

How a plan is made (:func:`make_plan`):

1. Pairs ``(src_ids[i], dst_ids[i])`` with an id outside ``[0, num_blocks)`` on either side
   (the -1 padding) are dropped: no copy reads or writes their blocks.
2. Consecutive pairs whose source and destination ids both go up by one form a **run**: one
   copy of ``length * block_bytes`` bytes per per-layer tensor (block ``b`` of a tensor is
   the ``block_bytes`` bytes at ``base + b * stride``, where ``stride`` is
   ``spec.block_stride_bytes``: ``block_bytes`` in a layer-major layout, so a run of ids is
   one contiguous range of each tensor; in a block-major layout (``BM_NHD``) a run is
   spread into its blocks, tensor by tensor, and step 3 joins them again).
3. The runs are repeated for every tensor of the layer range (tensor-major order; block-major
   when a side is block-major, so that a run of a block-major cache is one copy), and copies
   that continue one another on both sides (the end of one is the start of the next, in
   source and destination) are merged: gathering every block of a cache laid over one buffer,
   in order, is a single copy.

Copies of one plan may run in any order (a batched memcpy gives no order), which is right
when no destination byte is also a source byte and no destination is written twice: what
the ops' checks guarantee (distinct destination ids; one cache only with disjoint ids).
With ``validate=False`` and ids that break this, the result is undefined, as on the other
GPU backends.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Plan:
    """The copies of one op: ``size[k]`` bytes from address ``src[k]`` to ``dst[k]``.

    Attributes
    ----------
    src, dst, size : numpy.ndarray, uint64, shape [count]
        Addresses (bytes) and lengths (bytes) of every copy, in plan order.
    runs : int
        Runs of block ids before the copies were spread over tensors and merged.
    """

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    runs: int

    @property
    def count(self) -> int:
        """Number of copies."""
        return int(self.size.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves (the payload)."""
        return int(self.size.sum())


def block_runs(src_ids: np.ndarray, dst_ids: np.ndarray, src_n: int,
               dst_n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of pairs: ``(src_start, dst_start, length)``, int64 arrays of one length each.

    Pair ``i`` is kept when ``0 <= src_ids[i] < src_n`` and ``0 <= dst_ids[i] < dst_n``; a
    run is a maximal stretch of kept pairs in which both ids go up by one from pair to pair.

    >>> block_runs(np.array([4, 5, -1, 7, 9]), np.arange(5), 10, 5)
    (array([4, 7, 9]), array([0, 3, 4]), array([2, 1, 1]))
    """
    s = np.asarray(src_ids, dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    if s.shape != d.shape or s.ndim != 1:
        raise ValueError(f"src_ids and dst_ids must be 1-D of one length, got shapes "
                         f"{s.shape} and {d.shape}")
    keep = (s >= 0) & (s < src_n) & (d >= 0) & (d < dst_n)
    follows = np.zeros_like(keep)  # pair i continues the run of pair i - 1
    follows[1:] = keep[1:] & keep[:-1] & (s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1)
    first = np.flatnonzero(keep & ~follows)
    last = np.flatnonzero(keep & ~np.append(follows[1:], False))
    return s[first], d[first], last - first + 1


def make_plan(src_bases: Sequence[int], dst_bases: Sequence[int], block_bytes: int,
              src_ids: np.ndarray, dst_ids: np.ndarray, src_n: int, dst_n: int,
              src_stride: int | None = None, dst_stride: int | None = None) -> Plan:
    """The plan of moving block ``src_ids[i]`` of every tensor ``j`` (base address
    ``src_bases[j]``) to block ``dst_ids[i]`` of tensor ``j`` (``dst_bases[j]``).

    Parameters
    ----------
    src_bases, dst_bases : sequence of int, one per tensor of the layer range
        Byte addresses of block 0 of each tensor on each side.
    block_bytes : int
        Bytes of one block of one tensor (``spec.block_bytes``).
    src_ids, dst_ids : numpy.ndarray of ints, shape [n]
        Block ids per pair (a staging buffer's side: ``arange(n)``, its slots).
    src_n, dst_n : int
        Blocks per tensor on each side; ids outside ``[0, num)`` skip their pair.
    src_stride, dst_stride : int, optional
        Bytes from block ``b`` to block ``b + 1`` of one tensor on each side
        (``spec.block_stride_bytes``; default ``block_bytes``).

    Returns
    -------
    Plan
        Copies in tensor order, runs in id order within a tensor, continuing copies merged.
    """
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} source tensors but {len(dst_bases)} destination "
                         f"tensors")
    s0, d0, length = block_runs(src_ids, dst_ids, src_n, dst_n)
    runs = len(length)
    ss, ds = src_stride or block_bytes, dst_stride or block_bytes
    sb = np.asarray(src_bases, dtype=np.uint64)[:, None]
    db = np.asarray(dst_bases, dtype=np.uint64)[:, None]
    bb = np.uint64(block_bytes)
    if ss == block_bytes and ds == block_bytes:
        src = (sb + s0.astype(np.uint64) * bb).ravel()
        dst = (db + d0.astype(np.uint64) * bb).ravel()
        size = np.broadcast_to(length.astype(np.uint64) * bb, (len(src_bases), runs)).ravel()
        return _merged(src, dst, size, runs)
    # a block-major side: one copy per (block, tensor), block-major order, then merged
    step = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(np.cumsum(length) - length,
                                                                   length)
    s1 = (np.repeat(s0, length) + step).astype(np.uint64)[:, None]
    d1 = (np.repeat(d0, length) + step).astype(np.uint64)[:, None]
    src = (sb.T + s1 * np.uint64(ss)).ravel()
    dst = (db.T + d1 * np.uint64(ds)).ravel()
    return _merged(src, dst, np.full(src.shape[0], bb, dtype=np.uint64), runs)


def _merged(src: np.ndarray, dst: np.ndarray, size: np.ndarray, runs: int) -> Plan:
    """Merge each copy into the one before it when it continues it on both sides."""
    if src.shape[0] > 1:
        cont = np.empty(src.shape[0], dtype=bool)
        cont[0] = False
        cont[1:] = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
        if cont.any():
            heads = np.flatnonzero(~cont)
            size = np.add.reduceat(size, heads)
            src, dst = src[heads], dst[heads]
    return Plan(np.ascontiguousarray(src), np.ascontiguousarray(dst),
                np.ascontiguousarray(size, dtype=np.uint64), runs)


def _bases(cache, start: int, stop: int) -> list[int]:
    """Base addresses of the cache's tensors of layers ``[start, stop)``."""
    tpl = cache.spec.tensors_per_layer
    return list(cache.memory_span()[2][start * tpl:stop * tpl])


def _stage_bases(ptr: int, num_tensors: int, n: int, block_bytes: int) -> list[int]:
    """Base addresses of a staging buffer's ``[l, t]`` slices (``n`` blocks each)."""
    return [ptr + j * n * block_bytes for j in range(num_tensors)]


def gather_plan(cache, ids: np.ndarray, out_ptr: int, start: int, stop: int) -> Plan:
    """Plan of :func:`kvflow.kernels.gather_blocks`: block ``ids[i]`` of each tensor of
    layers ``[start, stop)`` to slot ``i`` of the staging buffer at ``out_ptr``
    (``staging_shape(spec, n, (start, stop))``, contiguous)."""
    bb, n = cache.spec.block_bytes, ids.shape[0]
    src = _bases(cache, start, stop)
    return make_plan(src, _stage_bases(out_ptr, len(src), n, bb), bb, ids, np.arange(n),
                     cache.num_blocks, n, src_stride=cache.spec.block_stride_bytes)


def scatter_plan(src_ptr: int, cache, ids: np.ndarray, start: int, stop: int) -> Plan:
    """Plan of :func:`kvflow.kernels.scatter_blocks`: slot ``i`` of the staging buffer at
    ``src_ptr`` to block ``ids[i]`` of each tensor of layers ``[start, stop)``."""
    bb, n = cache.spec.block_bytes, ids.shape[0]
    dst = _bases(cache, start, stop)
    return make_plan(_stage_bases(src_ptr, len(dst), n, bb), dst, bb, np.arange(n), ids,
                     n, cache.num_blocks, dst_stride=cache.spec.block_stride_bytes)


def copy_plan(src_cache, dst_cache, src_ids: np.ndarray, dst_ids: np.ndarray, start: int,
              stop: int) -> Plan:
    """Plan of :func:`kvflow.kernels.copy_blocks` between caches of one spec: block
    ``src_ids[i]`` to block ``dst_ids[i]`` of each tensor of layers ``[start, stop)``."""
    return make_plan(_bases(src_cache, start, stop), _bases(dst_cache, start, stop),
                     dst_cache.spec.block_bytes, src_ids, dst_ids, src_cache.num_blocks,
                     dst_cache.num_blocks, src_stride=src_cache.spec.block_stride_bytes,
                     dst_stride=dst_cache.spec.block_stride_bytes)


def run_on_host(plan: Plan) -> None:
    """Execute ``plan`` with ``ctypes.memmove``, copy by copy: for plans over host memory
    (the CPU tests, which compare the result with the torch reference byte for byte)."""
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()):
        ctypes.memmove(d, s, n)
