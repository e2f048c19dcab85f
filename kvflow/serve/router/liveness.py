"""The router's liveness rule: when an instance that went silent is late, and when it is dead.

Each instance heartbeats every 0.2 s from a thread that no compute blocks
(:mod:`kvflow.serve.instance.heartbeat`), so silence means its whole process gets no CPU, is stopped or
hung, or is gone. :func:`judge` decides, from the seconds since the instance was last heard
of (``silent_s``) and what this host can see of its process:

- its process has exited (a child of this server, or any process on this host: same boot and
  pid namespace, :func:`kvflow.segments.process_state`): **dead** at once;
- its process lives on this host: **late** while silent for less than ``hung_after_s``
  (``--hung-after-s``, 60 s): a loaded host delays it, nothing is lost by waiting, and the
  requests it serves go on; then **dead** (hung);
- its process cannot be seen (another host or pid namespace): **late** from ``late_after_s``,
  **dead** after ``dead_after_s`` (``--dead-after-s``, 10 s: SGLang's 5 s heartbeat x 2 misses;
  vLLM leases blocks for 30 s).

``/health`` gives each instance's ``liveness`` ("ok" or "late") and ``heartbeat_age_s``; a
dead one is gone from the list and named in ``errors``. A router whose own event loop stalled
(its process got no CPU) does not count that stall against the instances:
:class:`StallClock` credits it, since their heartbeats wait unread in the socket meanwhile.
"""

from __future__ import annotations

from kvflow.segments import ALIVE, DEAD

OK, LATE, GONE = "ok", "late", "dead"

#: an instance heard of less than this long ago is "ok" (5 missed beats of 0.2 s)
LATE_AFTER_S = 1.0


def judge(silent_s: float, process: str, *, dead_after_s: float,
          hung_after_s: float, late_after_s: float = LATE_AFTER_S) -> tuple[str, str]:
    """``(state, why)``: ``state`` one of :data:`OK`, :data:`LATE`, :data:`GONE`; ``why`` the
    reason of a dead one ("exited", "missed heartbeats for N s", "hung: ...").

    Parameters
    ----------
    silent_s : float
        Seconds since the router last heard of the instance (stalls of the router excluded).
    process : str
        :data:`~kvflow.segments.ALIVE`, :data:`~kvflow.segments.DEAD` or
        :data:`~kvflow.segments.UNKNOWN`: what this host sees of the instance's process.
    dead_after_s, hung_after_s : float
        ``--dead-after-s`` (process unseen) and ``--hung-after-s`` (process alive here).
    """
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
    """Seconds the router's own loop stalled, to add to every instance's last-heard time.

    :meth:`tick` is called every ``period_s``; a tick that comes later than ``period_s`` +
    ``grace_s`` returns the excess (the loop got no CPU: the heartbeats that arrived meanwhile
    are still unread in the socket), else 0.
    """

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
