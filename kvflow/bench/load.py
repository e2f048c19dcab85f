"""The host's load over a measurement, recorded in every result file (issue 29).

A starved run (a new user's: torch printed at 0.00 GB/s, a 915x speed-up) looks like any other
row unless the file says the host was busy. :func:`start` snapshots the 1-minute load average
(:func:`os.getloadavg`), the number of CPUs (:func:`os.cpu_count`), wall time
(:func:`time.perf_counter`) and this process's CPU time (:func:`os.times`: user + system, of the
process and its waited-for children); :func:`finish` takes the same at the end and returns the
``env["load"]`` record::

    {"loadavg_1m_start": 0.1, "loadavg_1m_end": 0.2, "cpus": 2, "wall_s": 12.0,
     "cpu_s": 11.8, "cpu_per_wall": 0.98, "busy": false, "busy_reason": null}

The busy rule (:func:`busy_reason`): the host is busy when the 1-minute load average per CPU,
at the start or at the end, is above :func:`threshold` (default 1.0: more runnable tasks than
CPUs, so the measuring thread waits for a CPU; the definition of the Linux load average,
``proc(5)``, counts runnable and uninterruptible tasks). CPU time against wall time is recorded
but not used by the rule: a GPU study or a served study (its servers are other processes)
waits by design, so a low ratio does not by itself mean starvation.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: 1-minute load average per CPU above which a measurement is flagged busy (default of
#: ``KVFLOW_BUSY_LOAD_PER_CPU``, which a shared host whose usual load is higher may raise).
BUSY_LOAD_PER_CPU = 1.0


def threshold() -> float:
    """The busy threshold in force: ``KVFLOW_BUSY_LOAD_PER_CPU`` or :data:`BUSY_LOAD_PER_CPU`.

    Raises
    ------
    ValueError
        The variable is set to something other than a positive number.
    """
    raw = os.environ.get("KVFLOW_BUSY_LOAD_PER_CPU", "").strip()
    if not raw:
        return BUSY_LOAD_PER_CPU
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"KVFLOW_BUSY_LOAD_PER_CPU must be a positive number, got {raw!r}")
    return value

_START: dict[str, float] | None = None


def _snapshot() -> dict[str, float]:
    t = os.times()
    return {"loadavg": os.getloadavg()[0], "wall": time.perf_counter(),
            "cpu": t.user + t.system + t.children_user + t.children_system}


def start() -> None:
    """Mark the start of the measurement (a second call starts it again)."""
    global _START
    _START = _snapshot()


def busy_reason(load_start: float, load_end: float, cpus: int) -> str | None:
    """Why the host counts as busy (see the module doc), or None when it does not.

    >>> busy_reason(3.1, 2.0, 2)
    'load average 3.10 per 2 CPUs at start (> 1 per CPU)'
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus!r}")
    limit = threshold()
    for when, load in (("start", load_start), ("end", load_end)):
        if load / cpus > limit:
            return (f"load average {load:.2f} per {cpus} CPUs at {when} "
                    f"(> {limit:g} per CPU)")
    return None


def finish() -> dict[str, Any]:
    """The load record from :func:`start` (or, without it, from now: wall and CPU 0) to now."""
    end = _snapshot()
    begin = _START if _START is not None else end
    cpus = os.cpu_count() or 1
    wall = end["wall"] - begin["wall"]
    cpu = end["cpu"] - begin["cpu"]
    reason = busy_reason(begin["loadavg"], end["loadavg"], cpus)
    return {"loadavg_1m_start": round(begin["loadavg"], 2),
            "loadavg_1m_end": round(end["loadavg"], 2), "cpus": cpus,
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "cpu_per_wall": round(cpu / wall, 3) if wall > 0 else None,
            "busy": reason is not None, "busy_reason": reason}


def describe(env: dict[str, Any]) -> str:
    """A result env's load in words: "load not recorded" for files made before the field."""
    rec = env.get("load")
    if not rec:
        return "load not recorded"
    state = f"busy: {rec['busy_reason']}" if rec.get("busy") else "idle"
    return (f"load {rec['loadavg_1m_start']}->{rec['loadavg_1m_end']} on {rec['cpus']} CPUs, "
            f"CPU/wall {rec['cpu_per_wall']} ({state})")


def left_out(loaded: list) -> tuple[list, list[str]]:
    """Split ``(path, data)`` result files for the report's headline: those measured on an idle
    host (or with no load recorded) are kept; a busy one is left out, with one line saying so:
    ``- left out of the headline: `x.json` (all 12 rows): busy host: load average ...``."""
    keep, lines = [], []
    for path, data in loaded:
        rec = data["env"].get("load") or {}
        if rec.get("busy"):
            lines.append(f"- left out of the headline: `{path.name}` (all {len(data['rows'])} "
                         f"rows): busy host: {rec.get('busy_reason')}")
        else:
            keep.append((path, data))
    return keep, lines
