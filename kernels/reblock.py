"""Re-blocking: where each token of a sequence sits in two paged caches of different specs.

``src_ids`` and ``dst_ids`` are the block tables of **one token sequence** on each side. Token
``t < num_tokens`` of the sequence is at slot ``t % bs_src`` of block ``src_ids[t // bs_src]``
and lands at slot ``t % bs_dst`` of block ``dst_ids[t // bs_dst]``, in every per-layer tensor
of the layer range (layer ``l`` to layer ``l``)::

    bs_src = 4:  src_ids = [ 7      | 2      | 9      ]    tokens 0..9 (num_tokens = 10)
                            t0..t3   t4..t7   t8 t9 . .
    bs_dst = 8:  dst_ids = [ 5              | 1              ]
                            t0 ........ t7   t8 t9 . . . . . .   (slots 2..7 of block 1 untouched)

A token whose source or destination block id is -1 (padding) is skipped: its destination slot
keeps its bytes. Slots past ``num_tokens`` are never read or written.

Heads: the caches may hold different KV heads of one model (tensor parallelism). When the
destination holds fewer heads, its ``n`` heads are the source's ``[head_start, head_start + n)``
(a TP=2 decode instance fed by a TP=1 prefill); when it holds more, the source's ``n`` heads
land in ``[head_start, head_start + n)`` of the destination (fan-in). ``head_dim`` and
``num_layers`` must match; MLA maps only to MLA.

Layouts are data: element ``(slot s, head h, dim d)`` of block ``b`` of one per-layer tensor is
at element offset ``b * block_stride + s * slot_stride + h * head_stride + d``
(:func:`side_strides`); NHD, HND and MLA differ only in these three numbers, so one kernel
serves every pair of layouts. Every ``(token, head)`` row of ``head_dim`` elements is
contiguous on both sides: the unit the kernels move.

Dtypes: equal dtypes (not fp8) move bytes unchanged. Any other pair of bfloat16, float16,
float32, float8_e4m3fn, float8_e5m2 converts through float32 with the scales the caches hold
(:mod:`kvflow.scales`); the arithmetic is defined by :mod:`kvflow.kernels.reference_reblock`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvflow.layout import KVCacheSpec, is_int

#: Layouts a re-blocked copy maps between (vLLM's LBHNC / LBNHC move only between equal specs).
REBLOCK_LAYOUTS = ("NHD", "HND", "MLA", "BM_NHD")
CONVERTIBLE = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
               torch.float8_e5m2)


def side_strides(spec: KVCacheSpec) -> tuple[int, int, int]:
    """``(block_stride, slot_stride, head_stride)`` in elements of one per-layer tensor.

    >>> side_strides(KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16,
    ...                          dtype="bf16", layout="HND"))
    (16384, 128, 2048)
    """
    h, d, bs = spec.num_kv_heads, spec.head_dim, spec.block_size
    if spec.view_layout == "NHD":  # NHD, and block-major BM_NHD: blocks further apart
        return (spec.block_stride_bytes // spec.itemsize, h * d, d)
    if spec.layout == "HND":
        return (h * bs * d, d, bs * d)
    if spec.layout == "MLA":
        return (bs * d, d, 0)  # one latent "head"
    raise ValueError(f"layout={spec.layout!r}: re-blocking maps {', '.join(REBLOCK_LAYOUTS)} "
                     f"caches")


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a re-blocked copy: its geometry (element strides), the first head moved,
    its dtype and scale mode (None: no scales, the dtype is not fp8)."""

    block_size: int
    num_kv_heads: int
    head0: int
    block_stride: int
    slot_stride: int
    head_stride: int
    dtype: torch.dtype
    scales: str | None

    @classmethod
    def of(cls, spec: KVCacheSpec, head0: int) -> "Side":
        return cls(spec.block_size, spec.num_kv_heads, head0, *side_strides(spec), spec.dtype,
                   spec.scales if spec.is_fp8 else None)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """What a re-blocked copy between two specs moves (see the module docstring).

    Attributes
    ----------
    src, dst : Side
    heads : int
        KV heads moved per token (the smaller side's ``num_kv_heads``).
    head_dim : int
        Elements per head row.
    tensors_per_layer : int
        2 (K, V) or 1 (MLA latent).
    convert : bool
        False when bytes move unchanged (equal dtypes, not fp8).
    """

    src: Side
    dst: Side
    heads: int
    head_dim: int
    tensors_per_layer: int
    convert: bool


def make_mapping(src: KVCacheSpec, dst: KVCacheSpec, head_start: Any = None, *,
                 src_name: str = "src_cache", dst_name: str = "dst_cache") -> Mapping:
    """Check that ``src`` maps onto ``dst`` and return the :class:`Mapping`.

    Parameters
    ----------
    src, dst : KVCacheSpec
        The two sides' specs (any block sizes, NHD/HND in any pair, MLA only with MLA).
    head_start : int or None
        First head of the slice when ``num_kv_heads`` differ (required then); must be None or 0
        when they are equal.

    Raises
    ------
    TypeError, ValueError
        Naming the field or ``head_start`` and both values, e.g. ``head_dim: src_cache has
        128, dst_cache has 64; a head moves whole, so head_dim must be equal``.
    """
    a, b = src_name, dst_name
    for name, side in ((a, src), (b, dst)):
        if side.layout not in REBLOCK_LAYOUTS:
            raise ValueError(f"layout: {name} has {side.layout!r}; re-blocking maps "
                             f"{', '.join(REBLOCK_LAYOUTS)} caches (K and V side by side in one "
                             f"tensor move only between equal specs)")
    if (src.layout == "MLA") != (dst.layout == "MLA"):
        raise ValueError(f"layout: {a} has {src.layout!r}, {b} has {dst.layout!r}; an MLA cache "
                         f"maps only to an MLA cache")
    if src.num_layers != dst.num_layers:
        raise ValueError(f"num_layers: {a} has {src.num_layers}, {b} has {dst.num_layers}; "
                         f"layer l maps to layer l, so they must be equal")
    if src.head_dim != dst.head_dim:
        raise ValueError(f"head_dim: {a} has {src.head_dim}, {b} has {dst.head_dim}; a head "
                         f"moves whole, so head_dim must be equal")
    convert = src.dtype != dst.dtype or src.is_fp8
    if convert and (src.dtype not in CONVERTIBLE or dst.dtype not in CONVERTIBLE):
        raise ValueError(f"dtype: {a} has {src.dtype}, {b} has {dst.dtype}; only "
                         f"{', '.join(str(d).removeprefix('torch.') for d in CONVERTIBLE)} "
                         f"convert")
    hs, hd = src.num_kv_heads, dst.num_kv_heads
    if head_start is not None and not is_int(head_start):
        raise TypeError(f"head_start must be None or an int, got {head_start!r}")
    if hs == hd:
        if head_start not in (None, 0):
            raise ValueError(f"head_start={head_start} but {a} and {b} both hold {hs} KV heads; "
                             f"head_start must be None or 0")
        s0 = d0 = 0
    else:
        n, big = min(hs, hd), max(hs, hd)
        if head_start is None:
            raise ValueError(f"num_kv_heads: {a} has {hs}, {b} has {hd}; pass head_start (the "
                             f"{n} heads are [head_start, head_start + {n}) of the {big})")
        if not 0 <= head_start <= big - n:
            raise ValueError(f"head_start={head_start} is out of range: {a} has {hs} KV heads, "
                             f"{b} has {hd} (need 0 <= head_start <= {big - n})")
        s0, d0 = (int(head_start), 0) if hs > hd else (0, int(head_start))
    return Mapping(Side.of(src, s0), Side.of(dst, d0), min(hs, hd), src.head_dim,
                   src.tensors_per_layer, convert)


def check_num_tokens(num_tokens: Any, n_src: int, bs_src: int, n_dst: int, bs_dst: int, *,
                     src_name: str = "src_ids", dst_name: str = "dst_ids") -> int:
    """Tokens to move: ``num_tokens``, or by default all that both block tables hold,
    ``min(n_src * bs_src, n_dst * bs_dst)``.

    Raises
    ------
    TypeError
        ``num_tokens`` is not None or an int.
    ValueError
        ``num_tokens`` is negative or more than a block table holds (naming both tables).
    """
    cap = min(n_src * bs_src, n_dst * bs_dst)
    if num_tokens is None:
        return cap
    if not is_int(num_tokens):
        raise TypeError(f"num_tokens must be None or an int, got {num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_tokens > cap:
        raise ValueError(f"num_tokens={num_tokens} is more than the block tables hold: {src_name} "
                         f"has {n_src} blocks of {bs_src} tokens ({n_src * bs_src}), {dst_name} "
                         f"{n_dst} blocks of {bs_dst} ({n_dst * bs_dst})")
    return int(num_tokens)


def token_slots(num_tokens: int, block_size: int, device: Any = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index into the block table, slot in the block)`` of tokens ``0..num_tokens-1``
    (int64 tensors of shape [num_tokens])."""
    t = torch.arange(num_tokens, device=device)
    return t // block_size, t % block_size
