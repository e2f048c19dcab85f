"""CPU load for the tests whose rule must hold on a busy host (heartbeats, stop deadlines).

:func:`cpu_hogs` starts ``n`` busy-looping processes (pure Python arithmetic, no I/O) for the
length of a ``with`` block and stops them when it ends; each hog also ends by itself after
``max_s`` seconds, so a test that dies (or a killed pytest) never leaves load behind. With
``n = 10`` on the 2-core CI machine the load average climbs to ~10-12 within a minute
(:func:`load_average` reads it; :func:`runnable` the load of the moment): what the liveness and stop rules of docs/reliability.md are
tested at.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

#: the hog: spin until ``max_s`` has passed (its own bound), then exit 0
_HOG = ("import sys, time\n"
        "end = time.monotonic() + float(sys.argv[1])\n"
        "x = 0\n"
        "while time.monotonic() < end:\n"
        "    for i in range(20000):\n"
        "        x = (x * 31 + i) & 0xFFFFFFFF\n")


def load_average() -> float:
    """The 1-minute load average of this host (``os.getloadavg``)."""
    return os.getloadavg()[0]


def runnable() -> int:
    """Processes running or ready to run on this host now (``/proc/loadavg``'s fourth field:
    the load at this instant, which the 1-minute average reaches only after a minute)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


@contextlib.contextmanager
def cpu_hogs(n: int = 10, max_s: float = 600.0) -> Iterator[list[subprocess.Popen]]:
    """Run ``n`` CPU-bound processes while the block runs (each ends by itself after ``max_s``
    seconds at the latest); on exit every hog is killed and reaped.

    Raises
    ------
    ValueError
        ``n`` < 1 or ``max_s`` <= 0.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_s <= 0:
        raise ValueError(f"max_s must be > 0, got {max_s}")
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(max_s)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
