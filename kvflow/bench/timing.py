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
    seconds. Pass several closures over different buffers to rotate them (cold cache).

    On CUDA the timed calls are enqueued behind a ~20 ms ``torch.cuda._sleep`` so the device
    queue is full while the host issues them: each start..end event pair then brackets the
    device work of one call, not the host's launch overhead between calls (METHOD.md: time
    device work with events, many small launches back to back). Host launch overhead is real
    but in serving it overlaps the prefill; it is not the kernel's bandwidth.
    """
    dev = torch.device(device)
    for i in range(warmup):
        fns[i % len(fns)]()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        queue_ahead(dev)
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


def queue_ahead(device: torch.device, ms: float = 20.0) -> None:
    """Keep ``device`` busy for about ``ms`` milliseconds (a spin kernel) so that work the host
    enqueues next starts back to back on the device."""
    with torch.cuda.device(device):
        rate = torch.cuda.get_device_properties(device).clock_rate if hasattr(
            torch.cuda.get_device_properties(device), "clock_rate") else 2_000_000  # kHz
        torch.cuda._sleep(int(ms * rate))


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


def last_level_cache_bytes(device: str | torch.device = "cpu") -> int:
    """Size of the cache a cold-cache benchmark must defeat: the GPU's L2
    (``torch.cuda.get_device_properties(...).L2_cache_size``; 60 MB on an H200) or the CPU's
    highest cache level from ``/sys/devices/system/cpu/cpu0/cache`` (32 MiB if unreadable)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).L2_cache_size)
    from pathlib import Path
    best_level, best = -1, 32 << 20
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((d / "level").read_text())
            size = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        num = int(size.rstrip("KMG")) * mult
        if level > best_level:
            best_level, best = level, num
    return best


def rotations_for(payload_bytes: int, llc_bytes: int, *, max_rotations: int = 8) -> int:
    """Buffer sets to rotate so that their total exceeds twice the last-level cache
    (at least 1, at most ``max_rotations``)."""
    need = -(-2 * llc_bytes // max(1, payload_bytes))
    return max(1, min(max_rotations, need))
