"""``copy_blocks`` between caches of different specs (:mod:`kvflow.kernels.reblock`): the
checks, then one backend call over all layers of the range.

:func:`kvflow.kernels.copy_blocks` comes here when the specs differ or ``num_tokens`` /
``head_start`` is given. A backend takes part by defining ``reblock(job, max_ctas, check)``
(a :class:`~kvflow.kernels.reference_reblock.Job`, checked here); ``torch``, ``numba`` and
``triton`` do.
"""

from __future__ import annotations

from typing import Any

from kvflow.cache import PagedKVCache
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

