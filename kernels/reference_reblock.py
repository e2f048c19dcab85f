"""The torch reference of re-blocked copies (:mod:`kvflow.kernels.reblock`): defines the result.

Token map, heads and layouts as in :mod:`kvflow.kernels.reblock`. Per per-layer tensor, the
valid tokens' ``[tokens, heads, head_dim]`` rows are read with advanced indexing through a
strided ``[blocks, block_size, heads, head_dim]`` view of each side (the layout as strides),
converted, and written with one indexed assignment. Slow and obviously right.

Conversion (when :attr:`Mapping.convert`), all in float32 with IEEE round-to-nearest-even:

1. dequantize: ``x = float32(q)``, times the source scale for fp8 (``scales[j]`` per tensor,
   ``scales[j, src block, head]`` per block per head);
2. quantize to the destination dtype:

   - bfloat16 / float16 / float32: ``x.to(dtype)`` (round to nearest even; float16 overflow
     gives inf);
   - fp8, per-tensor scales: ``clamp(x * (1 / scales[j]), -M, M).to(fp8)`` with ``M`` the
     largest finite fp8 (448 for e4m3fn, 57344 for e5m2); the destination's per-tensor scales
     are read, never written;
   - fp8, per-block-per-head scales: for each destination block and head that the call
     writes, ``scale = max(amax, MIN_AMAX) / M`` where ``amax`` is the largest ``|x|`` over
     the tokens written there (``MIN_AMAX = 2**-100`` keeps scales normal); that scale is
     stored in the destination's scales and ``clamp(x * (1 / scale), -M, M).to(fp8)``
     written. Slots of the block the call leaves untouched keep their bytes (the scale of the
     block then also applies to them).

``1 / s`` and ``a / M`` are correctly rounded float32 divisions (:func:`div_rn`, also on CUDA,
where torch's ``tensor / python_float`` is ``tensor * (1 / python_float)``); the Triton kernel
divides with ``div.rn.f32`` and never contracts a multiply and an add (tests/reblock_ptx.py).
NaN and infinite inputs are outside the contract (backends may differ on them).
"""

from __future__ import annotations

import torch

from .contract import Job, Operand
from .reblock import Side, token_slots

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_AMAX = 2.0 ** -100


def tensors_of(op: Operand, ntensors: int) -> list[torch.Tensor]:
    """The operand's per-layer tensors of the range, each ``[num_blocks, *block_shape]``."""
    if op.cache is not None:
        return op.cache.tensors()[op.j0:op.j0 + ntensors]
    return list(op.stage.reshape(ntensors, op.num_blocks, *op.spec.block_shape).unbind(0))


def _rows_view(t: torch.Tensor, side: Side, head_dim: int) -> torch.Tensor:
    """``t`` as ``[num_blocks, block_size, num_kv_heads, head_dim]`` through the side's strides."""
    nb = t.shape[0]
    return t.as_strided((nb, side.block_size, side.num_kv_heads, head_dim),
                        (side.block_stride, side.slot_stride, side.head_stride or 1, 1),
                        t.storage_offset())


def _table(op: Operand) -> torch.Tensor:
    if op.ids is None:
        return torch.arange(op.num_blocks, device="cpu")
    return op.ids.to("cpu", torch.int64)


def div_rn(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` in float32, correctly rounded (IEEE round to nearest even) on every device.

    At least one of ``a``, ``b`` is a float32 tensor; a Python float is made a tensor of the
    other's shape on its device first, because torch on CUDA computes ``tensor / float`` as
    ``tensor * (1 / float)`` (ATen's ``div_true_kernel_cuda``), one rounding more, which
    differs in the last bit for about half of all quotients by 448."""
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return torch.div(a, b)


def quantize(x: torch.Tensor, dtype: torch.dtype, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 ``x`` to ``dtype`` (fp8: ``clamp(x * inv_scale, -M, M)``, see the module docstring)."""
    if dtype not in FP8_MAX:
        return x.to(dtype)
    m = FP8_MAX[dtype]
    return torch.clamp(x * inv_scale, -m, m).to(dtype)


def reblock(job: Job) -> None:
    """Run ``job`` (see the module docstring)."""
    mp, T = job.mapping, job.num_tokens
    s_i, s_slot = token_slots(T, mp.src.block_size)
    d_i, d_slot = token_slots(T, mp.dst.block_size)
    s_tab, d_tab = _table(job.src), _table(job.dst)
    sb = s_tab[s_i] if T else s_i
    db = d_tab[d_i] if T else d_i
    keep = (sb >= 0) & (sb < job.src.num_blocks) & (db >= 0) & (db < job.dst.num_blocks)
    sb, s_slot, db, d_slot = sb[keep], s_slot[keep], db[keep], d_slot[keep]
    n, D = mp.heads, mp.head_dim
    hs = slice(mp.src.head0, mp.src.head0 + n)
    hd = slice(mp.dst.head0, mp.dst.head0 + n)
    src_t = tensors_of(job.src, job.ntensors)
    dst_t = tensors_of(job.dst, job.ntensors)
    dev = src_t[0].device
    sb, s_slot = sb.to(dev), s_slot.to(dev)
    db_d, d_slot_d = db.to(dst_t[0].device), d_slot.to(dst_t[0].device)
    for j in range(job.ntensors):
        sv = _rows_view(src_t[j], mp.src, D)
        dv = _rows_view(dst_t[j], mp.dst, D)
        rows = sv[sb, s_slot, hs]                               # [V, n, D]
        if not mp.convert:
            dv[db_d, d_slot_d, hd] = rows.to(dv.device)
            continue
        x = rows.float()
        if mp.src.scales == "tensor":
            x = x * job.src.scales[job.src.j0 + j]
        elif mp.src.scales == "block_head":
            x = x * job.src.scales[job.src.j0 + j][sb, hs].unsqueeze(-1)
        x = x.to(dv.device)
        inv = None
        if mp.dst.scales == "tensor":
            inv = div_rn(1.0, job.dst.scales[job.dst.j0 + j])
        elif mp.dst.scales == "block_head":
            inv = _block_head_inv(x, db_d, job.dst, j, hd, mp.dst.dtype)
        dv[db_d, d_slot_d, hd] = quantize(x, mp.dst.dtype, inv)


def _block_head_inv(x: torch.Tensor, db: torch.Tensor, dst: Operand, j: int, hd: slice,
                    dtype: torch.dtype) -> torch.Tensor:
    """Set the scales of every (destination block, head) written from ``x`` ([V, n, D]) and
    return ``1 / scale`` per row ([V, n, 1])."""
    scales = dst.scales[dst.j0 + j]                          # [num_blocks, num_kv_heads]
    n = x.shape[1]
    amax = torch.zeros(dst.num_blocks, n, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, db.unsqueeze(1).expand(-1, n), x.abs().amax(-1), "amax",
                         include_self=True)
    hit = torch.zeros(dst.num_blocks, dtype=torch.bool, device=x.device)
    hit[db] = True
    scale = div_rn(torch.clamp(amax, min=MIN_AMAX), FP8_MAX[dtype])
    scales[hit, hd] = scale[hit]
    return div_rn(1.0, scale)[db].unsqueeze(-1)
