"""Timers for memory-bound ops: warm-up, many repetitions, cold caches.

CPU: ``time.perf_counter`` around each call. CUDA: events around each call on the current
stream. Cold L2/LLC: callers rotate among ``rotations`` input sets whose total size exceeds the
last-level cache (60 MB L2 on an H200), so each timed call reads memory, not cache
(see ../DESIGN.md "Measuring").
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def time_calls(fns: list[Callable[[], object]], *, device: str | torch.device = "cpu",
               warmup: int = 3, reps: int = 20) -> list[float]:
    """Run ``fns[i % len(fns)]`` for ``warmup`` then ``reps`` calls; return each timed call's
    seconds. Pass several closures over different buffers to rotate them (cold cache)."""
    dev = torch.device(device)
    for i in range(warmup):
        fns[i % len(fns)]()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fns[i % len(fns)]()
            ends[i].record()
        torch.cuda.synchronize(dev)
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def copy_ceiling(nbytes: int, *, device: str | torch.device = "cpu", rotations: int = 1,
                 warmup: int = 3, reps: int = 20) -> list[float]:
    """Times of ``dst.copy_(src)`` of ``nbytes`` contiguous bytes on ``device`` (the same-run
    ceiling every ratio is taken against), rotating ``rotations`` buffer pairs."""
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1),
              torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2))
             for _ in range(rotations)]
    fns = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    return time_calls(fns, device=device, warmup=warmup, reps=reps)
