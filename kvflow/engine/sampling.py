"""Token sampling from a logits vector."""

from __future__ import annotations

import math

import torch


#: temperatures below this sample greedily, as vLLM's ``_SAMPLING_EPS`` (vllm/v1/sample/sampler.py):
#: ``logits / 1e-39`` would overflow float32 to inf and softmax would give NaN
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None = None) -> int:
    """Pick the next token id.

    Parameters
    ----------
    logits : torch.Tensor [vocab]
        Unnormalised scores (any float dtype).
    temperature : float
        0 (or below :data:`GREEDY_BELOW`) = greedy: ``argmax``, the lowest id among equal
        maxima (deterministic ties); else a draw from ``softmax(logits / temperature)``
        (float32) using ``generator``.
    generator : torch.Generator, optional
        Source of randomness on ``logits``' device (seed it for reproducible draws).

    Raises
    ------
    ValueError
        ``logits`` not 1-D / empty, or ``temperature`` negative or not finite.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty 1-D tensor [vocab], got shape "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))  # torch returns the first maximal index
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
