"""CUDA graphs of kvflow ops: capture a fixed-shape call once, replay it for a few microseconds.

A replay skips every host step of a call (argument checks, plan lookup, Triton's launcher):
issue #16 measured 9 us of host time per replayed gather against 57 us per call at the time.
What a graph fixes at capture: the caches, the staging buffer, the ids *tensors* (their
addresses and lengths) and the layer range. To move other blocks, write the new ids into the
same tensors (``ids.copy_(new)``) and replay.

>>> ids = torch.full((16,), -1, dtype=torch.int32, device="cuda")   # -1: padding
>>> out = kvflow.staging_buffer(cache.spec, 16, device="cuda")
>>> g = capture(lambda: gather_blocks(cache, ids, out))
>>> ids[:3] = torch.tensor([7, 2, 9]); g.replay()   # out[:, :, :3] = blocks 7, 2, 9

Checks in a graph: ids out of range are still found by the kernel and reported by
:func:`kvflow.kernels.check_errors` (or the next direct call); the repeat check of destination
ids is left out (its per-call stamp would be frozen into the graph), so a replay that names a
destination block twice is not reported.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

_WARMING = [0]  # > 0 while capture() warms up: calls take the graph's plans (no repeat check)


def no_repeat_check() -> bool:
    """True while a call is captured (or warmed up for capture): see the module docstring."""
    return _WARMING[0] > 0 or torch._C._cuda_isCurrentStreamCapturing()


@contextlib.contextmanager
def _warming():
    _WARMING[0] += 1
    try:
        yield
    finally:
        _WARMING[0] -= 1


def capture(fn: Callable[[], Any], *, warmup: int = 2, pool: Any = None) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` (kvflow op calls on CUDA tensors) into a CUDA graph and return it.

    ``fn`` runs ``warmup`` times on a side stream first (its copies happen: write ids that
    are safe to move, or -1 padding), so that kernels are compiled and launch plans exist
    before capture.

    Parameters
    ----------
    fn : callable
        Calls of :func:`gather_blocks`, :func:`scatter_blocks`, :func:`copy_blocks` with fixed
        tensors (see the module docstring).
    warmup : int
        Runs before capture (>= 1).
    pool : optional
        A graph memory pool handle (``torch.cuda.graph_pool_handle()``) to share.

    Returns
    -------
    torch.cuda.CUDAGraph
        ``.replay()`` enqueues the captured copies on the current stream.

    Raises
    ------
    RuntimeError
        No CUDA device.
    ValueError
        ``warmup`` below 1.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs a CUDA device (CUDA graphs)")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with _warming(), torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph
