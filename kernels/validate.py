"""Checks shared by the public ops: run before any kernel, raise naming argument and value.

Shape, dtype and device checks never synchronise with a device. Value checks of block ids
(range, duplicates) read the ids on the host: free for CPU ids, one device->host copy for
GPU ids; callers that validated the ids before (the transfer runtime does, on its host copy)
pass ``validate=False`` to the ops to keep the hot path free of host synchronisation. The
kernels themselves skip any id outside ``[0, num_blocks)``, so even unvalidated ids never
write out of bounds.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.dlpack import to_torch
from kvflow.layout import KVCacheSpec, is_int

ID_DTYPES = (torch.int32, torch.int64)


def check_cache(name: str, cache: Any) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{name} must be a kvflow.PagedKVCache, got {type(cache).__name__}")
    return cache


def check_ids(name: str, ids: Any, num_blocks: int, device: torch.device,
              validate: bool = True) -> torch.Tensor:
    """Return ``ids`` as a 1-D int32/int64 tensor on ``device``.

    Raises
    ------
    TypeError
        ``ids`` is not a tensor (or list of ints), or has a non-integer dtype.
    ValueError
        ``ids`` is not 1-D, lives on another accelerator, or (``validate``) holds an id
        outside ``[-1, num_blocks)`` (-1 is padding).
    """
    ids = to_torch(ids, name)
    if isinstance(ids, (list, tuple)):
        if not all(is_int(v) for v in ids):
            raise TypeError(f"{name} must hold ints, got {ids!r}")
        for i, v in enumerate(ids):
            if not -2 ** 63 <= v < 2 ** 63:  # would not fit the int64 tensor
                raise _out_of_range(name, i, int(v), num_blocks)
        ids = torch.tensor([int(v) for v in ids], dtype=torch.int64)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.device != device:
        if ids.device.type != "cpu":
            raise ValueError(f"{name} is on {ids.device}; the cache is on {device}")
    if validate and ids.numel():
        host = ids.cpu()
        bad = (host < -1) | (host >= num_blocks)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise _out_of_range(name, i, int(host[i]), num_blocks)
    if ids.device != device:
        ids = ids.to(device, non_blocking=True)
    return ids if ids.is_contiguous() else ids.contiguous()


def _out_of_range(name: str, i: int, value: int, num_blocks: int) -> ValueError:
    return ValueError(f"{name}[{i}]={value} is out of range for a cache of {num_blocks} blocks "
                      f"(valid: 0..{num_blocks - 1}, or -1 for padding)")


def check_unique(name: str, ids: torch.Tensor) -> None:
    """Destination ids (other than -1) must be distinct: two writes to one block would race."""
    host = ids.cpu()
    real = host[host >= 0]
    uniq, counts = torch.unique(real, return_counts=True)
    if bool((counts > 1).any()):
        dup = int(uniq[counts > 1][0])
        raise ValueError(f"{name} repeats destination block {dup}; destination ids must be "
                         f"distinct (only -1 padding may repeat)")


def check_same_spec(a_name: str, a: KVCacheSpec, b_name: str, b: KVCacheSpec) -> None:
    """Both caches must have one spec; the error names every differing field with both values."""
    if a == b:  # the common case, on every call of copy_blocks: no field-by-field walk
        return
    diffs = [f"{f}: {a_name} has {getattr(a, f)}, {b_name} has {getattr(b, f)}"
             for f in a.to_dict() if getattr(a, f) != getattr(b, f)]
    if diffs:
        raise ValueError(f"{a_name}.spec and {b_name}.spec differ: " + "; ".join(diffs))


def check_buffer(name: str, buf: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """A staging buffer must match shape, dtype and device exactly and be contiguous."""
    buf = to_torch(buf, name)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise TypeError(f"{name}.dtype is {buf.dtype}; the cache holds {dtype}")
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name}.shape is {tuple(buf.shape)}; expected {tuple(shape)} "
                         f"(layers, tensors per layer, blocks, *block_shape)")
    if buf.device != device:
        raise ValueError(f"{name} is on {buf.device}; the cache is on {device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {buf.stride()}")
    if buf.requires_grad:
        raise ValueError(f"{name} requires grad; kvflow's ops run outside autograd "
                         f"(pass {name}.detach())")
    return buf
