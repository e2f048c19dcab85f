"""The ops between caches or buffers of different specs (:mod:`kvflow.kernels.reblock`):
:func:`copy_sequence`, and the gather / scatter with a staging buffer of another spec that
:func:`kvflow.kernels.gather_blocks` / :func:`~kvflow.kernels.scatter_blocks` come to. Each
checks its arguments, then makes one backend call over all layers of the range.

A backend takes part by defining ``reblock(job, max_ctas, check)`` (a checked
:class:`~kvflow.kernels.contract.Job`, :mod:`kvflow.kernels.contract`); ``torch``, ``numba``
and ``triton`` do.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, overlaps
from kvflow.layout import normalize_layers

from .contract import Job, Operand
from .errors import shared
from .reblock import check_num_tokens, make_mapping
from .registry import get_backend
from .validate import (check_block_strides, check_cache, check_ids, check_max_ctas, check_validate, relation,
                       shared_block)


def mapping_for(src_cache: PagedKVCache, dst_cache: PagedKVCache, head_start: Any):
    """:func:`make_mapping` of the two caches' specs, kept per (source spec, head_start) in the
    destination's ``backend_state`` (specs are frozen)."""
    key = ("reblock_map", src_cache.spec, head_start)
    mp = dst_cache.backend_state.get(key)
    if mp is None:
        mp = dst_cache.backend_state[key] = make_mapping(src_cache.spec, dst_cache.spec,
                                                         head_start)
    return mp


def reblock_backend(backend: Any, device: Any) -> Any:
    """The backend for a re-blocked op; ValueError if it has no ``reblock``."""
    be = get_backend(backend, device)
    if not hasattr(be, "reblock"):
        raise ValueError(f"backend {be.name!r} cannot move blocks between different specs "
                         f"(block_size, layout, dtype, heads) or a partial block (num_tokens); "
                         f"use 'torch', 'numba' or 'triton'")
    return be


def copy_sequence(src_cache: PagedKVCache, dst_cache: PagedKVCache, src_ids: Any, dst_ids: Any,
                  layers: Any = None, *, num_tokens: Any = None, head_start: Any = None,
                  backend: str = "auto", max_ctas: int | None = None,
                  validate: bool = True) -> PagedKVCache:
    """Copy one request's tokens from its block table in one cache into its block table in
    another, whatever the two specs (re-blocking): block size, layout (NHD, HND; MLA only with
    MLA), dtype (fp8 with its scales) and KV heads (a slice of them) may differ.

    Token ``t < num_tokens`` moves from slot ``t % bs_src`` of block ``src_ids[t // bs_src]``
    to slot ``t % bs_dst`` of block ``dst_ids[t // bs_dst]``, in every per-layer tensor of the
    layer range, converted when the dtypes differ, in one backend call over all layers (the
    rule, heads and conversions: :mod:`kvflow.kernels.reblock`,
    :mod:`kvflow.kernels.reference_reblock`, docs/layouts.md). Between caches of one spec it
    moves the same bytes as :func:`kvflow.kernels.copy_blocks` of the blocks' pairs, except
    that ``num_tokens`` may end inside a block. The kernel runs on ``dst_cache``'s device
    (reading a peer GPU's memory if ``src_cache`` is there).

    Parameters
    ----------
    src_cache, dst_cache : PagedKVCache
        The two caches; may be the same cache, or two objects over the same tensors (then the
        tables must not share a block); any other overlap of their memory is refused.
    src_ids, dst_ids : torch.Tensor, int32 or int64, shape [n_src] and [n_dst]
        The request's block table in each cache (a list is accepted); -1 is padding: the
        tokens it holds are skipped, their destination slots untouched. ``dst_ids`` distinct.
    layers : None, int, range, slice or (start, stop)
        Layer range (default: all layers); layer ``l`` maps to layer ``l``.
    num_tokens : int, optional
        Tokens to move (default: all both block tables hold,
        ``min(n_src * bs_src, n_dst * bs_dst)``); slots past it in the last destination block
        are left untouched.
    head_start : int, optional
        When ``num_kv_heads`` differ: the first of the larger side's heads that the smaller
        side's heads are (required then).
    backend, max_ctas, validate
        As :func:`kvflow.kernels.gather_blocks`; the backend must define ``reblock``
        (``torch``, ``numba``, ``triton``).

    Returns
    -------
    PagedKVCache
        ``dst_cache``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument or spec field and the values: specs that do not map (``head_dim``
        or ``num_layers`` differ, MLA to non-MLA, a layout that does not re-block, a dtype that
        does not convert), ``head_start`` missing or out of range, ``num_tokens`` more than a
        block table holds, ids out of range or repeated, caches on two device types or
        overlapping, a backend without ``reblock``.
    """
    if type(src_cache) is not PagedKVCache:
        src_cache = check_cache("src_cache", src_cache)
    if type(dst_cache) is not PagedKVCache:
        dst_cache = check_cache("dst_cache", dst_cache)
    dev, spec = dst_cache.device, dst_cache.spec
    check_validate(validate, dev, src_cache.device)
    rel = relation(src_cache, dst_cache)
    if rel == "overlapping":
        raise ValueError("src_cache and dst_cache overlap in memory without being the same "
                         "cache (same tensors); copy_sequence needs disjoint caches or one cache")
    max_ctas = check_max_ctas(max_ctas)
    mp = mapping_for(src_cache, dst_cache, head_start)
    start, stop = normalize_layers(layers, spec.num_layers)
    be = reblock_backend(backend, dev)
    check_block_strides(be, src_cache.spec, spec)
    checks = getattr(be, "device_checks", False) and rel != "same"
    s, s_dev = check_ids("src_ids", src_ids, src_cache.num_blocks, dev, validate,
                         device_checks=checks)
    d, d_dev = check_ids("dst_ids", dst_ids, dst_cache.num_blocks, dev, validate, unique=True,
                         device_checks=checks)
    if rel == "same" and validate:
        both = shared_block(s, d)
        if both >= 0:
            raise shared(both)
    T = check_num_tokens(num_tokens, s.shape[0], mp.src.block_size, d.shape[0],
                         mp.dst.block_size)
    if src_cache.device.type != dst_cache.device.type:
        raise ValueError(f"src_cache is on {src_cache.device} and dst_cache on {dst_cache.device}; "
                         f"copy_sequence moves between caches of one device type")
    if T:
        if s.device != dev:
            s = s.to(dev, non_blocking=True)
        tpl = mp.tensors_per_layer
        job = Job(mp, Operand(src_cache.spec, src_cache, None, s, src_cache.num_blocks,
                              start * tpl, src_cache.scales),
                  Operand(spec, dst_cache, None, d, dst_cache.num_blocks, start * tpl,
                          dst_cache.scales),
                  (stop - start) * tpl, T)
        be.reblock(job, max_ctas, check=s_dev or d_dev)
    return dst_cache


def _stage_operand(name: str, buf: Any, spec: Any, scales: Any, ntensors: int, layers_n: int,
                   device: Any) -> Operand:
    """A staging buffer of another spec as an operand: ``staging_shape(spec, m, layers)``
    with ``m`` taken from ``buf``; fp8 specs need their scales (``[ntensors]`` per tensor,
    ``[ntensors, m, num_kv_heads]`` per block per head, float32)."""
    from kvflow.layout import KVCacheSpec

    from .validate import check_buffer
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"{name}_spec must be a KVCacheSpec, got {type(spec).__name__}")
    m = buf.shape[2] if isinstance(buf, torch.Tensor) and buf.dim() > 2 else 0
    buf = check_buffer(name, buf, (layers_n, spec.tensors_per_layer, m, *spec.block_shape),
                       spec.dtype, device)
    if spec.is_fp8:
        shape = (ntensors,) if spec.scales == "tensor" else (ntensors, m, spec.num_kv_heads)
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 \
                or tuple(scales.shape) != shape or scales.device != buf.device \
                or not scales.is_contiguous():
            raise ValueError(f"{name}_scales must be a contiguous float32 tensor of shape {shape} "
                             f"on {buf.device} for {name}_spec.dtype={spec.dtype} "
                             f"(scales={spec.scales!r}), got {_describe(scales)}")
    elif scales is not None:
        raise ValueError(f"{name}_scales given for {name}_spec.dtype={spec.dtype}, which holds "
                         f"no scales")
    return Operand(spec, None, buf, None, m, 0, scales if spec.is_fp8 else None)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


def staged_reblocked(cache: PagedKVCache, block_ids: Any, buf: Any, layers: Any, *, to_stage: bool,
                     stage_spec: Any, stage_scales: Any, backend: str, max_ctas: int | None,
                     validate: bool, num_tokens: Any, head_start: Any) -> None:
    """gather (``to_stage``) or scatter between ``cache`` and a staging buffer of
    ``stage_spec`` (see :func:`kvflow.kernels.gather_blocks`)."""
    name = "out" if to_stage else "src"
    dev, spec = cache.device, cache.spec
    start, stop = normalize_layers(layers, spec.num_layers)
    if not hasattr(stage_spec, "num_layers"):
        raise TypeError(f"{name}_spec must be a KVCacheSpec, got {type(stage_spec).__name__}")
    if stage_spec.block_major:  # a staging buffer is packed per tensor whatever the cache's
        stage_spec = stage_spec.with_(layout=stage_spec.view_layout)  # layout: BM_NHD's is NHD's
    src_spec, dst_spec = (spec, stage_spec) if to_stage else (stage_spec, spec)
    mp = make_mapping(src_spec.with_(num_layers=spec.num_layers),
                      dst_spec.with_(num_layers=spec.num_layers), head_start,
                      src_name="cache" if to_stage else f"{name}_spec",
                      dst_name=f"{name}_spec" if to_stage else "cache")
    be = reblock_backend(backend, dev)
    check_block_strides(be, spec)
    checks = getattr(be, "device_checks", False)
    ids, on_dev = check_ids("block_ids", block_ids, cache.num_blocks, dev, validate,
                            unique=not to_stage, device_checks=checks)
    tpl = spec.tensors_per_layer
    nt = (stop - start) * tpl
    stage = _stage_operand(name, buf, stage_spec, stage_scales, nt, stop - start, dev)
    if overlaps(cache, stage.stage):
        raise ValueError(f"{name} lies in the cache's memory; the staging buffer must be "
                         f"separate memory")
    mine = Operand(spec, cache, None, ids, cache.num_blocks, start * tpl, cache.scales)
    if to_stage:
        T = check_num_tokens(num_tokens, ids.shape[0], spec.block_size, stage.num_blocks,
                             stage_spec.block_size, dst_name=f"{name}.shape[2]")
        job = Job(mp, mine, stage, nt, T)
    else:
        T = check_num_tokens(num_tokens, stage.num_blocks, stage_spec.block_size,
                             ids.shape[0], spec.block_size, src_name=f"{name}.shape[2]",
                             dst_name="block_ids")
        job = Job(mp, stage, mine, nt, T)
    if T:
        be.reblock(job, max_ctas, check=on_dev)
