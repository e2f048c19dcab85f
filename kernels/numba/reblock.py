"""Numba CPU re-blocked copy (:mod:`kvflow.kernels.reblock`): one parallel call over all layers.

Work item ``w`` = (per-layer tensor ``j``, destination block ``k`` of the sequence); ``prange``
spreads items over threads. An item walks the destination block's slots; slot ``s`` holds
token ``t = k * bs_dst + s``, read from slot ``t % bs_src`` of block ``src_ids[t // bs_src]``;
each (token, head) row of ``head_dim`` elements moves as bytes (8-byte words when they allow)
or converts element by element through float32 with :mod:`.floats` (the reference's
arithmetic, :mod:`kvflow.kernels.reference_reblock`). With per-block-per-head destination
scales an item first takes each head's ``amax`` over its rows (one pass), then writes.

Every side is a table of per-tensor base addresses (a staging buffer: its tensors' addresses,
block ``i`` of the sequence at slot ``i``), geometry comes as element strides
(:func:`~kvflow.kernels.reblock.side_strides`): no layout branch in the kernel.
"""

from __future__ import annotations

import numba
import numpy as np

from .pointers import PARALLEL_MIN_BYTES, as_ptr, serial_and_parallel
from .floats import KINDS, decode, encode

_FP8_MAX = {3: 448.0, 4: 57344.0}
MIN_AMAX = np.float32(2.0 ** -100)


@numba.njit(inline="always")
def _load(p8, p16, p32, isz, i):
    if isz == 1:
        return np.int64(p8[i])
    if isz == 2:
        return np.int64(p16[i])
    return np.int64(p32[i])


@numba.njit(inline="always")
def _store(p8, p16, p32, isz, i, v):
    if isz == 1:
        p8[i] = np.uint8(v & 0xFF)
    elif isz == 2:
        p16[i] = np.uint16(v & 0xFFFF)
    else:
        p32[i] = np.uint32(v & 0xFFFFFFFF)


def _reblock(src_ptrs, dst_ptrs, src_ids, dst_ids, geo, fmt, src_sc, dst_sc, convert):
    """``geo`` (int64): [T, heads, head_dim, then per side (src, dst): block_size, block_stride,
    slot_stride, head_stride, head0, num_blocks, num_heads]; ``fmt`` (int64): per side
    [itemsize, mbits, bias, emin, scale mode (0 none, 1 tensor, 2 block_head), fp8 max]."""
    T, n, D = geo[0], geo[1], geo[2]
    bs_s, sbs, sss, shs, s0, snb, snh = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
    bs_d, dbs, dss, dhs, d0, dnb, dnh = (geo[10], geo[11], geo[12], geo[13], geo[14], geo[15],
                                         geo[16])
    s_isz, s_mb, s_bias, s_sm = fmt[0], fmt[1], fmt[2], fmt[4]
    d_isz, d_mb, d_bias, d_emin, d_sm = fmt[6], fmt[7], fmt[8], fmt[9], fmt[10]
    fmax = np.float32(fmt[11])
    nt = src_ptrs.shape[0]
    kd = (T + bs_d - 1) // bs_d
    s_len = snb * sbs
    d_len = dnb * dbs
    for w in numba.prange(nt * kd):
        j = w // kd
        k = w - j * kd
        db = np.int64(dst_ids[k])
        if db < 0 or db >= dnb:
            continue
        sp8 = numba.carray(as_ptr(src_ptrs[j]), s_len * s_isz, np.uint8)
        dp8 = numba.carray(as_ptr(dst_ptrs[j]), d_len * d_isz, np.uint8)
        if not convert:
            row = D * s_isz
            wide = row % 8 == 0 and src_ptrs[j] % 8 == 0 and dst_ptrs[j] % 8 == 0
            sp64 = numba.carray(as_ptr(src_ptrs[j]), s_len * s_isz // 8 + 1, np.uint64)
            dp64 = numba.carray(as_ptr(dst_ptrs[j]), d_len * s_isz // 8 + 1, np.uint64)
            for sl in range(bs_d):
                t = k * bs_d + sl
                if t >= T:
                    break
                sb = np.int64(src_ids[t // bs_s])
                if sb < 0 or sb >= snb:
                    continue
                for h in range(n):
                    so = (sb * sbs + (t % bs_s) * sss + (s0 + h) * shs) * s_isz
                    do = (db * dbs + sl * dss + (d0 + h) * dhs) * s_isz
                    if wide:  # rows start at multiples of the row: 8-byte words
                        for b in range(row // 8):
                            dp64[do // 8 + b] = sp64[so // 8 + b]
                    else:
                        for b in range(row):
                            dp8[do + b] = sp8[so + b]
            continue
        sp16 = numba.carray(as_ptr(src_ptrs[j]), s_len * s_isz // 2 + 1, np.uint16)
        sp32 = numba.carray(as_ptr(src_ptrs[j]), s_len * s_isz // 4 + 1, np.uint32)
        dp16 = numba.carray(as_ptr(dst_ptrs[j]), d_len * d_isz // 2 + 1, np.uint16)
        dp32 = numba.carray(as_ptr(dst_ptrs[j]), d_len * d_isz // 4 + 1, np.uint32)
        for h in range(n):
            inv = np.float32(1.0)
            if d_sm == 1:
                inv = np.float32(1.0) / dst_sc[j]
            for p in range(2 if d_sm == 2 else 1):
                amax = np.float32(0.0)
                rows = 0
                for sl in range(bs_d):
                    t = k * bs_d + sl
                    if t >= T:
                        break
                    sb = np.int64(src_ids[t // bs_s])
                    if sb < 0 or sb >= snb:
                        continue
                    so = sb * sbs + (t % bs_s) * sss + (s0 + h) * shs
                    do = db * dbs + sl * dss + (d0 + h) * dhs
                    rows += 1
                    sc = np.float32(1.0)
                    if s_sm == 1:
                        sc = src_sc[j]
                    elif s_sm == 2:
                        sc = src_sc[(j * snb + sb) * snh + s0 + h]
                    for d in range(D):
                        x = decode(_load(sp8, sp16, sp32, s_isz, so + d), s_mb, s_bias)
                        if s_sm != 0:
                            x = np.float32(x * sc)
                        if d_sm == 2 and p == 0:
                            ax = abs(x)
                            if ax > amax:
                                amax = ax
                            continue
                        if d_sm != 0:
                            x = np.float32(x * inv)
                            x = min(max(x, -fmax), fmax)
                        _store(dp8, dp16, dp32, d_isz, do + d, encode(x, d_mb, d_bias, d_emin))
                if d_sm == 2 and p == 0:
                    if rows == 0:  # nothing lands in this block: its scale stays
                        break
                    scale = np.float32(max(amax, MIN_AMAX) / fmax)
                    dst_sc[(j * dnb + db) * dnh + d0 + h] = scale
                    inv = np.float32(1.0) / scale


# numba's on-disk cache keys on this file alone: an edit of floats.py (inlined here) needs an
# edit of this file too, or a stale compiled kernel stays in use (2026-12-01: NaN encoding).
_serial, _parallel = serial_and_parallel(_reblock)

_SM = {None: 0, "tensor": 1, "block_head": 2}
_NO_SCALES = np.ones(1, dtype=np.float32)


def _side_fmt(side) -> list[int]:
    kind = KINDS.get(side.dtype)
    _, mb, bias, emin = kind if kind else (0, 0, 0, 0)
    return [side.dtype.itemsize, mb, bias, emin, _SM[side.scales],
            int(_FP8_MAX.get(kind[0] if kind else -1, 0))]


def _ptrs(op, ntensors: int, block_bytes: int) -> np.ndarray:
    if op.cache is not None:
        key = ("numba_reblock_ptrs", op.j0, ntensors)
        arr = op.cache.backend_state.get(key)
        if arr is None:
            arr = op.cache.backend_state[key] = \
                op.cache.ptr_table().numpy()[op.j0:op.j0 + ntensors].copy()
        return arr
    per = op.num_blocks * block_bytes
    return op.stage.data_ptr() + per * np.arange(ntensors, dtype=np.int64)


def _ids(op) -> np.ndarray:
    return np.arange(op.num_blocks, dtype=np.int64) if op.ids is None else op.ids.numpy()


def _scales(op, mode) -> np.ndarray:
    if mode is None:
        return _NO_SCALES
    flat = op.scales.reshape(-1).numpy()
    per = flat.shape[0] // op.scales.shape[0]
    return flat[op.j0 * per:]


def reblock(job) -> None:
    """Run a checked :class:`~kvflow.kernels.contract.Job` on the CPU."""
    mp, s, d = job.mapping, job.src, job.dst
    geo = np.array([job.num_tokens, mp.heads, mp.head_dim,
                    mp.src.block_size, mp.src.block_stride, mp.src.slot_stride,
                    mp.src.head_stride, mp.src.head0, s.num_blocks, mp.src.num_kv_heads,
                    mp.dst.block_size, mp.dst.block_stride, mp.dst.slot_stride,
                    mp.dst.head_stride, mp.dst.head0, d.num_blocks, mp.dst.num_kv_heads],
                   dtype=np.int64)
    fmt = np.array(_side_fmt(mp.src) + _side_fmt(mp.dst), dtype=np.int64)
    moved = job.num_tokens * mp.heads * mp.head_dim * job.ntensors * mp.dst.dtype.itemsize
    fn = _parallel if moved >= PARALLEL_MIN_BYTES else _serial
    fn(_ptrs(s, job.ntensors, s.spec.block_bytes), _ptrs(d, job.ntensors, d.spec.block_bytes),
       _ids(s), _ids(d), geo, fmt, _scales(s, mp.src.scales), _scales(d, mp.dst.scales),
       mp.convert)
