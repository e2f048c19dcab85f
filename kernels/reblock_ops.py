"""``copy_blocks`` between caches of different specs (:mod:`kvflow.kernels.reblock`): the
checks, then one backend call over all layers of the range.

:func:`kvflow.kernels.copy_blocks` comes here when the specs differ or ``num_tokens`` /
``head_start`` is given. A backend takes part by defining ``reblock(job, max_ctas, check)``
(a :class:`~kvflow.kernels.reference_reblock.Job`, checked here); ``torch``, ``numba`` and
``triton`` do.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, overlaps
from kvflow.layout import normalize_layers

from .errors import shared
from .reblock import check_num_tokens, make_mapping
from .reference_reblock import Job, Operand
from .registry import get_backend
from .validate import check_ids, shared_block


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


def copy_reblocked(src_cache: PagedKVCache, dst_cache: PagedKVCache, src_ids: Any, dst_ids: Any,
                   layers: Any, *, backend: str, max_ctas: int | None, validate: bool,
                   num_tokens: Any, head_start: Any, relation: str) -> PagedKVCache:
    """The re-blocked ``copy_blocks`` (arguments as there; ``relation``: the caches' memory
    relation, ``"same"`` or ``"disjoint"``, already checked)."""
    mp = mapping_for(src_cache, dst_cache, head_start)
    dev, spec = dst_cache.device, dst_cache.spec
    start, stop = normalize_layers(layers, spec.num_layers)
    be = reblock_backend(backend, dev)
    checks = getattr(be, "device_checks", False) and relation != "same"
    s, s_dev = check_ids("src_ids", src_ids, src_cache.num_blocks, dev, validate,
                         device_checks=checks)
    d, d_dev = check_ids("dst_ids", dst_ids, dst_cache.num_blocks, dev, validate, unique=True,
                         device_checks=checks)
    if relation == "same" and validate:
        both = shared_block(s, d)
        if both >= 0:
            raise shared(both)
    T = check_num_tokens(num_tokens, s.shape[0], mp.src.block_size, d.shape[0],
                         mp.dst.block_size)
    if src_cache.device.type != dst_cache.device.type:
        raise ValueError(f"src_cache is on {src_cache.device} and dst_cache on {dst_cache.device}; "
                         f"copy_blocks moves between caches of one device type")
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
    src_spec, dst_spec = (spec, stage_spec) if to_stage else (stage_spec, spec)
    if not hasattr(stage_spec, "num_layers"):
        raise TypeError(f"{name}_spec must be a KVCacheSpec, got {type(stage_spec).__name__}")
    mp = make_mapping(src_spec.with_(num_layers=spec.num_layers),
                      dst_spec.with_(num_layers=spec.num_layers), head_start,
                      src_name="cache" if to_stage else f"{name}_spec",
                      dst_name=f"{name}_spec" if to_stage else "cache")
    be = reblock_backend(backend, dev)
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
