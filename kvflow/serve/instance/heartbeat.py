"""An instance's heartbeat (and D's lease renewals), sent every ``heartbeat_s`` from a thread and
socket of its own so that no compute blocks it (docs/reliability.md, "Liveness")."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Callable

import zmq

from kvflow.connector import Renewals
from kvflow.serve.protocol import Heartbeat, encode

log = logging.getLogger("kvflow.serve")

#: the suffix of a heartbeat socket's ZMQ identity (the router strips it)
BEAT_SUFFIX = "#hb"
_SEQ = itertools.count(1)  # next() of a count is atomic under the GIL


def next_seq() -> int:
    """The next heartbeat sequence number of this process (1, 2, ...; thread-safe)."""
    return next(_SEQ)


class HeartbeatThread(threading.Thread):
    """Send ``beat()`` to the router at ``router_url``, then D's ``renewals``, every ``period_s``
    seconds until :meth:`stop`; ``on_orphan()`` once ``parent_pid`` (nonzero) is gone."""

    def __init__(self, ctx: zmq.Context, instance_id: str, router_url: str,
                 beat: Callable[[], Heartbeat], period_s: float, *, parent_pid: int = 0,
                 on_orphan: Callable[[], None] = lambda: None,
                 renewals: Renewals | None = None) -> None:
        super().__init__(name=f"heartbeat-{instance_id}", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, (instance_id + BEAT_SUFFIX).encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 16)  # old beats are worthless: no unbounded queue
        self.sock.connect(router_url)
        self.instance_id, self.beat, self.period_s = instance_id, beat, period_s
        self.parent_pid, self.on_orphan = parent_pid, on_orphan
        self.renewals = renewals
        self.beats_sent = 0
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.wait(self.period_s):
                try:
                    self.sock.send(encode(self.beat()), zmq.NOBLOCK)
                    self.beats_sent += 1
                except zmq.Again:  # the router's queue is full (it is gone or stalled)
                    pass
                except Exception:  # one failed beat (a count read mid-change) is no reason to stop
                    log.exception("%s: heartbeat failed", self.instance_id)
                if self.renewals is not None:
                    try:
                        self.renewals.send()
                    except Exception:
                        log.exception("%s: lease renewal failed", self.instance_id)
                if self.parent_pid and os.getppid() != self.parent_pid:
                    log.error("%s: parent %d is gone; exiting", self.instance_id, self.parent_pid)
                    self.on_orphan()
                    return
        finally:
            self.sock.close(0)
            if self.renewals is not None:
                self.renewals.sock.close(0)

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the thread (its socket closes on it), waiting up to ``timeout_s``."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
