"""The router's liveness rule (docs/reliability.md, "Liveness"): when a silent instance is late or
dead; a stall of the router's own loop does not count against the instances."""

from __future__ import annotations

from kvflow.segments import ALIVE, DEAD

OK, LATE, GONE = "ok", "late", "dead"

#: an instance heard of less than this long ago is "ok" (5 missed beats of 0.2 s)
LATE_AFTER_S = 1.0


def judge(silent_s: float, process: str, *, dead_after_s: float,
          hung_after_s: float, late_after_s: float = LATE_AFTER_S) -> tuple[str, str]:
    """``(state, why)``: ``state`` :data:`OK`, :data:`LATE` or :data:`GONE` (``why``: its
    reason) of an instance silent for ``silent_s`` seconds whose process this host sees as
    ``process`` (:mod:`kvflow.segments` ALIVE, DEAD, UNKNOWN): dead at once when exited;
    alive here: dead after ``hung_after_s``; unseen: dead after ``dead_after_s``."""
    if process == DEAD:
        return GONE, "exited"
    if process == ALIVE:
        if silent_s > hung_after_s:
            return GONE, (f"hung: its process lives but sent nothing for {hung_after_s:g} s "
                          f"(--hung-after-s)")
        return (LATE if silent_s > late_after_s else OK), ""
    if silent_s > dead_after_s:
        return GONE, f"missed heartbeats for {dead_after_s:.1f} s"
    return (LATE if silent_s > min(late_after_s, dead_after_s / 2) else OK), ""


class StallClock:
    """Seconds the router's own loop stalled: :meth:`tick`, called every ``period_s``, returns
    how much later than ``period_s + grace_s`` it came (else 0), to credit every instance."""

    def __init__(self, now: float, period_s: float, grace_s: float = 0.25) -> None:
        self.last, self.period_s, self.grace_s = now, period_s, grace_s
        self.stalled_s = 0.0  # in all, for /health

    def tick(self, now: float) -> float:
        late = now - self.last - self.period_s
        self.last = now
        if late <= self.grace_s:
            return 0.0
        self.stalled_s += late
        return late
