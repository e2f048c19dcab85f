"""Native backends: ``native`` (C++ host memcpy, always built) and ``xpu`` (Kunlun XPU, built
only with ``KVFLOW_XPU_SDK``), both from the extension ``kvflow._native`` (sources in ``xpu/``).

The work is the same "copy runs" as :mod:`kvflow.kernels.numba.cpu`: every block of every
per-layer tensor is one contiguous run of ``spec.block_bytes`` bytes, and consecutive blocks of
a cache tensor lie ``spec.block_stride_bytes`` apart (``block_bytes``; block-major ``BM_NHD``:
``num_tensors * block_bytes``, hence ``block_strides = True``). Gather, scatter and copy_blocks
copy the run at ``src_ptrs[t] + src_ids[i] * src_stride`` to ``dst_ptrs[t] + dst_ids[i] *
dst_stride``; a staging buffer is one base per (layer, tensor) with slots ``0..n-1`` (stride
``block_bytes``). Ids outside the cache (padding -1 included) are skipped. The host backend
splits the runs over a persistent C++ thread pool (GIL released), merging runs that continue
each other in memory on both sides into one ``memcpy``. ``KVFLOW_NATIVE_THREADS`` caps its
threads (default: all cores, at most 16).

The ``xpu`` backend issues one ``xpu_memcpy_async`` per run on the default XPU stream, then
``xpu_wait``; its ids are read on the host. torch has no Kunlun device (torch's ``"xpu"`` is
Intel's), so a paddle-xpu engine calls :func:`copy_runs_ptr` with its tensors' addresses.

If ``kvflow._native`` is missing or fails to import, both backends stay registered and
``available_backends()`` gives the import error.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .registry import register_backend

try:
    from kvflow import _native
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built (no compiler at install) or built for another Python
    _native = None
    _IMPORT_ERROR = (f"kvflow._native is not built or failed to import ({exc}); reinstall with "
                     f"`pip install -e .` on a machine with a C++17 compiler")


def _num_threads() -> int:
    raw = os.environ.get("KVFLOW_NATIVE_THREADS", "0").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"KVFLOW_NATIVE_THREADS must be a non-negative int, got {raw!r}")
    return n


def _ptrs(cache, start: int, stop: int) -> np.ndarray:
    T = cache.spec.tensors_per_layer
    return cache.ptr_table().cpu().numpy()[start * T:stop * T]


def _ids(ids: torch.Tensor) -> np.ndarray:
    return ids.cpu().numpy().astype(np.int64, copy=False)


def copy_runs_ptr(src_ptrs: Any, dst_ptrs: Any, src_ids: Any, dst_ids: Any, *, src_n: int,
                  dst_n: int, run_bytes: int, device: str = "host", num_threads: int = 0,
                  src_stride: int | None = None, dst_stride: int | None = None) -> int:
    """Pointer-level entry point: copy the ``run_bytes`` at ``src_ptrs[t] + src_ids[i] *
    src_stride`` to ``dst_ptrs[t] + dst_ids[i] * dst_stride`` for every t and i (for callers
    without torch tensors, e.g. paddle on XPU).

    Parameters
    ----------
    src_ptrs, dst_ptrs : sequence of int, length T
        Base addresses (bytes) of the T source / destination tensors.
    src_ids, dst_ids : sequence of int, length n, or None
        Run indices (None: ``0..n-1``, a staging buffer); ids outside ``[0, src_n)`` /
        ``[0, dst_n)`` (e.g. -1) skip the pair.
    src_n, dst_n : int
        Runs (blocks) per source / destination tensor.
    run_bytes : int
        Bytes per run (``KVCacheSpec.block_bytes``).
    src_stride, dst_stride : int or None
        Bytes from run k to run k + 1 of one source / destination tensor
        (``KVCacheSpec.block_stride_bytes``); None: ``run_bytes``. At least ``run_bytes``.
    device : {"host", "xpu"}
        ``"xpu"`` only when compiled with the SDK.

    Returns
    -------
    int
        Runs copied.

    Raises
    ------
    RuntimeError
        ``kvflow._native`` is not available; ValueError for a bad length, size or stride
        (``"src_stride must be >= run_bytes (R), got S"``).
    """
    if _native is None:
        raise RuntimeError(_IMPORT_ERROR)
    if (src_ids is None) and (dst_ids is None):
        raise ValueError("src_ids and dst_ids are both None; give the ids of one side at least")
    n = len(src_ids) if src_ids is not None else len(dst_ids)
    as_arr = (lambda v: None if v is None else np.asarray(v, dtype=np.int64))
    return _native.copy_runs(as_arr(src_ptrs), as_arr(dst_ptrs), as_arr(src_ids), as_arr(dst_ids),
                             n, src_n, dst_n, run_bytes, num_threads=num_threads, device=device,
                             src_stride=src_stride, dst_stride=dst_stride)


def get_peer_mem_addr(tensor: Any, device: str = "host") -> int:
    """The address to register a buffer under with a transport (RDMA, Mooncake, NIXL).

    Parameters
    ----------
    tensor : torch.Tensor or int
        The buffer (its ``data_ptr()`` and byte size are used), or a raw address.
    device : {"host", "xpu"}
        ``"host"``: the pointer itself. ``"xpu"`` (SDK builds): the host-visible mapping of the
        device memory from ``xpu_mmap``.
    """
    if _native is None:
        raise RuntimeError(_IMPORT_ERROR)
    if isinstance(tensor, torch.Tensor):
        return _native.get_peer_mem_addr(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                         device)
    if isinstance(tensor, bool) or not isinstance(tensor, int):
        raise TypeError(f"tensor must be a torch.Tensor or an int address, got {type(tensor).__name__}")
    return _native.get_peer_mem_addr(tensor, 0, device)


class _NativeBackend:
    """The three ops over ``kvflow._native`` on one of its compiled devices; cache sides step
    ``spec.block_stride_bytes`` between blocks (block-major caches too)."""

    native_device = "host"
    block_strides = True

    def unavailable_reason(self) -> str | None:
        if _native is None:
            return _IMPORT_ERROR
        if self.native_device not in _native.available_backends():
            return (f"kvflow._native was built without the {self.native_device} backend "
                    f"(compiled: {_native.available_backends()}); set KVFLOW_XPU_SDK and reinstall")
        return None

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        _native.gather_blocks(_ptrs(cache, start, stop), _ids(ids), out.data_ptr(),
                              cache.num_blocks, cache.spec.block_bytes,
                              num_threads=_num_threads(), device=self.native_device,
                              src_stride=cache.spec.block_stride_bytes)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        _native.scatter_blocks(src.data_ptr(), _ptrs(cache, start, stop), _ids(ids),
                               cache.num_blocks, cache.spec.block_bytes,
                               num_threads=_num_threads(), device=self.native_device,
                               dst_stride=cache.spec.block_stride_bytes)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None):
        _native.copy_blocks(_ptrs(src_cache, start, stop), _ptrs(dst_cache, start, stop),
                            _ids(src_ids), _ids(dst_ids), src_cache.num_blocks,
                            dst_cache.num_blocks, src_cache.spec.block_bytes,
                            num_threads=_num_threads(), device=self.native_device,
                            src_stride=src_cache.spec.block_stride_bytes,
                            dst_stride=dst_cache.spec.block_stride_bytes)


class NativeHostBackend(_NativeBackend):
    name = "native"
    devices = {"cpu"}
    native_device = "host"


class NativeXPUBackend(_NativeBackend):
    name = "xpu"
    devices = {"xpu"}
    native_device = "xpu"


register_backend(NativeHostBackend())
register_backend(NativeXPUBackend())
