"""Launch plans of the re-blocking kernel (:mod:`.reblock`): constexprs worked out once per
(mapping, operand kinds, id dtypes, checks, alignment, grid cap), the compiled kernel kept after
its first launch and relaunched directly (as :mod:`.launch` does for the plain copy), so a call
only fills in addresses and counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from ..errors import record_for
from ..numba.floats import KINDS
from ..tables import alignment, stamps
from . import launch as _launch
from .copy_runs import interpreting
from .reblock import _reblock

_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
_NATIVE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
           torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_SM = {None: 0, "tensor": 1, "block_head": 2}
_RUNTIME = ("src_table", "dst_table", "src_ids", "dst_ids", "src_sc", "dst_sc", "T", "src_n",
            "dst_n", "kd", "hg", "total", "src_tstride", "dst_tstride", "errors", "ready",
            "stamps", "call")
_JIT: dict[bool, Any] = {}


@dataclasses.dataclass
class ReblockConfig:
    """Launch settings of the re-blocking kernel (first guesses, to be swept on an H200:
    ``python -m kvflow.bench reblock``).

    Attributes
    ----------
    tile_bytes : int
        Bytes of the wider side one program moves per step (``HB x TB x head_dim`` elements).
    num_warps : int
        Warps per program.
    native_convert : bool
        On a GPU, convert with the hardware's round-to-nearest-even instructions; False uses
        the integer bit operations of :mod:`.floats` (always used by the CPU interpreter).
    """

    tile_bytes: int = 16384
    num_warps: int = 8
    native_convert: bool = True


CONFIG = ReblockConfig()


def kernel():
    mode = interpreting()
    if mode not in _JIT:
        _JIT[mode] = triton.jit(_reblock.fn, do_not_specialize=list(_RUNTIME))
    return _JIT[mode]


def _pow2_le(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _fmt(dtype: torch.dtype, native: bool, convert: bool) -> dict:
    _, mb, bias, emin = KINDS.get(dtype, (0, 23, 127, -126))
    isz = dtype.itemsize
    eb = {127: 8, 15: 5, 7: 4}[bias]
    return dict(T=_NATIVE[dtype] if native else _WORDS[isz], MB=mb, BIAS=bias, EB=eb, EMIN=emin,
                MASK=(1 << 8 * isz) - 1 if isz < 4 else -1)


class ReblockPlan:
    """One launch shape of :func:`.reblock._reblock` (see the module docstring)."""

    def __init__(self, job, device: torch.device, s_align: int, d_align: int, s_i64: bool,
                 d_i64: bool, check: bool, dup: bool, max_ctas: int | None,
                 config: ReblockConfig | None = None) -> None:
        cfg = self.config = config or CONFIG
        mp = job.mapping
        D, s, d = mp.head_dim, mp.src, mp.dst
        native = cfg.native_convert and device.type == "cuda" and not interpreting()
        if mp.convert:
            si, di = s.dtype.itemsize, d.dtype.itemsize
            vec = 16
            while vec > 1 and (D % vec or vec * si > alignment(s_align, D * si)
                               or vec * di > alignment(d_align, D * di)):
                vec //= 2
            sw = dw = 1  # strides stay in elements
            fs, fd = _fmt(s.dtype, native, True), _fmt(d.dtype, native, True)
            widest = max(si, di)
            row = D
        else:
            rb = D * s.dtype.itemsize
            vb = alignment(rb, s_align, d_align)
            word = min(vb, 8)
            vec = vb // word
            sw = dw = word // s.dtype.itemsize if word >= s.dtype.itemsize else 0
            fs = fd = dict(T=_WORDS[word], MB=23, BIAS=127, EB=8, EMIN=-126, MASK=-1)
            widest = word
            row = rb // word
            self._word_div = (s.dtype.itemsize, word)
        st = (lambda x: x) if mp.convert else (lambda x: x * s.dtype.itemsize // word)
        DB = triton.next_power_of_2(row)
        tile = max(1, cfg.tile_bytes // widest)
        TB = min(triton.next_power_of_2(d.block_size), _pow2_le(max(1, tile // DB)))
        HB = min(triton.next_power_of_2(mp.heads), _pow2_le(max(1, tile // (DB * TB))))
        self.hg = -(-mp.heads // HB)
        self.kd_block = d.block_size
        self.max_ctas, self.warps = max_ctas, cfg.num_warps
        self.index = device.index if device.type == "cuda" else None
        self.consts = dict(
            SRC_T=fs["T"], DST_T=fd["T"], CONVERT=mp.convert, NATIVE=native, S_MB=fs["MB"],
            S_BIAS=fs["BIAS"], S_EB=fs["EB"], S_MASK=fs["MASK"], D_MB=fd["MB"],
            D_BIAS=fd["BIAS"], D_EB=fd["EB"], D_EMIN=fd["EMIN"], S_SM=_SM[s.scales],
            D_SM=_SM[d.scales], FMAX=_FP8_MAX.get(d.dtype, 1.0), MIN_AMAX=2.0 ** -100,
            BS_S=s.block_size, SBS=st(s.block_stride), SSS=st(s.slot_stride),
            SHS=st(s.head_stride), S0=s.head0, SNH=s.num_kv_heads, BS_D=d.block_size,
            DBS=st(d.block_stride), DSS=st(d.slot_stride), DHS=st(d.head_stride), D0=d.head0,
            DNH=d.num_kv_heads, HEADS=mp.heads, DW=row, VEC=vec, HB=HB, TB=TB, DB=DB,
            S_ALIGN=alignment(s_align), D_ALIGN=alignment(d_align),
            SRC_STAGE=job.src.cache is None, DST_STAGE=job.dst.cache is None, SRC_I64=s_i64,
            DST_I64=d_i64, CHECK=check, DUP=dup)
        self.const_values = tuple(self.consts.values())
        self.elem = (1, 1) if mp.convert else (s.dtype.itemsize, word)
        self.compiled = None
        # no multiply-add contraction (Triton < 3.10 fuses by default): bit-exact to torch
        self.options = dict(num_warps=self.warps, enable_fp_fusion=False)

    def launch(self, *args) -> None:
        """Enqueue the kernel with the runtime ``args`` (in ``_RUNTIME`` order, ``total``
        included) on the current stream; no wait."""
        total = args[11]
        grid = total if self.max_ctas is None or total < self.max_ctas else self.max_ctas
        k = self.compiled
        if k is not None and _launch._get_device() == self.index:
            k.run(grid, 1, 1, _launch._raw_stream(self.index), k.function, k.packed_metadata,
                  None, None, None, *args, *self.const_values)
            return
        if self.index is None:
            kernel()[(grid,)](*args, **self.consts, **self.options)
            return
        prev = _launch._get_device()
        torch.cuda.set_device(self.index)
        try:
            self.compiled = kernel()[(grid,)](*args, **self.consts, **self.options)
        finally:
            torch.cuda.set_device(prev)


def _side(op, ntensors: int, dev, info_of):
    """(table or stage address, ids address, ids int64, alignment, tensor stride in elements)."""
    if op.cache is not None:
        info = info_of(op.cache, dev)
        T = op.spec.tensors_per_layer
        return info.table + op.j0 * 8, op.ids.data_ptr(), op.ids.dtype == torch.int64, \
            info.align, 0
    per = op.num_blocks * op.spec.block_numel
    return op.stage.data_ptr(), 0, False, alignment(op.stage.data_ptr(),
                                                     per * op.spec.itemsize), per


def _scales_addr(op) -> int:
    if op.scales is None:
        return 0
    per = op.scales[0].numel() if op.scales.dim() > 1 else 1
    return op.scales.data_ptr() + op.j0 * per * 4


def launch(job, device: torch.device, max_ctas: int | None, check: bool, info_of,
           capturing: bool) -> None:
    """Run a checked :class:`~kvflow.kernels.contract.Job` as one launch."""
    s_tab, s_ids, s64, s_al, s_ts = _side(job.src, job.ntensors, device, info_of)
    d_tab, d_ids, d64, d_al, d_ts = _side(job.dst, job.ntensors, device, info_of)
    dup = check and not capturing and job.dst.cache is not None
    owner = job.dst.cache if job.dst.cache is not None else job.src.cache
    plans = owner.backend_state.setdefault("reblock_plans", {})
    key = (job.mapping, job.src.cache is None, job.dst.cache is None, s64, d64, check, dup,
           s_al, d_al, max_ctas)
    plan = plans.get(key)
    if plan is None or plan.config is not CONFIG:
        plan = plans[key] = ReblockPlan(job, device, s_al, d_al, s64, d64, check, dup, max_ctas)
    kd = -(-job.num_tokens // job.mapping.dst.block_size)
    total = job.ntensors * kd * plan.hg
    if total >= _launch.MAX_ITEMS:
        raise ValueError(f"{total} work items exceed the kernel's int32 index; split the call")
    rec = record_for(device)
    st = stamps(job.dst.cache, device) if dup else None
    e_s, e_d = plan.elem
    plan.launch(s_tab, d_tab, s_ids, d_ids, _scales_addr(job.src), _scales_addr(job.dst),
                job.num_tokens, job.src.num_blocks, job.dst.num_blocks, kd, plan.hg, total,
                s_ts * e_s // e_d, d_ts * e_s // e_d, rec.record_addr, rec.ready_addr,
                st.addr if st else 0, st.next() if st else 0)
