"""Fault injection for the reliability tests; every fault is off unless its environment
variable is set, and costs one dictionary lookup when off.

=================================  ===========================================================
variable                           effect
=================================  ===========================================================
``KVFLOW_FAULT_PREFILL_DELAY_S``   P sleeps this long before a prefill (P is "prefilling")
``KVFLOW_FAULT_CHUNK_DELAY_S``     P sleeps this long inside each prefill chunk (a slow
                                   forward: no heartbeat can go out meanwhile)
``KVFLOW_FAULT_STEP_DELAY_S``      D (or colocated) sleeps this long in each decode step whose
                                   batch holds a matching request (a slow step: the loop
                                   handles no message meanwhile)
``KVFLOW_FAULT_RECEIVE_DELAY_S``   D keeps an arrived transfer in flight (RECEIVING) this long
                                   before copying it (a slow transfer: abort or kill D now)
``KVFLOW_FAULT_WRITE_DELAY_S``     nixl P sleeps this long after posting each WRITE (layer
                                   group) of a request (kill or abort D mid-WRITE now)
``KVFLOW_FAULT_MATCH``             comma-separated token ids: faults apply only to requests
                                   whose prompt contains this run of ids (unset: to every one)
``KVFLOW_FAULT_RECEIVE_FAIL``      comma-separated token ids: D fails the arrived transfer of
                                   requests whose prompt contains this run (after P's first
                                   token went out), as a broken copy would
``KVFLOW_FAULT_WRITE_FAIL``        comma-separated token ids: nixl P posts the first WRITE (layer
                                   group) of requests whose prompt contains this run, drops
                                   the rest and reports the request's WRITEs failed after its
                                   first token went out (D's blocks: partly written)
``KVFLOW_FAULT_KV_CORRUPT``        comma-separated token ids: with ``--kv-verify``, P flips one
                                   byte of the last block it sends of requests whose prompt
                                   contains this run, after taking its digest (tcp: in the
                                   staging buffer on the wire; ipc-pull: in P's exported cache
                                   that D reads), as a corruption in flight would
``KVFLOW_DEBUG_KV_DIGEST``         (a diagnostic, not a fault) D and colocated add
                                   ``kv_digest`` to the ``kvflow`` object: a digest of the
                                   prompt's full blocks, equal across modes iff their bytes are
                                   (it syncs the device: timings are off while it is set)
=================================  ===========================================================
"""

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
    """Seconds of injected delay for fault ``kind`` ("prefill", "chunk", "step", "receive" or
    "write") of a request with prompt ``token_ids``; 0.0 when the fault is off or the prompt
    does not match."""
    value = os.environ.get(_VARS[kind], "")
    if not value:
        return 0.0
    match = os.environ.get("KVFLOW_FAULT_MATCH", "")
    if match and not _contains(token_ids, [int(x) for x in match.split(",")]):
        return 0.0
    return float(value)


def fails(kind: str, token_ids: Sequence[int]) -> bool:
    """Whether fault ``kind`` ("receive": ``KVFLOW_FAULT_RECEIVE_FAIL``, "corrupt":
    ``KVFLOW_FAULT_KV_CORRUPT``, "write": ``KVFLOW_FAULT_WRITE_FAIL``) fails the request
    with prompt ``token_ids``: its variable names a run of token ids the prompt contains."""
    value = os.environ.get({"receive": "KVFLOW_FAULT_RECEIVE_FAIL",
                            "corrupt": "KVFLOW_FAULT_KV_CORRUPT",
                            "write": "KVFLOW_FAULT_WRITE_FAIL"}[kind], "")
    return bool(value) and _contains(token_ids, [int(x) for x in value.split(",")])


def kv_digest(cache, block_ids: Sequence[int], num_tokens: int) -> list[int] | None:
    """``KVFLOW_DEBUG_KV_DIGEST=1``: ``[sum of words, position-weighted sum]`` (mod 2**61) of the int32 words
    of the prompt's full blocks (``num_tokens // block_size`` of ``block_ids``) over every
    tensor of ``cache``, in table order; None when the variable is unset."""
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


def flip_byte(block) -> None:
    """``KVFLOW_FAULT_KV_CORRUPT``: flip every bit of the last byte of ``block`` (a contiguous
    tensor holding one block's bytes) in place."""
    import torch
    raw = block.reshape(-1).view(torch.uint8)
    raw[-1] ^= 0xFF
