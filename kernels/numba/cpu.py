"""Numba CPU backend: all three ops as one parallel "copy runs" kernel.

Every block of every per-layer tensor is one contiguous run of ``block_bytes`` bytes in all
layouts, so gather, scatter and copy_blocks are one loop: for work item ``w`` over
(tensor in range) x (pair), copy the run at ``src_ptrs[t] + src_ids[i] * block_stride_bytes`` to
``dst_ptrs[t] + dst_ids[i] * block_stride_bytes`` (``block_bytes`` apart in layer-major
layouts, ``bytes_per_block`` in block-major ``BM_NHD``: the spec's strides, no layout branch). ``prange`` spreads items over the threads (no
Python loop per block); runs are copied with 8-byte words when ``block_bytes`` allows.

The pointer tables are int64 base addresses (:meth:`PagedKVCache.ptr_table`, built once per
cache and layer range); a staging buffer is passed as its base address (run ``(t, i)`` at
``base + (t * n + i) * block_bytes``), so a call allocates nothing. Copies below
:data:`~.pointers.PARALLEL_MIN_BYTES` run serially on the calling thread. Compiled lazily on
first use and cached on disk (``cache=True``), so import compiles nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry import register_backend

try:
    import numba

    from .pointers import PARALLEL_MIN_BYTES, as_ptr, serial_and_parallel
    _IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - numba is a core dependency
    numba = None
    _IMPORT_ERROR = str(exc)

if numba is not None:
    def _copy_runs(src_ptrs, dst_ptrs, src_ids, dst_ids, src_base, dst_base, n, src_n, dst_n,
                   run, word, parts, t0, src_step, dst_step):
        """Work item ``w`` = (tensor ``t``, pair ``i``): run ``src_ids[i]`` of ``src_ptrs[t]``
        (or, when ``src_base`` is not 0, run ``t * n + i`` of the staging buffer at
        ``src_base``) to the same on the destination side; ``run`` counts ``word`` units.
        ``src_step`` / ``dst_step``: bytes from one block of a cache tensor to the next
        (``KVCacheSpec.block_stride_bytes``). ``parts`` of ``tensors * n`` (else empty): ``parts[w]`` gets the digest of the words
        item ``w`` moved (:mod:`kvflow.kernels.digest`; ``word`` 4 or 8; positions from
        cache tensor ``t0``)."""
        tensors = src_ptrs.shape[0] if src_base == 0 else dst_ptrs.shape[0]
        digest = parts.shape[0] > 0
        for w in numba.prange(tensors * n):
            t = w // n
            i = w - t * n
            if src_base == 0:
                s = np.int64(src_ids[i])
                if s < 0 or s >= src_n:
                    continue
                sp = src_ptrs[t] + s * src_step
            else:
                sp = src_base + (t * n + i) * run * word
            if dst_base == 0:
                d = np.int64(dst_ids[i])
                if d < 0 or d >= dst_n:
                    continue
                dp = dst_ptrs[t] + d * dst_step
            else:
                dp = dst_base + (t * n + i) * run * word
            if word == 8:
                src = numba.carray(as_ptr(sp), run, np.uint64)
                dst = numba.carray(as_ptr(dp), run, np.uint64)
                if digest:
                    acc = np.int64(0)
                    p = np.int64(t + t0) * run * 2
                    for k in range(run):
                        v = src[k]
                        dst[k] = v
                        x = np.int64(v & np.uint64(0xFFFFFFFF))
                        y = np.int64(v >> np.uint64(32))
                        acc += (x * ((((p + 2 * k) * 0x9E3779B1) & 0xFFFFFFFF) | 1)) & 0xFFFFFFFF
                        acc += (y * ((((p + 2 * k + 1) * 0x9E3779B1) & 0xFFFFFFFF) | 1)) \
                            & 0xFFFFFFFF
                    parts[w] = acc
                else:
                    for k in range(run):
                        dst[k] = src[k]
            elif word == 4:
                src4 = numba.carray(as_ptr(sp), run, np.uint32)
                dst4 = numba.carray(as_ptr(dp), run, np.uint32)
                acc = np.int64(0)
                p = np.int64(t + t0) * run
                for k in range(run):
                    v4 = src4[k]
                    dst4[k] = v4
                    if digest:
                        acc += (np.int64(v4) * ((((p + k) * 0x9E3779B1) & 0xFFFFFFFF) | 1)) \
                            & 0xFFFFFFFF
                if digest:
                    parts[w] = acc
            else:
                src8 = numba.carray(as_ptr(sp), run, np.uint8)
                dst8 = numba.carray(as_ptr(dp), run, np.uint8)
                for k in range(run):
                    dst8[k] = src8[k]

    _serial, _parallel = serial_and_parallel(_copy_runs)

_NONE = np.zeros(0, dtype=np.int64)  # the unused side's table or ids


def copy_runs(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n: int, dst_n: int, run_bytes: int,
              *, src_base: int = 0, dst_base: int = 0, n: int | None = None,
              digest: torch.Tensor | None = None, tensor0: int = 0,
              src_step: int | None = None, dst_step: int | None = None) -> None:
    """Copy run ``src_ids[i]`` of each ``src_ptrs[t]`` to run ``dst_ids[i]`` of ``dst_ptrs[t]``.

    Arrays are numpy int64 (ids int32 or int64); runs are ``run_bytes`` long; ids outside
    ``[0, src_n)`` / ``[0, dst_n)`` (padding -1 included) are skipped. A side given as
    ``*_base`` (an address) is a staging buffer instead: run ``(t, i)`` at
    ``base + (t * n + i) * run_bytes``, and its table and ids are ignored. ``digest``
    (int32 ``[n]``; ``run_bytes`` a multiple of 4): pair ``i``'s digest is written to
    ``digest[i]`` from the same pass over the words (per work item, then summed over tensors:
    the same bits whatever the threads' order); positions count from cache tensor
    ``tensor0`` (the layer range's first). ``src_step`` / ``dst_step``: bytes between
    consecutive blocks of a cache side's tensor (default ``run_bytes``; block-major caches:
    ``spec.block_stride_bytes``).
    """
    n = (src_ids if src_base == 0 else dst_ids).shape[0] if n is None else n
    tensors = (src_ptrs if src_base == 0 else dst_ptrs).shape[0]
    fn = _parallel if tensors * n * run_bytes >= PARALLEL_MIN_BYTES else _serial
    word = 8 if run_bytes % 8 == 0 else 4 if run_bytes % 4 == 0 else 1
    parts = _NONE if digest is None else np.zeros(tensors * n, dtype=np.int64)
    fn(src_ptrs, dst_ptrs, src_ids, dst_ids, src_base, dst_base, n, src_n, dst_n,
       run_bytes // word, word, parts, tensor0,
       run_bytes if src_step is None else src_step, run_bytes if dst_step is None else dst_step)
    if digest is not None:  # mod 2**32, as int32 (kvflow.kernels.digest)
        total = parts.reshape(tensors, n).sum(axis=0) & 0xFFFFFFFF
        digest.numpy()[:] = total.astype(np.uint32).view(np.int32)


def _ptrs(cache, start: int, stop: int) -> np.ndarray:
    """The cache's base addresses of layers ``[start, stop)`` (kept per layer range)."""
    key = ("numba_ptrs", start, stop)
    arr = cache.backend_state.get(key)
    if arr is None:
        T = cache.spec.tensors_per_layer
        arr = cache.backend_state[key] = cache.ptr_table().numpy()[start * T:stop * T].copy()
    return arr


def _ids(ids: torch.Tensor) -> np.ndarray:
    return ids.numpy()


class NumbaCPUBackend:
    name = "numba"
    devices = {"cpu"}

    def unavailable_reason(self):
        return None if numba is not None else f"numba is not installed ({_IMPORT_ERROR})"

    digests = True  # digest=: in the copy's own pass
    block_strides = True  # block-major caches: the cache side steps block_stride_bytes

    def gather(self, cache, ids, out, start, stop, max_ctas=None, digest=None):
        copy_runs(_ptrs(cache, start, stop), _NONE, _ids(ids), _NONE, cache.num_blocks, 0,
                  cache.spec.block_bytes, dst_base=out.data_ptr(), digest=digest,
                  tensor0=start * cache.spec.tensors_per_layer,
                  src_step=cache.spec.block_stride_bytes)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None, digest=None):
        copy_runs(_NONE, _ptrs(cache, start, stop), _NONE, _ids(ids), 0, cache.num_blocks,
                  cache.spec.block_bytes, src_base=src.data_ptr(), digest=digest,
                  tensor0=start * cache.spec.tensors_per_layer,
                  dst_step=cache.spec.block_stride_bytes)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             digest=None):
        copy_runs(_ptrs(src_cache, start, stop), _ptrs(dst_cache, start, stop), _ids(src_ids),
                  _ids(dst_ids), src_cache.num_blocks, dst_cache.num_blocks,
                  src_cache.spec.block_bytes, digest=digest,
                  tensor0=start * src_cache.spec.tensors_per_layer,
                  src_step=src_cache.spec.block_stride_bytes,
                  dst_step=dst_cache.spec.block_stride_bytes)

    def reblock(self, job, max_ctas=None, check=False):
        """Copy between different specs (:mod:`.reblock`), one call over all layers."""
        from .reblock import reblock
        reblock(job)


register_backend(NumbaCPUBackend())
