"""The Triton re-blocked copy (:mod:`kvflow.kernels.reblock`): one launch over all layers.

Grid: 1-D over work items (per-layer tensor ``j``) x (destination block ``k`` of the sequence)
x (group ``g`` of ``HB`` heads), ``g`` fastest. An item moves a ``[HB heads, TB tokens, DB]``
tile per step and steps over its destination block's slots: slot ``s`` holds token
``t = k * BS_D + s``, read from slot ``t % BS_S`` of block ``src_ids[t // BS_S]``. Each
(token, head) row is ``head_dim`` contiguous elements on both sides, so loads and stores are
rows of contiguous 16-byte vectors (row offsets are built in units of ``VEC`` elements, which
tells the compiler they are 16-byte aligned). Layouts are the six element strides of the two
sides (constexprs of the plan); nothing branches on a layout name.

Bytes that do not convert move as 8-byte words (or the widest word the row allows). Converting
items dequantize to float32 (times the source scale), then quantize (times ``1 / scale`` of the
destination, clamped to the fp8 range) with the arithmetic of
:mod:`kvflow.kernels.reference_reblock`; with per-block-per-head destination scales an item
first takes each head's ``amax`` over its block (one extra read of the source, which L2 holds),
writes the scales, then the block.

Ids on the device are checked by the kernel (``CHECK``), reported like every other op's
(:mod:`kvflow.kernels.errors`): the item of (tensor 0, group 0) of each destination block
checks its destination id (and, ``DUP``, stamps it) and the source ids its tokens read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .floats import decode_bits, encode_bits


@triton.jit
def _to_f32(v, NATIVE: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, EB: tl.constexpr,
            MASK: tl.constexpr):
    if NATIVE:
        x = v.to(tl.float32)
    else:
        x = decode_bits(v.to(tl.int32) & MASK, MB, BIAS, EB)
    return x


@triton.jit
def _from_f32(x, DT: tl.constexpr, NATIVE: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr,
              EB: tl.constexpr, EMIN: tl.constexpr):
    if MB == 23:
        if NATIVE:
            q = x
        else:
            q = x.to(DT, bitcast=True)
    elif NATIVE:
        q = x.to(DT, fp_downcast_rounding="rtne")
    else:
        q = encode_bits(x, MB, BIAS, EB, EMIN).to(DT)
    return q


@triton.jit
def _reblock(src_table, dst_table, src_ids, dst_ids, src_sc, dst_sc, T, src_n, dst_n, kd, hg,
             total, src_tstride, dst_tstride, errors, ready, stamps, call,
             SRC_T: tl.constexpr, DST_T: tl.constexpr, CONVERT: tl.constexpr,
             NATIVE: tl.constexpr, S_MB: tl.constexpr, S_BIAS: tl.constexpr,
             S_EB: tl.constexpr, S_MASK: tl.constexpr, D_MB: tl.constexpr,
             D_BIAS: tl.constexpr, D_EB: tl.constexpr, D_EMIN: tl.constexpr,
             S_SM: tl.constexpr, D_SM: tl.constexpr, FMAX: tl.constexpr, MIN_AMAX: tl.constexpr,
             BS_S: tl.constexpr, SBS: tl.constexpr, SSS: tl.constexpr, SHS: tl.constexpr,
             S0: tl.constexpr, SNH: tl.constexpr, BS_D: tl.constexpr, DBS: tl.constexpr,
             DSS: tl.constexpr, DHS: tl.constexpr, D0: tl.constexpr, DNH: tl.constexpr,
             HEADS: tl.constexpr, DW: tl.constexpr, VEC: tl.constexpr, HB: tl.constexpr,
             TB: tl.constexpr, DB: tl.constexpr, S_ALIGN: tl.constexpr, D_ALIGN: tl.constexpr,
             SRC_STAGE: tl.constexpr, DST_STAGE: tl.constexpr, SRC_I64: tl.constexpr,
             DST_I64: tl.constexpr, CHECK: tl.constexpr, DUP: tl.constexpr):
    """See the module docstring. Strides and ``DW`` (row length) are in elements of
    ``SRC_T`` / ``DST_T`` (words when not converting), all multiples of ``VEC``."""
    hr = tl.arange(0, HB)
    tr = tl.arange(0, TB)
    dr = tl.arange(0, DB)[None, None, :]
    dmask = dr < DW
    err = errors.to(tl.pointer_type(tl.int64))
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        g = w % hg
        r = w // hg
        k = r % kd
        j = r // kd
        if DST_STAGE:
            db = k.to(tl.int64)
        elif DST_I64:
            db = tl.load(dst_ids.to(tl.pointer_type(tl.int64)) + k)
        else:
            db = tl.load(dst_ids.to(tl.pointer_type(tl.int32)) + k).to(tl.int64)
        first = (j == 0) & (g == 0)
        if CHECK:
            if first:
                _check(src_ids, db, k, T, src_n, dst_n, err, ready, stamps, call, TB, BS_S,
                       BS_D, SRC_I64, DUP, SRC_STAGE)
        if (db >= 0) & (db < dst_n):
            if SRC_STAGE:
                sbase = src_table.to(tl.pointer_type(SRC_T)) + j.to(tl.int64) * src_tstride
            else:
                sbase = tl.load(src_table.to(tl.pointer_type(tl.int64)) + j).to(
                    tl.pointer_type(SRC_T))
            if DST_STAGE:
                dbase = dst_table.to(tl.pointer_type(DST_T)) + j.to(tl.int64) * dst_tstride
            else:
                dbase = tl.load(dst_table.to(tl.pointer_type(tl.int64)) + j).to(
                    tl.pointer_type(DST_T))
            sbase = tl.multiple_of(sbase, S_ALIGN)
            dbase = tl.multiple_of(dbase, D_ALIGN)
            h = g * HB + hr
            hm = h < HEADS
            s_head = ((S0 + h) * (SHS // VEC)).to(tl.int64)[:, None, None]
            d_head = ((D0 + h) * (DHS // VEC)).to(tl.int64)[:, None, None]
            inv = tl.full([HB], 1.0, tl.float32)
            if D_SM == 1:
                inv = inv * tl.math.div_rn(1.0, tl.load(dst_sc.to(tl.pointer_type(tl.float32)) + j))
            if D_SM == 2:  # pass 1: each head's amax over the block's written rows
                amax = tl.zeros([HB], tl.float32)
                rows = 0
                for tc in range(0, BS_D, TB):
                    sl = tc + tr
                    t = k * BS_D + sl
                    sb, tm = _src_block(src_ids, t, sl, T, src_n, BS_S, BS_D, SRC_I64, SRC_STAGE)
                    m = tm[None, :, None] & hm[:, None, None] & dmask
                    srow = (sb * (SBS // VEC) + (t % BS_S) * (SSS // VEC))[None, :, None]
                    v = tl.load(sbase + (srow + s_head) * VEC + dr, mask=m, other=0)
                    x = _dequant(v, src_sc, j, sb, h, src_n, NATIVE, S_MB, S_BIAS, S_EB, S_MASK,
                                 S_SM, S0, SNH)
                    amax = tl.maximum(amax, tl.max(tl.max(tl.where(m, tl.abs(x), 0.0), 2), 1))
                    rows += tl.sum(tm.to(tl.int32), 0)
                if rows > 0:
                    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FMAX)
                    sp = dst_sc.to(tl.pointer_type(tl.float32)) + (j * dst_n + db) * DNH + D0 + h
                    tl.store(sp, scale, mask=hm)
                    inv = tl.math.div_rn(tl.full([HB], 1.0, tl.float32), scale)
            for tc in range(0, BS_D, TB):
                sl = tc + tr
                t = k * BS_D + sl
                sb, tm = _src_block(src_ids, t, sl, T, src_n, BS_S, BS_D, SRC_I64, SRC_STAGE)
                m = tm[None, :, None] & hm[:, None, None] & dmask
                srow = (sb * (SBS // VEC) + (t % BS_S) * (SSS // VEC))[None, :, None]
                drow = (db * (DBS // VEC) + sl * (DSS // VEC))[None, :, None]
                v = tl.load(sbase + (srow + s_head) * VEC + dr, mask=m)
                if CONVERT:
                    x = _dequant(v, src_sc, j, sb, h, src_n, NATIVE, S_MB, S_BIAS, S_EB, S_MASK,
                                 S_SM, S0, SNH)
                    if D_SM != 0:
                        x = x * inv[:, None, None]
                        # saturate; NaN stays NaN (min/max would return the bound)
                        x = tl.clamp(x, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
                    v = _from_f32(x, DST_T, NATIVE, D_MB, D_BIAS, D_EB, D_EMIN)
                tl.store(dbase + (drow + d_head) * VEC + dr, v, mask=m)


@triton.jit
def _src_block(src_ids, t, sl, T, src_n, BS_S: tl.constexpr, BS_D: tl.constexpr,
               SRC_I64: tl.constexpr, SRC_STAGE: tl.constexpr):
    """(source block id as int64, row mask) of tokens ``t`` at destination slots ``sl``."""
    tm = (sl < BS_D) & (t < T)
    si = t // BS_S
    if SRC_STAGE:
        sb = si.to(tl.int64)
    elif SRC_I64:
        sb = tl.load(src_ids.to(tl.pointer_type(tl.int64)) + si, mask=tm, other=-1)
    else:
        sb = tl.load(src_ids.to(tl.pointer_type(tl.int32)) + si, mask=tm, other=-1).to(tl.int64)
    tm = tm & (sb >= 0) & (sb < src_n)
    return tl.where(tm, sb, 0), tm


@triton.jit
def _dequant(v, src_sc, j, sb, h, src_n, NATIVE: tl.constexpr, MB: tl.constexpr,
             BIAS: tl.constexpr, EB: tl.constexpr, MASK: tl.constexpr, SM: tl.constexpr,
             S0: tl.constexpr, SNH: tl.constexpr):
    x = _to_f32(v, NATIVE, MB, BIAS, EB, MASK)
    if SM == 1:
        x = x * tl.load(src_sc.to(tl.pointer_type(tl.float32)) + j)
    if SM == 2:
        sp = src_sc.to(tl.pointer_type(tl.float32)) + (j * src_n + sb[None, :]) * SNH + S0 \
            + h[:, None]
        x = x * tl.load(sp)[:, :, None]
    return x


@triton.jit
def _check(src_ids, db, k, T, src_n, dst_n, err, ready, stamps, call, TB: tl.constexpr,
           BS_S: tl.constexpr, BS_D: tl.constexpr, SRC_I64: tl.constexpr, DUP: tl.constexpr,
           SRC_STAGE: tl.constexpr):
    """Record the first bad id of destination block ``k`` (kernels/errors.py codes, op 3)."""
    code = tl.full([], -1, tl.int32)
    value = tl.full([], 0, tl.int64)
    index = k.to(tl.int64)
    limit = dst_n
    if not SRC_STAGE:
        for tc in range(0, BS_D, TB):
            t = k * BS_D + tc + tl.arange(0, TB)
            tm = (tc + tl.arange(0, TB) < BS_D) & (t < T)
            si = t // BS_S
            if SRC_I64:
                s = tl.load(src_ids.to(tl.pointer_type(tl.int64)) + si, mask=tm, other=0)
            else:
                s = tl.load(src_ids.to(tl.pointer_type(tl.int32)) + si, mask=tm, other=0).to(
                    tl.int64)
            bad = tm & ((s < -1) | (s >= src_n))
            if tl.sum(bad.to(tl.int32), 0) > 0:
                first = tl.min(tl.where(bad, si, 2 ** 31 - 1), 0)
                code = 48
                index = first.to(tl.int64)
                value = tl.max(tl.where(bad & (si == first), s, -2 ** 62), 0)
                limit = src_n
    if (db < -1) | (db >= dst_n):
        code, index, value, limit = 52, k.to(tl.int64), db, dst_n
    if DUP:
        if (db >= 0) & (db < dst_n):
            if tl.atomic_xchg(stamps.to(tl.pointer_type(tl.int32)) + db, call) == call:
                code, index, value, limit = 53, k.to(tl.int64), db, dst_n
    if code >= 0:
        free = tl.full([], 0, tl.int64)
        taken = tl.full([], 1, tl.int64)
        if tl.atomic_cas(err, free, taken) == 0:
            tl.store(err + 1, code.to(tl.int64))
            tl.store(err + 2, index)
            tl.store(err + 3, value)
            tl.store(err + 4, limit.to(tl.int64))
            tl.store(ready.to(tl.pointer_type(tl.int64)), 1)
