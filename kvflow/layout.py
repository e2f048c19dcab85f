"""KV-cache layouts as data.

A paged KV cache holds, for every layer, one tensor per cached quantity. Every tensor is
indexed by physical block id first, so one block of one tensor is ``block_bytes`` contiguous
bytes in every layout; a layout (a row of :data:`LAYOUT_TABLE`) says how many tensors a
layer has, the order and sizes of the dimensions inside a block, and whether the cache is
layer-major (each per-layer tensor one region) or block-major (each block one region holding
every layer's K and V):

=========  ==================================================  =================  ==============
layout     tensor shape                                        tensors per layer  used by
=========  ==================================================  =================  ==============
``NHD``    [num_blocks, block_size, num_kv_heads, head_dim]    2 (K, V)           FlashAttention
``HND``    [num_blocks, num_kv_heads, block_size, head_dim]    2 (K, V)           FlashInfer
``MLA``    [num_blocks, block_size, latent_dim]                1 (latent)         DeepSeek MLA
``LBHNC``  [num_blocks, num_kv_heads, block_size, 2*head_dim]  1 (K and V)        vLLM >= 0.32
``LBNHC``  [num_blocks, block_size, num_kv_heads, 2*head_dim]  1 (K and V)        vLLM >= 0.32
``BM_NHD`` [num_blocks, block_size, num_kv_heads, head_dim]    2 (K, V)           cross-layer
           views of one [num_blocks, num_layers, 2, block_size,                   blocks (NIXL)
           num_kv_heads, head_dim] memory
=========  ==================================================  =================  ==============

``BM_NHD`` is block-major NHD: all layers of one block (K and V of every layer, in
``tensors()`` order) are ``bytes_per_block`` contiguous bytes, so a run of consecutive block
ids is one contiguous region of the whole cache (one transfer descriptor, as vLLM's
cross-layer KV blocks). Its per-layer tensors are strided views with the NHD order inside a
block (``view_layout``): block ``b`` of tensor ``i`` starts at byte
``tensor_offset(i, num_blocks) + b * block_stride_bytes`` of the cache's memory, with
``block_stride_bytes = num_tensors * block_bytes`` (layer-major layouts: ``block_bytes``, and
tensor ``i`` starts at ``i * num_blocks * block_bytes``).

MLA is DeepSeek's compressed latent (``latent_dim = head_dim`` with ``num_kv_heads = 1``).
``LBHNC`` and ``LBNHC`` are the layer-compact members of vLLM's ``KVCacheLayout`` (vLLM 0.32,
``vllm/v1/kv_cache_layout.py``): its per-layer view is ``[B, H, N, C]`` (blocks, KV heads,
tokens of a block, content) with the K and V of one (head, token) side by side in ``C``
(``head_dim`` elements of K, then ``head_dim`` of V); ``LBHNC`` stores it in that order (the
CPU backend's only layout), ``LBNHC`` with N and H swapped. :func:`kvflow.vllm_layout.from_vllm`
reads the layout from the tensors vLLM registers. Kernels read these facts (tensors per layer,
shapes, strides, bytes) from :class:`KVCacheSpec`; they never branch on the layout name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from .dtypes import FP8_DTYPES, as_torch_dtype
from .layer_range import is_int, normalize_layers

__all__ = ["FP8_DTYPES", "LAYOUTS", "LAYOUT_TABLE", "SCALE_MODES", "KVCacheSpec", "Layout",
           "as_torch_dtype", "is_int", "normalize_layers"]

@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of :data:`LAYOUT_TABLE`: a layout as data.

    Attributes
    ----------
    tensors_per_layer : int
        Per-layer tensors (2: K and V apart; 1: a latent, or K and V side by side).
    block_dims : tuple of (field, factor)
        The dimensions inside one block, outermost first: each is ``factor`` times a
        :class:`KVCacheSpec` field (``"block_size"``, ``"num_kv_heads"`` or ``"head_dim"``).
    one_head : bool
        The layout stores one latent per token (``num_kv_heads`` must be 1).
    used_by : str
        Which engine or attention kernel stores its cache this way (for docs and errors).
    block_major : bool
        Blocks outermost in memory: block ``b`` of every per-layer tensor lies in one region
        of ``bytes_per_block`` bytes (False: each per-layer tensor is one region).
    view : str
        The layout a per-layer view follows inside a block (what attention reads), when it is
        another row's (``BM_NHD``: ``"NHD"``); empty: the row itself.
    """

    tensors_per_layer: int
    block_dims: tuple[tuple[str, int], ...]
    one_head: bool = False
    used_by: str = ""
    block_major: bool = False
    view: str = ""


_N, _H, _D = ("block_size", 1), ("num_kv_heads", 1), ("head_dim", 1)

#: Every layout kvflow moves, by name; kernels only see the facts derived from a row.
LAYOUT_TABLE: dict[str, Layout] = {
    "NHD": Layout(2, (_N, _H, _D), used_by="FlashAttention (vLLM < 0.32: [2, num_blocks, ...])"),
    "HND": Layout(2, (_H, _N, _D), used_by="FlashInfer"),
    "MLA": Layout(1, (_N, _D), one_head=True, used_by="DeepSeek MLA"),
    "LBHNC": Layout(1, (_H, _N, ("head_dim", 2)), used_by="vLLM >= 0.32 (CPU_ATTN)"),
    "LBNHC": Layout(1, (_N, _H, ("head_dim", 2)), used_by="vLLM >= 0.32 (FlexAttention)"),
    "BM_NHD": Layout(2, (_N, _H, _D), used_by="cross-layer blocks (vLLM + NIXL)",
                     block_major=True, view="NHD"),
}
LAYOUTS = tuple(LAYOUT_TABLE)
#: How an fp8 cache holds its dequantization scales (float32, ``value = fp8 * scale``):
#: ``"tensor"`` one per per-layer tensor, ``"block_head"`` one per block per KV head of each
#: per-layer tensor (see :mod:`kvflow.scales`).
SCALE_MODES = ("tensor", "block_head")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Geometry of a paged KV cache.

    Parameters
    ----------
    num_layers : int
        Transformer layers that own a KV cache.
    num_kv_heads : int
        KV heads per layer (after GQA grouping); must be 1 for ``MLA``.
    head_dim : int
        Elements per head; for ``MLA`` the latent width ``latent_dim``.
    block_size : int
        Tokens per block (page).
    dtype : torch.dtype, numpy dtype, paddle dtype or str
        Element type, stored as a ``torch.dtype`` (fp8 e4m3 included: kernels move bytes).
    layout : {"NHD", "HND", "MLA", "LBHNC", "LBNHC", "BM_NHD"}
        Tensors per layer and the order of the dimensions inside a block (see the module
        docstring and :data:`LAYOUT_TABLE`).
    scales : {"tensor", "block_head"}
        fp8 dtypes only: the granularity of the float32 dequantization scales the cache holds
        beside its blocks (``PagedKVCache.scales``, :mod:`kvflow.scales`); other dtypes hold no
        scales and keep the default ``"tensor"``.

    Raises
    ------
    TypeError, ValueError
        For a non-integer or non-positive size, an unknown dtype or layout, a one-latent
        layout (MLA) with ``num_kv_heads != 1``, or ``scales="block_head"`` for a dtype that is
        not fp8; the message names the argument and its value.

    Examples
    --------
    >>> spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64,
    ...                    dtype=torch.bfloat16, layout="NHD")
    >>> spec.block_shape, spec.block_bytes, spec.bytes_per_block
    ((64, 8, 128), 131072, 8388608)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    layout: str = "NHD"
    scales: str = "tensor"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", as_torch_dtype(self.dtype))
        if not isinstance(self.layout, str) or self.layout not in LAYOUT_TABLE:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if LAYOUT_TABLE[self.layout].one_head and self.num_kv_heads != 1:
            raise ValueError(f"layout={self.layout!r} stores one latent per token: num_kv_heads "
                             f"must be 1, got {self.num_kv_heads}")
        if self.scales not in SCALE_MODES:
            raise ValueError(f"scales must be one of {SCALE_MODES}, got {self.scales!r}")
        if self.scales != "tensor" and self.dtype not in FP8_DTYPES:
            raise ValueError(f"scales={self.scales!r} needs an fp8 dtype (float8_e4m3fn or "
                             f"float8_e5m2), got dtype={self.dtype}")

    # ---- derived geometry -------------------------------------------------------------
    @functools.cached_property
    def tensors_per_layer(self) -> int:
        """2 (K and V apart: NHD, HND), 1 (the MLA latent, or K and V side by side: LBHNC,
        LBNHC); from :data:`LAYOUT_TABLE`."""
        return LAYOUT_TABLE[self.layout].tensors_per_layer

    @functools.cached_property
    def num_tensors(self) -> int:
        """Per-layer tensors in the whole cache: ``num_layers * tensors_per_layer``."""
        return self.num_layers * self.tensors_per_layer

    @functools.cached_property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one tensor (everything after the block dimension), from the
        layout's ``block_dims`` in :data:`LAYOUT_TABLE`."""
        return tuple(getattr(self, name) * factor
                     for name, factor in LAYOUT_TABLE[self.layout].block_dims)

    @property
    def latent_dim(self) -> int:
        """Width of the MLA latent (``head_dim``); for other layouts heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    @functools.cached_property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @functools.cached_property
    def block_numel(self) -> int:
        """Elements in one block of one tensor."""
        return math.prod(self.block_shape)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes in one block of one tensor (one contiguous run)."""
        return self.block_numel * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Payload bytes of one logical block over all layers and tensors."""
        return self.block_bytes * self.num_tensors

    @property
    def bytes_per_token(self) -> int:
        """Payload bytes of one token's KV over all layers."""
        return self.bytes_per_block // self.block_size

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one per-layer tensor of a cache with ``num_blocks`` blocks."""
        return (num_blocks, *self.block_shape)

    # ---- where blocks lie (strides and offsets as data; kernels read only these) --------
    @functools.cached_property
    def block_major(self) -> bool:
        """True when each block holds every layer's tensors contiguously (``BM_NHD``)."""
        return LAYOUT_TABLE[self.layout].block_major

    @functools.cached_property
    def view_layout(self) -> str:
        """The layout of a per-layer view inside a block (``"NHD"`` for ``BM_NHD``; else
        ``layout``): what attention kernels and the engine branch on."""
        return LAYOUT_TABLE[self.layout].view or self.layout

    @functools.cached_property
    def block_stride_bytes(self) -> int:
        """Bytes from block ``b`` to block ``b + 1`` of one per-layer tensor: ``block_bytes``
        (layer-major) or ``bytes_per_block`` (block-major)."""
        return self.block_bytes * (self.num_tensors if self.block_major else 1)

    def tensor_offset(self, index: int, num_blocks: int) -> int:
        """Byte offset of block 0 of per-layer tensor ``index`` (``tensors()`` order) from the
        start of a cache of ``num_blocks`` blocks: ``index * block_bytes`` (block-major) or
        ``index * num_blocks * block_bytes``."""
        return index * self.block_bytes * (1 if self.block_major else num_blocks)

    def tensor_strides(self) -> tuple[int, ...]:
        """Element strides of one per-layer tensor of :meth:`tensor_shape` (blocks first; the
        dimensions inside a block are contiguous)."""
        inner, acc = [], 1
        for size in reversed(self.block_shape):
            inner.append(acc)
            acc *= size
        return (self.block_stride_bytes // self.itemsize, *reversed(inner))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def with_(self, **changes: Any) -> "KVCacheSpec":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain-value form for messages and result rows (dtype as its name, e.g. 'bfloat16')."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVCacheSpec":
        """Inverse of :meth:`to_dict`."""
        return cls(**d)

    @property
    def is_fp8(self) -> bool:
        """True for fp8 dtypes, which hold dequantization scales (``scales``)."""
        return self.dtype in FP8_DTYPES

    def diff(self, other: "KVCacheSpec") -> list[str]:
        """Fields that differ, each as ``'name: mine vs theirs'`` (empty if equal)."""
        return [f"{f.name}: {getattr(self, f.name)} vs {getattr(other, f.name)}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
