"""A trivial Triton kernel (one program adds 1 to at most 128 floats): the reference cost of a
bare Triton launch from Python in :mod:`kvflow.bench.calls`. Imports Triton; import it only when
a CUDA device is there."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def bare_launch(x):
    """A closure that launches :func:`_add_one` on ``x`` (float32, at most :data:`BLOCK`
    elements, on a CUDA device) over a grid of one program: the call a caller pays for the
    launch alone (the grid tuple and argument binding included)."""
    if x.numel() > BLOCK:
        raise ValueError(f"x has {x.numel()} elements; one program covers {BLOCK}")
    n = x.numel()
    return lambda: _add_one[(1,)](x, n, BLOCK=BLOCK)
