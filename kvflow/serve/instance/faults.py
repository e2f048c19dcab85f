"""Fault injection for the reliability tests: each fault is off unless its environment variable
is set; the variables are listed in docs/reliability.md, "Fault injection (tests only)"."""

from __future__ import annotations

import os
from typing import Sequence

_VARS = {"prefill": "KVFLOW_FAULT_PREFILL_DELAY_S", "receive": "KVFLOW_FAULT_RECEIVE_DELAY_S",
         "chunk": "KVFLOW_FAULT_CHUNK_DELAY_S", "write": "KVFLOW_FAULT_WRITE_DELAY_S",
         "step": "KVFLOW_FAULT_STEP_DELAY_S"}


def _contains(ids: Sequence[int], run: list[int]) -> bool:
    n = len(run)
    return any(list(ids[i:i + n]) == run for i in range(len(ids) - n + 1))


def delay_s(kind: str, token_ids: Sequence[int]) -> float:
    """Seconds of injected delay for fault ``kind`` (a key of ``_VARS``) of a request with
    prompt ``token_ids``; 0.0 when off or the prompt does not match."""
    value = os.environ.get(_VARS[kind], "")
    if not value:
        return 0.0
    match = os.environ.get("KVFLOW_FAULT_MATCH", "")
    if match and not _contains(token_ids, [int(x) for x in match.split(",")]):
        return 0.0
    return float(value)


def fails(kind: str, token_ids: Sequence[int]) -> bool:
    """Whether fault ``kind`` ("receive", "corrupt", "write") fails the request with prompt
    ``token_ids`` (its variable names a run of ids the prompt contains)."""
    value = os.environ.get({"receive": "KVFLOW_FAULT_RECEIVE_FAIL",
                            "corrupt": "KVFLOW_FAULT_KV_CORRUPT",
                            "write": "KVFLOW_FAULT_WRITE_FAIL"}[kind], "")
    return bool(value) and _contains(token_ids, [int(x) for x in value.split(",")])


def kv_digest(cache, block_ids: Sequence[int], num_tokens: int) -> list[int] | None:
    """``KVFLOW_DEBUG_KV_DIGEST=1``: ``[sum, position-weighted sum]`` (mod 2**61) of the int32
    words of the prompt's full blocks over every tensor of ``cache``; else None."""
    if not os.environ.get("KVFLOW_DEBUG_KV_DIGEST"):
        return None
    import torch
    full = list(block_ids[:num_tokens // cache.spec.block_size])
    if not full:
        return [0, 0]
    ids = torch.tensor(full, device=cache.device)
    total = weighted = 0
    for t in cache.tensors():
        w = t[ids].reshape(-1).view(torch.int32).to(torch.int64)
        pos = torch.arange(w.numel(), device=w.device) % 65521 + 1
        total += int(w.sum())
        weighted += int((w * pos).sum())
    return [total % 2**61, weighted % 2**61]  # fits msgpack's int64


def add_kv_digest(kvflow: dict, cache, req) -> None:
    """``kvflow["kv_digest"]``: :func:`kv_digest` of ``req``'s prompt blocks, when it is on."""
    if (digest := kv_digest(cache, req.block_table, len(req.prompt_token_ids))) is not None:
        kvflow["kv_digest"] = digest


def flip_byte(block) -> None:
    """``KVFLOW_FAULT_KV_CORRUPT``: flip the last byte of ``block`` (a contiguous tensor)."""
    import torch
    raw = block.reshape(-1).view(torch.uint8)
    raw[-1] ^= 0xFF
