"""Shared helpers of the re-blocking tests: finite random caches and a naive, loop-by-loop
expectation that indexes each layout by name (not by strides), so it checks the reference
independently of :func:`kvflow.kernels.reblock.side_strides`."""

from __future__ import annotations

import torch

from kvflow import PagedKVCache
from kvflow.kernels.reference_reblock import FP8_MAX, MIN_AMAX

from tests.conftest import random_bytes_

_NAN_FREE = {torch.float8_e4m3fn: lambda u: (u & 0x7F) != 0x7F,
             torch.float8_e5m2: lambda u: (u & 0x7C) != 0x7C}


def finite_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill ``t`` with finite values: fp8 with random bit patterns other than NaN/inf
    (subnormals included), other floats with normal values of mixed magnitude. Returns ``t``."""
    g = torch.Generator().manual_seed(seed)
    if t.dtype in _NAN_FREE:
        u = torch.randint(0, 256, t.shape, generator=g, dtype=torch.int32)
        u = torch.where(_NAN_FREE[t.dtype](u), u, u & 0x70)
        t.view(torch.uint8).copy_(u.to(torch.uint8))
        return t
    x = torch.randn(t.shape, generator=g) * torch.pow(
        10.0, torch.randint(-4, 4, t.shape, generator=g).float())
    t.copy_(x.to(t.dtype))
    return t


def finite_cache(spec, num_blocks: int, seed: int, device: str = "cpu") -> PagedKVCache:
    """A cache of finite values (see :func:`finite_`) with random positive scales."""
    cache = PagedKVCache(spec, num_blocks, device)
    for i, t in enumerate(cache.tensors()):
        finite_(t, seed * 1000 + i)
    if cache.scales is not None:
        g = torch.Generator().manual_seed(seed + 7)
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) * 2 + 2 ** -6)
    return cache


def poisoned_cache(spec, num_blocks: int, seed: int, device: str = "cpu") -> PagedKVCache:
    """A destination: random bytes everywhere (fp8 NaN patterns included), random scales."""
    cache = PagedKVCache(spec, num_blocks, device)
    for i, t in enumerate(cache.tensors()):
        random_bytes_(t, seed * 1000 + i)
    if cache.scales is not None:
        g = torch.Generator().manual_seed(seed + 9)
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) + 0.25)
    return cache


def row(t: torch.Tensor, layout: str, b: int, s: int, h: int) -> torch.Tensor:
    """The head_dim elements of (block b, slot s, head h) of one per-layer tensor (a view)."""
    if layout == "NHD":
        return t[b, s, h]
    if layout == "HND":
        return t[b, h, s]
    return t[b, s]


def expect_copy(src: PagedKVCache, dst: PagedKVCache, src_ids, dst_ids, num_tokens: int,
                layers: tuple[int, int], head_start: int = 0):
    """``(tensors, scales)`` that ``dst`` must hold after the re-blocked copy: computed token
    by token, head by head, in Python loops."""
    ss, ds = src.spec, dst.spec
    T = ss.tensors_per_layer
    out = [t.clone() for t in dst.tensors()]
    scales = None if dst.scales is None else dst.scales.clone()
    n = min(ss.num_kv_heads, ds.num_kv_heads)
    s0, d0 = (head_start, 0) if ss.num_kv_heads > ds.num_kv_heads else (0, head_start)
    convert = ss.dtype != ds.dtype or ss.is_fp8
    for j in range(layers[0] * T, layers[1] * T):
        # rows[(dst block, slot, head)] = float32 or raw row
        rows = {}
        for t in range(num_tokens):
            sb, sl = src_ids[t // ss.block_size], t % ss.block_size
            db, dl = dst_ids[t // ds.block_size], t % ds.block_size
            if sb < 0 or db < 0:
                continue
            for h in range(n):
                x = row(src.tensors()[j], ss.layout, sb, sl, s0 + h)
                if convert:
                    x = x.float()
                    if ss.is_fp8:
                        sc = src.scales[j] if ss.scales == "tensor" else src.scales[j, sb, s0 + h]
                        x = x * sc
                rows[(db, dl, d0 + h)] = x
        if ds.is_fp8 and ds.scales == "block_head":
            amax = {}
            for (db, _, h), x in rows.items():
                amax[(db, h)] = max(amax.get((db, h), 0.0), float(x.abs().max()))
            for (db, h), a in amax.items():
                scales[j, db, h] = torch.tensor(max(a, MIN_AMAX), dtype=torch.float32) \
                    / FP8_MAX[ds.dtype]
        for (db, dl, h), x in rows.items():
            if convert and ds.is_fp8:
                sc = scales[j] if ds.scales == "tensor" else scales[j, db, h]
                m = FP8_MAX[ds.dtype]
                x = torch.clamp(x * (1.0 / sc), -m, m)
            row(out[j], ds.layout, db, dl, h).copy_(x.to(ds.dtype) if convert else x)
    return out, scales
