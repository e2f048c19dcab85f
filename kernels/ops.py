"""The public block-movement ops: checked wrappers that dispatch to a backend.

All three ops move whole blocks (``spec.block_bytes`` contiguous bytes per tensor) and count
as payload ``valid_blocks * spec.block_bytes * tensors_per_layer * layers_in_range`` bytes.
Block id -1 is padding: skipped on both sides, destination untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, staging_shape
from kvflow.layout import normalize_layers

from .registry import get_backend
from .validate import check_buffer, check_cache, check_ids, check_same_spec, check_unique


def _check_max_ctas(max_ctas: Any) -> None:
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int)
                                 or max_ctas <= 0):
        raise ValueError(f"max_ctas must be None or a positive int, got {max_ctas!r}")


def gather_blocks(cache: PagedKVCache, block_ids: Any, out: Any, layers: Any = None, *,
                  backend: str = "auto", max_ctas: int | None = None,
                  validate: bool = True) -> torch.Tensor:
    """Copy blocks of a paged cache into a contiguous staging buffer.

    Parameters
    ----------
    cache : PagedKVCache
        Source cache.
    block_ids : torch.Tensor, int32 or int64, shape [n]
        Physical block ids to read, in the order they land in ``out``; -1 skips the slot.
    out : torch.Tensor, shape ``staging_shape(cache.spec, n, layers)``, dtype ``cache.spec.dtype``
        ``out[l, t, i] = tensor t of layer (start + l) at block block_ids[i]``; contiguous, on
        the cache's device (see :func:`kvflow.staging_buffer`).
    layers : None, int, range, slice or (start, stop)
        Layer range (default: all layers).
    backend : str
        ``"auto"``, ``"torch"``, ``"numba"``, ``"triton"``, ... (see ``available_backends()``).
    max_ctas : int, optional
        GPU backends: cap on the grid (programs), for copies that run beside compute.
    validate : bool
        Check id values on the host (see :mod:`kvflow.kernels.validate`).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        Bad argument, naming it and its value; RuntimeError for an unavailable backend.
    """
    cache = check_cache("cache", cache)
    start, stop = normalize_layers(layers, cache.spec.num_layers)
    ids = check_ids("block_ids", block_ids, cache.num_blocks, cache.device, validate)
    out = check_buffer("out", out, staging_shape(cache.spec, ids.numel(), (start, stop)),
                       cache.spec.dtype, cache.device)
    _check_max_ctas(max_ctas)
    be = get_backend(backend, cache.device)
    if ids.numel():
        be.gather(cache, ids, out, start, stop, max_ctas)
    return out


def scatter_blocks(src: Any, cache: PagedKVCache, block_ids: Any, layers: Any = None, *,
                   backend: str = "auto", max_ctas: int | None = None,
                   validate: bool = True) -> PagedKVCache:
    """Copy a contiguous staging buffer into blocks of a paged cache (inverse of gather).

    Parameters
    ----------
    src : torch.Tensor, shape ``staging_shape(cache.spec, n, layers)``
        As the ``out`` of :func:`gather_blocks`.
    cache : PagedKVCache
        Destination cache.
    block_ids : torch.Tensor, int32 or int64, shape [n]
        Destination block of each slot of ``src``; distinct, -1 skips the slot.
    layers, backend, max_ctas, validate
        As :func:`gather_blocks`.

    Returns
    -------
    PagedKVCache
        ``cache``.
    """
    cache = check_cache("cache", cache)
    start, stop = normalize_layers(layers, cache.spec.num_layers)
    ids = check_ids("block_ids", block_ids, cache.num_blocks, cache.device, validate)
    src = check_buffer("src", src, staging_shape(cache.spec, ids.numel(), (start, stop)),
                       cache.spec.dtype, cache.device)
    if validate:
        check_unique("block_ids", ids)
    _check_max_ctas(max_ctas)
    be = get_backend(backend, cache.device)
    if ids.numel():
        be.scatter(src, cache, ids, start, stop, max_ctas)
    return cache


def copy_blocks(src_cache: PagedKVCache, dst_cache: PagedKVCache, src_ids: Any, dst_ids: Any,
                layers: Any = None, *, backend: str = "auto", max_ctas: int | None = None,
                validate: bool = True, direction: str = "pull") -> PagedKVCache:
    """Copy blocks from one cache to another of the same spec (block ``src_ids[i]`` of every
    tensor in the layer range goes to block ``dst_ids[i]``).

    The caches may be in different processes' memory mapped into this one (shared memory on
    CPU, CUDA IPC on GPU) or, on GPU backends, on two peer-accessible GPUs; the kernel runs on
    ``dst_cache``'s device.

    Parameters
    ----------
    src_cache, dst_cache : PagedKVCache
        Same ``spec`` (every field); may be the same cache (then ids must not overlap).
    src_ids, dst_ids : torch.Tensor, int32 or int64, shape [n] each
        Pairs of blocks; -1 on either side skips the pair; ``dst_ids`` distinct.
    layers, backend, max_ctas, validate
        As :func:`gather_blocks`.
    direction : {"pull", "push"}
        Caches on two peer GPUs: ``"pull"`` runs the kernel on ``dst_cache``'s GPU (reading the
        peer), ``"push"`` on ``src_cache``'s GPU (writing the peer). Only backends that list it
        in their ``directions`` (``triton``, ``numba_cuda``) take ``"push"``.

    Returns
    -------
    PagedKVCache
        ``dst_cache``.
    """
    if direction not in ("pull", "push"):
        raise ValueError(f"direction must be 'pull' or 'push', got {direction!r}")
    src_cache = check_cache("src_cache", src_cache)
    dst_cache = check_cache("dst_cache", dst_cache)
    check_same_spec("src_cache", src_cache.spec, "dst_cache", dst_cache.spec)
    start, stop = normalize_layers(layers, dst_cache.spec.num_layers)
    s = check_ids("src_ids", src_ids, src_cache.num_blocks, dst_cache.device, validate)
    d = check_ids("dst_ids", dst_ids, dst_cache.num_blocks, dst_cache.device, validate)
    if s.numel() != d.numel():
        raise ValueError(f"src_ids has {s.numel()} ids but dst_ids has {d.numel()}; "
                         f"they pair one to one")
    if validate:
        check_unique("dst_ids", d)
        if src_cache is dst_cache:
            both = set(s.cpu().tolist()) & set(d.cpu().tolist()) - {-1}
            if both:
                raise ValueError(f"src_ids and dst_ids share block {min(both)} of one cache")
    _check_max_ctas(max_ctas)
    if src_cache.device.type != dst_cache.device.type:
        raise ValueError(f"src_cache is on {src_cache.device} and dst_cache on {dst_cache.device}; "
                         f"copy_blocks moves between caches of one device type")
    be = get_backend(backend, dst_cache.device)
    if direction == "push" and "push" not in getattr(be, "directions", ("pull",)):
        raise ValueError(f"direction='push' is not supported by backend {be.name!r}; "
                         f"use 'pull' or one of the triton/numba_cuda backends")
    if s.numel():
        if direction == "pull":
            be.copy(src_cache, dst_cache, s, d, start, stop, max_ctas)
        else:
            be.copy(src_cache, dst_cache, s, d, start, stop, max_ctas, direction=direction)
    return dst_cache


def payload_bytes(spec, num_blocks: int, layers: Any = None) -> int:
    """Bytes an op moves for ``num_blocks`` (non-padding) blocks over a layer range."""
    start, stop = normalize_layers(layers, spec.num_layers)
    return num_blocks * spec.block_bytes * spec.tensors_per_layer * (stop - start)
