"""Model fingerprint: what P and D must agree on beyond the KV cache spec before they pair.

Two instances with equal KV cache specs can still compute different KV: other weights of the
same shapes (``--model A`` on P, ``--model B`` on D gave HTTP 200 with mixed tokens), another
RoPE base, another dtype of the weights. Each instance computes a fingerprint once at start-up
(:func:`model_fingerprint`), sends it in :class:`~kvflow.protocol.Register`; the router hands
it to the peer in :class:`~kvflow.protocol.Pair`, and :func:`check_fingerprint` refuses the
pairing naming every differing field with both sides' values, e.g. ``model fingerprint
mismatch, pairing refused: weights: 3f2a9c01d4e7… (p-1) vs 91c05b2e8f13… (d-2)``.

Fields: every :class:`~kvflow.model.ModelConfig` field but ``name`` (a path or preset name
says nothing about the math), the weights' ``dtype``, ``max_model_len`` and ``weights``, a
digest of the parameters. Block size, layout and KV dtype are compared with the KV cache spec
(:func:`kvflow.serve.instance.pairing.check_pairing`).

Weights digest: blake2b (16-byte digest) of each parameter's name, dtype, shape and bytes,
parameters hashed in parallel threads (hashlib and the host copy release the GIL), then one
blake2b over the per-parameter digests in name order. Cost measured on 2 shared CPU cores
(2026-12-01): kvflow-tiny (9 MiB, float32) 10-15 ms; kvflow-llama-32l (641 MiB, bfloat16)
0.5 s with 2 threads (0.9 s with one), against 9.6 s to build that model: about 0.7 GiB/s
per core. A GPU model is copied to the host parameter by parameter (one at a time per
thread, so host memory stays small).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Any

import msgspec
import torch

#: Hex characters of the weights digest shown in a mismatch error.
SHOWN_HEX = 12


def _param_digest(name: str, p: torch.Tensor) -> bytes:
    t = p.detach().contiguous().reshape(-1)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{t.dtype}|{tuple(p.shape)}".encode())
    h.update(t.cpu().view(torch.uint8).numpy())
    return h.digest()


def weights_digest(model: torch.nn.Module, *, workers: int | None = None) -> str:
    """Digest of every parameter of ``model`` (name, dtype, shape, bytes): 32 hex characters.

    Parameters
    ----------
    model : torch.nn.Module
        Any device; parameters are read, never changed.
    workers : int or None
        Hashing threads (default: CPUs available to this process, at most 16).
    """
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    n = workers or min(16, len(os.sched_getaffinity(0)))
    with concurrent.futures.ThreadPoolExecutor(max(1, n)) as pool:
        digests = list(pool.map(lambda kv: _param_digest(*kv), params))
    h = hashlib.blake2b(digest_size=16)
    for d in digests:
        h.update(d)
    return h.hexdigest()


def model_fingerprint(model: Any, max_model_len: int) -> dict[str, Any]:
    """The fingerprint of a loaded model as served (a msgpack-able dict).

    Parameters
    ----------
    model : kvflow.model.LlamaForCausalLM
        With ``config`` (:class:`~kvflow.model.ModelConfig`) and ``dtype``.
    max_model_len : int
        The instance's limit (tokens).

    Returns
    -------
    dict
        ``ModelConfig`` fields except ``name``, then ``dtype`` (e.g. ``"bfloat16"``),
        ``max_model_len`` and ``weights`` (:func:`weights_digest`).
    """
    fp = {k: v for k, v in dataclasses.asdict(model.config).items() if k != "name"}
    fp["dtype"] = str(model.dtype).removeprefix("torch.")
    fp["max_model_len"] = int(max_model_len)
    fp["weights"] = weights_digest(model)
    # as the peer will see it after the wire (tuples become lists, odd values strings)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(fp, enc_hook=str))


def _shown(key: str, value: Any) -> str:
    if key == "weights" and isinstance(value, str) and len(value) > SHOWN_HEX:
        return value[:SHOWN_HEX] + "…"
    return str(value)


def check_fingerprint(mine: dict[str, Any], my_id: str, peer: dict[str, Any], peer_id: str) -> str:
    """'' when the peer's model fingerprint equals ours, else an error naming every differing
    field with both values (``max_model_len: 256 (p-1) vs 128 (d-2)``; the weights digest
    cut to :data:`SHOWN_HEX` characters). A peer that sent none is refused too."""
    if not peer:
        return (f"model fingerprint missing, pairing refused: {peer_id} sent none (a kvflow "
                f"older than this {my_id}?)")
    diffs = [f"{k}: {_shown(k, mine.get(k))} ({my_id}) vs {_shown(k, peer.get(k))} ({peer_id})"
             for k in list(mine) + [k for k in peer if k not in mine] if mine.get(k) != peer.get(k)]
    return "model fingerprint mismatch, pairing refused: " + "; ".join(diffs) if diffs else ""
