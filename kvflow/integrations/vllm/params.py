"""The transfer params P returns with a prefill (vLLM's ``kv_transfer_params``: P's address,
request id, block ids, prompt length and hash) and D's check that they describe its own prompt
before it loads anything (docs/tutorials/vllm.md, "Reliability")."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

import numpy as np

_ADDR = re.compile(r"^tcp://[^\s:/]+:\d{1,5}$")
MAX_BLOCK_ID = 2**31


def prompt_hash(token_ids: Sequence[int]) -> str:
    """Hex BLAKE2b-128 of the prompt's token ids (as little-endian int64)."""
    arr = np.asarray(list(token_ids), dtype="<i8")
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


def check_params(params: dict[str, Any], token_ids: Sequence[int], block_size: int) -> str:
    """'' when ``params`` (``kv_transfer_params``) are P's for exactly the prompt ``token_ids`` of
    ``block_size``-token blocks, else a message naming the field and its value."""
    addr = params.get("remote_addr")
    if not isinstance(addr, str) or not _ADDR.match(addr):
        return f"remote_addr must be 'tcp://host:port', got {addr!r}"
    if not isinstance(params.get("remote_request_id"), str):
        return f"remote_request_id must be a string, got {params.get('remote_request_id')!r}"
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < MAX_BLOCK_ID
            for b in ids):
        return f"remote_block_ids must be a list of block ids in [0, 2**31), got {ids!r}"
    n = len(token_ids)
    if params.get("remote_num_tokens") != n:
        return (f"remote_num_tokens is {params.get('remote_num_tokens')!r} but this prompt has "
                f"{n} tokens: the params are another prompt's")
    if params.get("remote_prompt_hash") != prompt_hash(token_ids):
        return (f"remote_prompt_hash {params.get('remote_prompt_hash')!r} is not this prompt's "
                f"{prompt_hash(token_ids)!r}: the params are another prompt's")
    need = -(-n // block_size)
    if len(ids) != need:
        return (f"remote_block_ids holds {len(ids)} block ids; a {n}-token prompt fills "
                f"{need} blocks of {block_size}")
    return ""
