"""The one timer of every study: warm-up, many repetitions, cold caches, same-run ceilings.

CPU: ``time.perf_counter`` around each call. One CUDA device: events around each call on the
current stream, enqueued behind a short spin kernel so each event pair brackets device work,
not the host's launch gaps. Several CUDA devices (a P->D copy between two GPUs): the start event
is on the last device's stream, every other stream waits for it, and the last stream waits for
every other before the end event, so work on any of the GPUs is inside the interval.

Two figures per op (docs/design.md, "Measuring"): **device time** (:func:`time_calls`: per-call
events with the device queue filled first, so only the kernels are timed) and **as called**
(:func:`time_as_called`: batches of back-to-back calls from Python, one event pair and one sync
per batch, so wrapper work and any host synchronisation inside a call count, as for a caller).

Cold L2/LLC: callers rotate among input sets whose total size exceeds twice the last-level cache
(:func:`rotations_for`; 60 MB L2 on an H200), so each timed call reads memory, not cache
(docs/design.md, "Measuring").
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence


def time_calls(fns: Sequence[Callable[[], object]], *, device: str | torch.device = "cpu",
               warmup: int = 3, reps: int = 20,
               devices: Sequence[str | torch.device] | None = None) -> list[float]:
    """Seconds of each of ``reps`` timed calls of ``fns[i % len(fns)]`` after ``warmup`` calls.

    Pass several closures over different buffers to rotate them (cold cache). ``devices`` (two
    or more CUDA devices) times work spread over their current streams; otherwise ``device``.
    Host launch overhead is real but in serving it overlaps the prefill; it is not the copy's
    bandwidth, so on one CUDA device the calls are queued behind ~20 ms of spin first.
    """
    import torch
    devs = [torch.device(d) for d in (devices or [device])]
    for i in range(warmup):
        fns[i % len(fns)]()
    if devs[0].type != "cuda":
        out = []
        for i in range(reps):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            out.append(time.perf_counter() - t0)
        return out
    main = devs[-1]
    for d in devs:
        torch.cuda.synchronize(d)
    if len(devs) == 1:
        queue_ahead(main)
    marks = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(torch.cuda.current_stream(main))
        for d in devs[:-1]:
            _join(main, d)
        fns[i % len(fns)]()
        for d in devs[:-1]:
            _join(d, main)
        e.record(torch.cuda.current_stream(main))
        marks.append((s, e))
    for d in devs:
        torch.cuda.synchronize(d)
    return [s.elapsed_time(e) / 1e3 for s, e in marks]


#: Target length of one as-called batch (seconds): long enough that the first call's launch
#: latency, paid once per batch, is about 1% of the batch at 1K Llama-3-8B tokens on an H200
#: (a 128 MiB gather of ~70 us: 29 calls).
AS_CALLED_BATCH_S = 10e-3  # the first call's host latency (~20 us) is <= 0.2% of a batch


def calls_per_batch(device_time_s: float, *, target_s: float = AS_CALLED_BATCH_S,
                    cap: int = 1000) -> int:
    """Calls in one as-called batch: enough that the batch lasts about ``target_s`` seconds at
    ``device_time_s`` per call (at least 1, at most ``cap``)."""
    if device_time_s <= 0:
        return cap
    return max(1, min(cap, math.ceil(target_s / device_time_s)))


def time_as_called(fns: Sequence[Callable[[], object]], *, device: str | torch.device = "cpu",
                   calls: int = 1, batches: int = 5, warmup: int = 3) -> list[float]:
    """Seconds per call of each of ``batches`` batches of ``calls`` back-to-back calls of
    ``fns[i % len(fns)]`` (the rotation continues across batches), after ``warmup`` calls.

    Nothing waits inside a batch: the device is synchronised before it, then (CUDA) an event is
    recorded, the calls are issued, an event is recorded and the device synchronised; the batch's
    time is the events' interval divided by ``calls``. Host work between launches, and any sync a
    call does itself, is in the interval whenever it leaves the device idle. On a CPU the batch
    is timed with ``time.perf_counter``. This is ``triton.testing.do_bench`` without its L2
    flush between calls (the caller's rotation of buffers larger than L2 keeps caches cold).
    """
    import torch
    dev = torch.device(device)
    k = len(fns)
    for i in range(warmup):
        fns[i % k]()
    out, j = [], 0
    for _ in range(batches):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(torch.cuda.current_stream(dev))
            for _ in range(calls):
                fns[j % k]()
                j += 1
            e.record(torch.cuda.current_stream(dev))
            torch.cuda.synchronize(dev)
            out.append(s.elapsed_time(e) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[j % k]()
                j += 1
            out.append((time.perf_counter() - t0) / calls)
    return out


def time_on_stream(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls from events on the current CUDA stream only: unlike
    :func:`time_calls` nothing synchronises the device first, so work running on other streams
    (the contention study's background copies) keeps running during the timed window."""
    import torch
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def _join(src: torch.device, dst: torch.device) -> None:
    """Make ``dst``'s current stream wait for the work enqueued so far on ``src``'s."""
    import torch
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(src))
    torch.cuda.current_stream(dst).wait_event(ev)


def queue_ahead(device: torch.device, ms: float = 20.0) -> None:
    """Keep ``device`` busy for about ``ms`` milliseconds (a spin kernel) so that work the host
    enqueues next starts back to back on the device."""
    import torch
    with torch.cuda.device(device):
        props = torch.cuda.get_device_properties(device)
        rate = getattr(props, "clock_rate", 2_000_000)  # kHz
        torch.cuda._sleep(int(ms * rate))


def median(xs: Sequence[float]) -> float:
    """Upper median of ``xs`` (the value a timing table reports)."""
    s = sorted(xs)
    return s[len(s) // 2]


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def copy_ceiling(nbytes: int, *, device: str | torch.device = "cpu",
                 dst_device: str | torch.device | None = None, rotations: int = 1,
                 warmup: int = 3, reps: int = 20) -> list[float]:
    """Seconds of ``dst.copy_(src)`` of ``nbytes`` contiguous bytes: the same-run ceiling every
    ratio is taken against. ``dst_device`` (another GPU) gives the peer-copy ceiling."""
    import torch
    dst_device = dst_device or device
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1),
              torch.empty(nbytes, dtype=torch.uint8, device=dst_device).fill_(2))
             for _ in range(rotations)]
    fns = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    devices = None if torch.device(dst_device) == torch.device(device) else [device, dst_device]
    return time_calls(fns, device=device, devices=devices, warmup=warmup, reps=reps)


def last_level_cache_bytes(device: str | torch.device = "cpu") -> int:
    """Size of the cache a cold-cache benchmark must defeat: the GPU's L2
    (``torch.cuda.get_device_properties(...).L2_cache_size``; 60 MB on an H200) or the CPU's
    highest cache level from ``/sys/devices/system/cpu/cpu0/cache`` (32 MiB if unreadable)."""
    import torch
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
