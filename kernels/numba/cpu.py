"""Numba CPU backend: all three ops as one parallel "copy runs" kernel.

Every block of every per-layer tensor is one contiguous run of ``block_bytes`` bytes in all
layouts, so gather, scatter and copy_blocks are one loop: for work item ``w`` over
(tensor in range) x (pair), copy the run at ``src_ptrs[t] + src_ids[i] * block_bytes`` to
``dst_ptrs[t] + dst_ids[i] * block_bytes``. ``prange`` spreads items over the threads (no
Python loop per block); runs are copied with 8-byte words when ``block_bytes`` allows.

The pointer tables are int64 base addresses (:meth:`PagedKVCache.ptr_table`, built once per
cache); a staging buffer is described as one pointer per (layer, tensor) and ids ``0..n-1``.
Compiled lazily on first use and cached on disk (``cache=True``), so import compiles nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry import register_backend

try:
    import numba
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
    _IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - numba is a core dependency
    numba = None
    _IMPORT_ERROR = str(exc)


if numba is not None:
    @intrinsic
    def _as_ptr(typingctx, addr):
        """Reinterpret an int64 address as a void pointer (for numba.carray)."""
        sig = types.voidptr(addr)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return sig, codegen

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _copy_runs_u64(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, run_words):
        n = src_ids.shape[0]
        for w in numba.prange(src_ptrs.shape[0] * n):
            t = w // n
            i = w - t * n
            s = src_ids[i]
            d = dst_ids[i]
            if s < 0 or d < 0 or s >= src_n or d >= dst_n:
                continue
            src = numba.carray(_as_ptr(src_ptrs[t] + s * run_words * 8), run_words, np.uint64)
            dst = numba.carray(_as_ptr(dst_ptrs[t] + d * run_words * 8), run_words, np.uint64)
            for k in range(run_words):
                dst[k] = src[k]

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _copy_runs_u8(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, run_bytes):
        n = src_ids.shape[0]
        for w in numba.prange(src_ptrs.shape[0] * n):
            t = w // n
            i = w - t * n
            s = src_ids[i]
            d = dst_ids[i]
            if s < 0 or d < 0 or s >= src_n or d >= dst_n:
                continue
            src = numba.carray(_as_ptr(src_ptrs[t] + s * run_bytes), run_bytes, np.uint8)
            dst = numba.carray(_as_ptr(dst_ptrs[t] + d * run_bytes), run_bytes, np.uint8)
            for k in range(run_bytes):
                dst[k] = src[k]


def copy_runs(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n: int, dst_n: int, run_bytes: int) -> None:
    """Copy run ``src_ids[i]`` of each ``src_ptrs[t]`` to run ``dst_ids[i]`` of ``dst_ptrs[t]``.

    All arrays are int64 numpy arrays; runs are ``run_bytes`` long; ids outside
    ``[0, src_n)`` / ``[0, dst_n)`` (padding -1 included) are skipped.
    """
    if run_bytes % 8 == 0:
        _copy_runs_u64(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, run_bytes // 8)
    else:
        _copy_runs_u8(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, run_bytes)


def _ptrs(cache, start: int, stop: int) -> np.ndarray:
    T = cache.spec.tensors_per_layer
    return cache.ptr_table().numpy()[start * T:stop * T]


def _staging_ptrs(buf: torch.Tensor, num_runs: int, run_bytes: int) -> np.ndarray:
    per_tensor = num_runs * run_bytes
    count = buf.numel() * buf.element_size() // per_tensor if per_tensor else 0
    return buf.data_ptr() + np.arange(count, dtype=np.int64) * per_tensor


def _ids(ids: torch.Tensor) -> np.ndarray:
    return ids.numpy().astype(np.int64, copy=False)


class NumbaCPUBackend:
    name = "numba"
    devices = {"cpu"}

    def unavailable_reason(self):
        return None if numba is not None else f"numba is not installed ({_IMPORT_ERROR})"

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        n, bb = ids.numel(), cache.spec.block_bytes
        copy_runs(_ptrs(cache, start, stop), _staging_ptrs(out, n, bb), _ids(ids),
                  np.arange(n, dtype=np.int64), cache.num_blocks, n, bb)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        n, bb = ids.numel(), cache.spec.block_bytes
        copy_runs(_staging_ptrs(src, n, bb), _ptrs(cache, start, stop),
                  np.arange(n, dtype=np.int64), _ids(ids), n, cache.num_blocks, bb)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None):
        copy_runs(_ptrs(src_cache, start, stop), _ptrs(dst_cache, start, stop), _ids(src_ids),
                  _ids(dst_ids), src_cache.num_blocks, dst_cache.num_blocks,
                  src_cache.spec.block_bytes)


register_backend(NumbaCPUBackend())
