"""A request's KV between a P and a D whose cache specs differ (block_size, NHD/HND, dtype):
what the ``ipc-pull`` and ``tcp`` connectors do then (pairing allows it only for them,
:mod:`kvflow.serve.pairing`).

P sends its whole block table of the prompt (never layer by layer); D maps token ``t`` of the
prompt from P's block ``src[t // bs_P]`` to its own block ``dst[t // bs_D]`` with the
re-blocking kernels (:mod:`kvflow.kernels.reblock`), ``num_tokens`` = the prompt's length. D's
prefix hit (its first blocks, which it already holds) becomes id -1 in D's table: those tokens
are read from nothing and written nowhere.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import TransferError


def differs(a: Any, b: Any) -> bool:
    """The two :class:`~kvflow.layout.KVCacheSpec` differ (the transfer re-blocks)."""
    return a != b


def tables(src_ids: Any, src_spec: Any, dst_ids: Any, dst_spec: Any, num_tokens: int,
           req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P's table, D's table)`` of a ``num_tokens``-token prompt, two int64 CPU tensors: P's
    ``src_ids`` as sent (all ``ceil(num_tokens / bs_P)`` blocks) and D's ``dst_ids`` (its
    blocks past the prefix hit) preceded by one -1 per block of the hit.

    Raises
    ------
    TransferError
        ``src_ids`` does not cover the prompt, or ``dst_ids`` holds more blocks than it needs.
    """
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
