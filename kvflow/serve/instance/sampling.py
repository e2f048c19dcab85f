"""Token sampling and stop rules shared by P (the first token) and D (the rest)."""

from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float, seed: int, index: int) -> int:
    """Sample generated token ``index`` from float32 ``logits`` [vocab_size]: greedy at temperature
    0, else drawn with a generator seeded by ``(seed, index)``, so that P and D draw exactly what
    one colocated instance would."""
    from kvflow.engine import sample
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=logits.device).manual_seed((seed * 1_000_003 + index) % 2**63)
    return sample(logits, temperature, gen)


def stop_reason(token: int, num_generated: int, max_tokens: int, num_tokens: int,
                max_model_len: int, eos: int | None, ignore_eos: bool) -> str:
    """Why generation stops after ``token`` ("stop", "length"), or "" to go on.
    ``num_tokens`` counts prompt + generated tokens."""
    if not ignore_eos and eos is not None and token == eos:
        return "stop"
    if num_generated >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return ""
