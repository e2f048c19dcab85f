"""A request's KV between a P and a D whose cache specs differ (block_size, NHD/HND, dtype), for
the kinds that re-block (``ipc-pull``, ``tcp``, ``ipc-push``): the whole prompt moves after the
prefill, token ``t`` from P's block ``src[t // bs_P]`` to D's ``dst[t // bs_D]``; D's prefix hit
becomes id -1 in D's table (written nowhere). See docs/layouts.md, "Re-blocking: P and D of
different specs".
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.kernels import copy_sequence

from .base import TransferError


def tables(src_ids: Any, src_spec: Any, dst_ids: Any, dst_spec: Any, num_tokens: int,
           req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P's table, D's table)`` of a ``num_tokens``-token prompt, int64 CPU tensors: P's
    ``src_ids`` as sent, D's ``dst_ids`` (past its prefix hit) after one -1 per hit block.
    TransferError: ``src_ids`` does not cover the prompt, or ``dst_ids`` has more blocks than it
    needs."""
    need_s = -(-num_tokens // src_spec.block_size)
    need_d = -(-num_tokens // dst_spec.block_size)
    if len(src_ids) != need_s:
        raise TransferError(f"{req_id}: P sent {len(src_ids)} blocks of {src_spec.block_size} "
                            f"tokens for a prompt of {num_tokens} tokens; expected {need_s}")
    if len(dst_ids) > need_d:
        raise TransferError(f"{req_id}: D allocated {len(dst_ids)} blocks of "
                            f"{dst_spec.block_size} tokens for a prompt of {num_tokens} "
                            f"tokens; at most {need_d} are needed")
    dst = [-1] * (need_d - len(dst_ids)) + [int(b) for b in dst_ids]
    return (torch.as_tensor([int(b) for b in src_ids], dtype=torch.int64),
            torch.as_tensor(dst, dtype=torch.int64))


def push_prompt(src_cache: PagedKVCache, dst_cache: PagedKVCache, src_ids: Any, dst_ids: Any,
                num_cached_blocks: int, num_tokens: int, req_id: str, backend: str) -> int:
    """ipc-push between different specs: write a ``num_tokens``-token prompt from P's ``src_cache``
    (table ``src_ids``) into D's ``dst_cache`` mapped on P's GPU (table ``dst_ids``, its first
    ``num_cached_blocks`` untouched) with one ``copy_sequence``, and wait. Returns D's blocks
    written; TransferError for a table short of the prompt or ``num_cached_blocks`` past it."""
    need_s = src_cache.spec.num_blocks_for(num_tokens)
    need_d = dst_cache.spec.num_blocks_for(num_tokens)
    if len(src_ids) < need_s or len(dst_ids) < need_d or not 0 <= num_cached_blocks <= need_d:
        raise TransferError(f"{req_id}: P's table has {len(src_ids)} blocks of "
                            f"{src_cache.spec.block_size} tokens and decode_block_ids "
                            f"{len(dst_ids)} of {dst_cache.spec.block_size} "
                            f"({num_cached_blocks} cached); the {num_tokens}-token prompt needs "
                            f"{need_s} and {need_d}")
    src, dst = tables(list(src_ids[:need_s]), src_cache.spec,
                      list(dst_ids[num_cached_blocks:need_d]), dst_cache.spec, num_tokens, req_id)
    copy_sequence(src_cache, dst_cache, src, dst, num_tokens=num_tokens, backend=backend)
    if dst_cache.device.type == "cuda":  # D may read its blocks once KVPushed arrives
        torch.cuda.current_stream(dst_cache.device).synchronize()
    return need_d - num_cached_blocks


def warm(src_spec: Any, dst_spec: Any, device: Any, backend: str) -> None:
    """Compile the re-blocked copy from ``src_spec`` to ``dst_spec`` on ``device``."""
    a, b = PagedKVCache(src_spec, 1, device=device), PagedKVCache(dst_spec, 1, device=device)
    copy_sequence(a, b, [0], [0], num_tokens=1, backend=backend)
