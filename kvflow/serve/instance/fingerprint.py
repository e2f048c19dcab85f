"""Model fingerprint: what P and D must agree on beyond the KV cache spec before they pair
(docs/reliability.md, "Failure kinds and policies", item 3)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Any

import msgspec
import torch

SHOWN_HEX = 12  # hex characters of the weights digest shown in a mismatch error


def _param_digest(name: str, p: torch.Tensor) -> bytes:
    t = p.detach().contiguous().reshape(-1)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{t.dtype}|{tuple(p.shape)}".encode())
    h.update(t.cpu().view(torch.uint8).numpy())
    return h.digest()


def weights_digest(model: torch.nn.Module, *, workers: int | None = None) -> str:
    """blake2b digest (32 hex characters) of every parameter of ``model`` (name, dtype, shape,
    bytes), hashed in ``workers`` threads (default: this process's CPUs, at most 16)."""
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    n = workers or min(16, len(os.sched_getaffinity(0)))
    with concurrent.futures.ThreadPoolExecutor(max(1, n)) as pool:
        digests = list(pool.map(lambda kv: _param_digest(*kv), params))
    h = hashlib.blake2b(digest_size=16)
    for d in digests:
        h.update(d)
    return h.hexdigest()


def model_fingerprint(model: Any, max_model_len: int) -> dict[str, Any]:
    """``model``'s fingerprint: its ``ModelConfig`` but ``name``, its dtype, ``max_model_len`` and
    ``weights`` (:func:`weights_digest`), as the peer sees it after msgpack."""
    fp = {k: v for k, v in dataclasses.asdict(model.config).items() if k != "name"}
    fp["dtype"] = str(model.dtype).removeprefix("torch.")
    fp["max_model_len"] = int(max_model_len)
    fp["weights"] = weights_digest(model)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(fp, enc_hook=str))


def _shown(key: str, value: Any) -> str:
    if key == "weights" and isinstance(value, str) and len(value) > SHOWN_HEX:
        return value[:SHOWN_HEX] + "…"
    return str(value)


def check_fingerprint(mine: dict[str, Any], my_id: str, peer: dict[str, Any], peer_id: str) -> str:
    """The refusal naming every field of the peer's fingerprint that differs from ours, with both
    values (``max_model_len: 256 (p-1) vs 128 (d-2)``), or of none sent; '' when equal."""
    if not peer:
        return (f"model fingerprint missing, pairing refused: {peer_id} sent none (a kvflow "
                f"older than this {my_id}?)")
    diffs = [f"{k}: {_shown(k, mine.get(k))} ({my_id}) vs {_shown(k, peer.get(k))} ({peer_id})"
             for k in list(mine) + [k for k in peer if k not in mine] if mine.get(k) != peer.get(k)]
    return "model fingerprint mismatch, pairing refused: " + "; ".join(diffs) if diffs else ""
