"""Read a :class:`~kvflow.PagedKVCache` out of the KV cache tensors vLLM registers.

vLLM 0.32 hands a KV connector one tensor per attention layer
(``KVConnectorBase_V1.register_kv_caches(kv_caches)``, a dict ``layer name -> tensor``): a
view ``[B, H, N, C]`` (blocks, KV heads, tokens of a block, content: K then V of one head and
token, ``2 * head_dim`` elements) over one allocation, with strides set by the resolved
``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``). :func:`from_vllm` reads the layout from the
shape and strides alone and wraps the tensors without copying:

=================================  ===========================  ==============================
strides of ``[B, H, N, C]``        kvflow layout                tensor kvflow moves
=================================  ===========================  ==============================
``(H*N*C, N*C, C, 1)``             ``LBHNC``                    the view itself
``(N*H*C, C, H*C, 1)``             ``LBNHC``                    ``view.permute(0, 2, 1, 3)``
either, ``H == 1``, ``latent``     ``MLA`` (``C = latent_dim``) ``view.reshape(B, N, C)``
=================================  ===========================  ==============================

Anything else is refused with the shape and stride named: a block stride larger than one page
(cross-layer layouts ``BLHNC``/``BLNHC``, where other layers' pages sit between a layer's
blocks, or padded pages), heads outside the block (``LHBNC``/``BHLNC``), or another rank.
This module imports nothing from vLLM.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .cache import PagedKVCache
from .layout import KVCacheSpec


def _describe(name: str, t: torch.Tensor) -> str:
    return f"kv_caches[{name!r}] has shape {tuple(t.shape)} and stride {tuple(t.stride())}"


def _physical_view(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``(layout, view)``: the tensor as kvflow moves it (block dimension first, contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kv_caches[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{_describe(name, t)}: expected vLLM's 4-D per-layer view "
                         f"[num_blocks, num_kv_heads, block_size, content] (vLLM >= 0.32)")
    B, H, N, C = t.shape
    if t.is_contiguous():
        return "LBHNC", t
    swapped = t.permute(0, 2, 1, 3)
    if swapped.is_contiguous():
        return "LBNHC", swapped
    page = H * N * C
    interior = t[:1]
    if interior.is_contiguous() or interior.permute(0, 2, 1, 3).is_contiguous():
        raise ValueError(f"{_describe(name, t)}: block stride {t.stride(0)} elements but a page "
                         f"holds {page}: blocks of one layer are not adjacent (a cross-layer "
                         f"layout such as BLHNC/BLNHC, or padded pages); kvflow reads the "
                         f"layer-compact layouts LBHNC and LBNHC (VLLM_KV_CACHE_LAYOUT)")
    raise ValueError(f"{_describe(name, t)}: one block is not one contiguous run (heads "
                     f"outside the block, e.g. LHBNC/BHLNC); kvflow reads the layer-compact "
                     f"layouts LBHNC and LBNHC (VLLM_KV_CACHE_LAYOUT)")


def _facts(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype,
            "device": t.device}


def _check_same(first: tuple[str, torch.Tensor], other: tuple[str, torch.Tensor]) -> None:
    (f_name, f), (name, t) = first, other
    mine, theirs = _facts(t), _facts(f)
    for what in mine:
        if mine[what] != theirs[what]:
            raise ValueError(f"kv_caches[{name!r}] has {what} {mine[what]}; "
                             f"kv_caches[{f_name!r}] has {theirs[what]}; kvflow moves layers "
                             f"of one geometry")


def from_vllm(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *,
              latent: bool = False) -> PagedKVCache:
    """Wrap vLLM's registered KV cache tensors as one :class:`PagedKVCache`, without copying.

    Parameters
    ----------
    kv_caches : dict of str -> torch.Tensor, or a sequence of tensors
        What vLLM passes to ``register_kv_caches``: per attention layer, in layer order, a 4-D
        view ``[num_blocks, num_kv_heads, block_size, C]`` of the KV dtype, where
        ``C = 2 * head_dim`` (K then V) or, with ``latent=True``, ``C = latent_dim``
        (``num_kv_heads == 1``). Layers that share one tensor (vLLM's KV sharing) are kept once.
    latent : bool
        The content is one MLA latent per token, not K and V.

    Returns
    -------
    PagedKVCache
        ``spec.layout`` is ``"LBHNC"`` or ``"LBNHC"`` (``"MLA"`` with ``latent``),
        ``spec.num_layers`` the number of distinct tensors, ``spec.block_size = N``,
        ``spec.num_kv_heads = H``, ``spec.head_dim = C // 2`` (``C`` with ``latent``); its
        tensors are views of vLLM's memory (a write through kvflow's ops is a write to vLLM's
        cache).

    Raises
    ------
    ValueError
        For no tensors, a tensor whose shape and stride kvflow cannot read (the message names
        the layer, its shape and stride, and why), tensors of different shapes, strides, dtypes
        or devices, an odd ``C`` without ``latent``, or ``latent`` with ``H != 1``.
    TypeError
        For an entry that is not a tensor.

    Examples
    --------
    >>> buf = torch.zeros(2 * 8 * 2 * 32 * 64, dtype=torch.bfloat16)
    >>> layers = {f"model.layers.{i}.self_attn.attn": buf[i * 32768:(i + 1) * 32768]
    ...           .view(8, 2, 32, 64) for i in range(2)}
    >>> cache = from_vllm(layers)
    >>> cache.spec.layout, cache.spec.block_size, cache.spec.num_kv_heads, cache.spec.head_dim
    ('LBHNC', 32, 2, 32)
    """
    items = list(kv_caches.items()) if isinstance(kv_caches, Mapping) else \
        [(str(i), t) for i, t in enumerate(kv_caches)]
    if not items:
        raise ValueError("kv_caches is empty: vLLM registered no attention layer")
    seen: set[tuple[int, tuple[int, ...]]] = set()
    views, layout, first = [], None, None
    for name, t in items:
        lay, view = _physical_view(name, t)
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # a layer that reuses another layer's cache
            continue
        seen.add(key)
        if first is None:
            first, layout = (name, t), lay
        else:
            _check_same(first, (name, t))
        views.append(view)
    name, t = first
    B, H, N, C = t.shape
    if latent:
        if H != 1:
            raise ValueError(f"{_describe(name, t)}: latent=True needs one head (H == 1), got {H}")
        spec = KVCacheSpec(num_layers=len(views), num_kv_heads=1, head_dim=C, block_size=N,
                           dtype=t.dtype, layout="MLA")
        views = [v.reshape(B, N, C) for v in views]
    else:
        if C % 2:
            raise ValueError(f"{_describe(name, t)}: content C={C} is odd, so it is not K and V "
                             f"of one head side by side; pass latent=True for an MLA latent")
        spec = KVCacheSpec(num_layers=len(views), num_kv_heads=H, head_dim=C // 2,
                           block_size=N, dtype=t.dtype, layout=layout)
    return PagedKVCache.from_tensors(spec, views)


def vllm_layout_strides(layout: str, shape: tuple[int, int, int, int]) -> tuple[int, ...]:
    """Element strides of vLLM's ``[B, H, N, C]`` view for a layer-compact, unpadded layout
    (``"LBHNC"`` or ``"LBNHC"``): what vLLM's ``compute_layout_strides`` gives, for tests and
    docs that make vLLM-like tensors without vLLM.

    Raises
    ------
    ValueError
        For another layout name.
    """
    B, H, N, C = shape
    if layout == "LBHNC":
        return (H * N * C, N * C, C, 1)
    if layout == "LBNHC":
        return (N * H * C, C, H * C, 1)
    raise ValueError(f"layout must be 'LBHNC' or 'LBNHC', got {layout!r}")


def vllm_like(layout: str, num_layers: int, shape: tuple[int, int, int, int],
              dtype: Any = torch.bfloat16, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views over one zeroed allocation on ``device``, laid out as
    vLLM 0.32 lays a layer-compact cache (layer ``l`` at ``l * page * B``), keyed by
    vLLM-style layer names."""
    B, H, N, C = shape
    per_layer = B * H * N * C
    buf = torch.zeros(num_layers * per_layer, dtype=dtype, device=device)
    strides = vllm_layout_strides(layout, shape)
    return {f"model.layers.{i}.self_attn.attn":
            torch.as_strided(buf, shape, strides, storage_offset=i * per_layer)
            for i in range(num_layers)}
