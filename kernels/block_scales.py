"""Per-block fp8 scales of the equal-spec ops (issue #19).

The bytes of a block of an fp8 cache with ``scales="block_head"`` mean nothing without the
block's scales ``scales[j, block, :]`` (:mod:`kvflow.scales`). When :func:`copy_blocks`,
:func:`gather_blocks` or :func:`scatter_blocks` moves such blocks between equal specs (the
byte-copy backends), :func:`move_scales` moves their scales after the bytes, for the tensors of
the layer range: one gather and one indexed assignment on the destination's device, no host
synchronisation, the same for every backend. A staging buffer carries them in ``out_scales`` /
``src_scales`` ``[tensors, n, num_kv_heads]`` (slot ``i`` holds the scales of the buffer's
block ``i``), as a re-blocking one does (:mod:`kvflow.kernels.reblock_ops`).
"""

from __future__ import annotations

from typing import Any

import torch


def per_block(spec: Any) -> bool:
    """True when ``spec`` is fp8 with per-block per-head scales (``scales="block_head"``)."""
    return spec.is_fp8 and spec.scales == "block_head"


def move_scales(src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
    """``dst[:, d[i]] = src[:, s[i]]`` for every pair ``i`` whose two ids are in range (``-1``
    and any other id outside ``[0, blocks)`` skip the pair; ``dst`` keeps its values there).

    Parameters
    ----------
    src : torch.Tensor, float32 [tensors, src_blocks, num_kv_heads]
        May be on another device than ``dst`` (a peer GPU).
    dst : torch.Tensor, float32 [tensors, dst_blocks, num_kv_heads]
        Written in place (a view of a cache's scales or a staging buffer's ``out_scales``).
    s, d : torch.Tensor, int32 or int64 [n]
        Pairs of block ids, on ``dst``'s device; ``d`` distinct (other than skipped ids).

    Notes
    -----
    No boolean mask (its ``nonzero`` would wait for the device): a pair without a valid
    destination writes the pair of the first valid destination again (same place, same
    value), and a pair whose source is skipped writes its destination's own value back.
    """
    ns, nd = src.shape[1], dst.shape[1]
    n = d.shape[0]
    if not n or not ns or not nd:
        return
    d_ok = (d >= 0) & (d < nd)
    ok = d_ok & (s >= 0) & (s < ns)
    first = torch.argmax(d_ok.to(torch.int32))  # 0 when no destination is valid
    r = torch.where(d_ok, torch.arange(n, device=d.device), first)
    tgt = d.clamp(0, nd - 1).long()[r]
    blk = s.clamp(0, ns - 1).long()[r]
    new = src[:, blk.to(src.device)].to(dst.device, non_blocking=True)
    dst[:, tgt] = torch.where(ok[r][None, :, None], new, dst[:, tgt])


def check_stage_scales(name: str, scales: Any, spec: Any, shape: tuple[int, ...],
                       device: torch.device) -> torch.Tensor | None:
    """``scales`` (``out_scales`` / ``src_scales``) of a staging buffer of the cache's own
    ``spec``: required, float32 contiguous of ``shape`` on ``device``, for a ``block_head``
    fp8 spec; None otherwise.

    Raises
    ------
    ValueError
        Missing or malformed for a ``block_head`` spec, or given for another spec (naming
        the argument).
    """
    arg = f"{name}_scales"
    if not per_block(spec):
        if scales is not None:
            raise ValueError(f"{arg} given for a staging buffer of the cache's spec "
                             f"(dtype={spec.dtype}, scales={spec.scales!r}), which carries no "
                             f"per-block scales (only fp8 with scales='block_head' does)")
        return None
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 \
            or tuple(scales.shape) != shape or scales.device != device \
            or not scales.is_contiguous():
        got = (f"{scales.dtype} of shape {tuple(scales.shape)} on {scales.device}"
               if isinstance(scales, torch.Tensor) else repr(scales))
        raise ValueError(f"{arg} must be a contiguous float32 tensor of shape {shape} on "
                         f"{device}: the cache is fp8 with scales='block_head' and each block's "
                         f"scales move with its bytes, got {got}")
    return scales
