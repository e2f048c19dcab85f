"""Paged attention in torch: write a step's K/V into cache slots, read a request's context back
through its block table, attend with a causal mask.

Cache tensors are those of :class:`kvflow.PagedKVCache` for one layer: K and V each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) or
``[num_blocks, num_kv_heads, block_size, head_dim]`` (HND). Token position ``p`` of a request
lives in block ``block_table[p // block_size]`` at slot ``p % block_size``.
GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (HF convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
             slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """Store ``k``, ``v`` [n, num_kv_heads, head_dim] at (``blocks[i]``, ``slots[i]``) (int64 [n])."""
    if layout == "NHD":
        k_cache[blocks, slots] = k.to(k_cache.dtype)
        v_cache[blocks, slots] = v.to(v_cache.dtype)
    else:  # HND: the advanced indices around a slice put n first, matching k's [n, H, D]
        k_cache[blocks, :, slots] = k.to(k_cache.dtype)
        v_cache[blocks, :, slots] = v.to(v_cache.dtype)


def read_kv(cache: torch.Tensor, block_table: torch.Tensor, layout: str) -> torch.Tensor:
    """Context of ``block_table`` (int64 [B, nb]) as [B, nb * block_size, num_kv_heads, head_dim]."""
    x = cache[block_table]  # [B, nb, *block_shape]
    if layout == "HND":
        x = x.transpose(2, 3)
    B, nb, bs, H, D = x.shape
    return x.reshape(B, nb * bs, H, D)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention (scale ``1/sqrt(head_dim)``, Vaswani et al. 2017).

    Parameters
    ----------
    q : [B, T, num_heads, head_dim]
    k, v : [B, S, num_kv_heads, head_dim]
    mask : bool [B, T, S]
        True where query t may attend key s (every row needs at least one True).

    Returns
    -------
    torch.Tensor [B, T, num_heads, head_dim]
    """
    group = q.shape[2] // k.shape[2]
    k = k.to(q.dtype).repeat_interleave(group, dim=2)
    v = v.to(q.dtype).repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None])
    return out.transpose(1, 2)


def dense_causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one whole sequence over itself (no cache): the reference for the paged
    path, and the profile run's attention. q [T, num_heads, head_dim], k/v [T, num_kv_heads,
    head_dim] -> [T, num_heads, head_dim]."""
    T = q.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return attend(q[None], k[None], v[None], mask[None])[0]


@torch.no_grad()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] of a full dense forward (no cache, full recompute)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
    h = model(ids, torch.arange(len(token_ids), device=model.device), dense_causal_attention)
    return model.compute_logits(h)
