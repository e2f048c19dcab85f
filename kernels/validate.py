"""Checks shared by the public ops: run before any kernel, raise naming argument and value.

Shape, dtype and device checks never synchronise with a device. Value checks of block ids
(range, repeated destinations) run where the ids are:

- ids on the host: here, before any kernel (compiled scans, :mod:`kvflow.kernels.host_checks`);
- ids on a GPU, with a backend that has ``device_checks`` (``triton``): in the kernel itself,
  reported through :mod:`kvflow.kernels.errors` (the next call, or ``check_errors()``), so the
  default call never waits for the device;
- ids on a GPU with any other backend: read on the host (one device->host copy and a sync).

``validate=False`` skips the value checks (the kernels still skip any id outside
``[0, num_blocks)``, so unvalidated ids never write out of bounds).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvflow.cache import PagedKVCache, memory_relation
from kvflow.dlpack import to_torch
from kvflow.layout import KVCacheSpec, is_int

from .errors import out_of_range, raise_pending, repeated

ID_DTYPES = (torch.int32, torch.int64)
_CPU = torch.device("cpu")


def check_cache(name: str, cache: Any) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{name} must be a kvflow.PagedKVCache, got {type(cache).__name__}")
    return cache


def _as_tensor(name: str, ids: Any, num_blocks: int) -> torch.Tensor:
    ids = to_torch(ids, name)
    if isinstance(ids, (list, tuple)):
        if not all(is_int(v) for v in ids):
            raise TypeError(f"{name} must hold ints, got {ids!r}")
        for i, v in enumerate(ids):
            if not -2 ** 63 <= v < 2 ** 63:  # would not fit the int64 tensor
                raise out_of_range(name, i, int(v), num_blocks)
        ids = torch.tensor([int(v) for v in ids], dtype=torch.int64)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, a numpy array or a list "
                        f"of ints, got {type(ids).__name__}")
    return ids


def check_ids(name: str, ids: Any, num_blocks: int, device: torch.device,
              validate: bool = True, *, unique: bool = False,
              device_checks: bool = False) -> tuple[torch.Tensor, bool]:
    """Return ``(ids, checked_on_device)``: ``ids`` as a contiguous 1-D int32/int64 tensor on
    ``device``, and whether the kernel must check its values (see the module docstring).

    ``unique``: destination ids, which must not repeat (other than -1).

    Raises
    ------
    TypeError
        ``ids`` is not a tensor (or list of ints), or has a non-integer dtype.
    ValueError
        ``ids`` is not 1-D, lives on another accelerator, or (``validate``, ids checked here)
        holds an id outside ``[-1, num_blocks)`` or, with ``unique``, repeats a block.
    """
    if type(ids) is not torch.Tensor:
        ids = _as_tensor(name, ids, num_blocks)
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    where = ids.device
    on_device = False
    if where == device:
        if validate and ids.shape[0]:
            if device_checks and where.type != "cpu":
                on_device = True
            else:
                check_values(name, ids, num_blocks, unique)
    elif where.type != "cpu":
        raise ValueError(f"{name} is on {where}; the cache is on {device}")
    else:  # host ids for a device cache: checked here, then copied over
        if validate and ids.shape[0]:
            check_values(name, ids, num_blocks, unique)
        ids = ids.to(device, non_blocking=True)
    return (ids if ids.is_contiguous() else ids.contiguous()), on_device


def check_values(name: str, ids: torch.Tensor, num_blocks: int, unique: bool) -> None:
    """Range (and, with ``unique``, repeat) check of ``ids`` on the host; GPU ids are copied
    to the host first (a sync)."""
    checks = _host_checks()
    host = (ids if ids.device == _CPU else ids.cpu()).numpy()
    i = checks.first_bad(host, num_blocks)
    if i >= 0:
        raise out_of_range(name, int(i), int(host[i]), num_blocks)
    if unique:
        dup = checks.smallest_repeat(host)
        if dup >= 0:
            raise repeated(name, int(dup))


def shared_block(a: torch.Tensor, b: torch.Tensor) -> int:
    """The smallest block id (>= 0) in both ``a`` and ``b``, or -1 (GPU ids: a sync)."""
    return int(_host_checks().smallest_shared(a.cpu().numpy(), b.cpu().numpy()))


_CHECKS: list[Any] = []


def _host_checks() -> Any:
    """:mod:`kvflow.kernels.host_checks`, imported on first use (numba loads only then)."""
    if not _CHECKS:
        from . import host_checks
        _CHECKS.append(host_checks)
    return _CHECKS[0]


def check_same_spec(a_name: str, a: KVCacheSpec, b_name: str, b: KVCacheSpec,
                    hint: str = "") -> None:
    """Both caches must have one spec; the error names every differing field with both values
    (then ``hint``, e.g. which op to call instead)."""
    if a == b:  # the common case, on every call of copy_blocks: no field-by-field walk
        return
    diffs = [f"{f}: {a_name} has {getattr(a, f)}, {b_name} has {getattr(b, f)}"
             for f in a.to_dict() if getattr(a, f) != getattr(b, f)]
    if diffs:
        raise ValueError(f"{a_name}.spec and {b_name}.spec differ: " + "; ".join(diffs) + hint)


def check_max_ctas(max_ctas: Any) -> int | None:
    """``max_ctas`` as a Python int (numpy integers accepted), or None.

    Raises TypeError for a non-integer (bool, float, str), ValueError for one <= 0."""
    if max_ctas is None:
        return None
    if not is_int(max_ctas):
        raise TypeError(f"max_ctas must be None or a positive int, got {max_ctas!r}")
    if max_ctas <= 0:
        raise ValueError(f"max_ctas must be None or a positive int, got {max_ctas!r}")
    return int(max_ctas)


def check_validate(validate: Any, *devices: torch.device) -> None:
    """``validate`` must be a bool; when True, a bad id that an earlier call's kernel found on
    one of ``devices`` is raised now, before anything runs (:mod:`kvflow.kernels.errors`)."""
    if validate is True:
        for dev in devices:
            raise_pending(dev)
    elif validate is not False:
        raise TypeError(f"validate must be True or False, got {validate!r}")


def relation(src_cache: PagedKVCache, dst_cache: PagedKVCache) -> str:
    """:func:`~kvflow.cache.memory_relation` of two caches (``"same"``, ``"disjoint"`` or
    ``"overlapping"``), kept per cache pair (a cache's memory never moves); the pair is
    remembered through a weak reference, so it never keeps a peer's cache alive."""
    if src_cache is dst_cache:
        return "same"
    hit = dst_cache.backend_state.get("relation")
    if hit is not None and hit[0]() is src_cache:
        return hit[1]
    found = memory_relation(src_cache, dst_cache)
    dst_cache.backend_state["relation"] = (weakref.ref(src_cache), found)
    return found


def check_buffer(name: str, buf: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """A staging buffer must match shape, dtype and device exactly and be contiguous."""
    if type(buf) is not torch.Tensor:
        buf = to_torch(buf, name, writable=name == "out")
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise TypeError(f"{name}.dtype is {buf.dtype}; the cache holds {dtype}")
    if buf.shape != shape:
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


def check_block_strides(be, *specs) -> None:
    """A block-major cache (``spec.block_major``, e.g. ``BM_NHD``) needs a backend that reads
    ``spec.block_stride_bytes`` (``block_strides = True``, :mod:`kvflow.kernels.contract`).

    Raises
    ------
    ValueError
        Naming the backend, the layout and the backends that take it.
    """
    for spec in specs:
        if spec is not None and spec.block_major and not getattr(be, "block_strides", False):
            raise ValueError(f"backend {be.name!r} does not move block-major caches "
                             f"(layout={spec.layout!r}); use backend='torch' or 'numba'")
