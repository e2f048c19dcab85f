"""An instance's heartbeat, sent from its own thread and socket so that no compute blocks it.

Before issue 26 the heartbeat went out from the instance's event loop, between prefill chunks
and decode steps: on a busy host (load 18-27 on 2 cores) one chunk outlasted the router's
``--dead-after-s`` and a live P or D was declared dead (HTTP 502, then 503). Now
:class:`HeartbeatThread` sends a :class:`~kvflow.protocol.Heartbeat` every ``heartbeat_s``
(0.2 s) on a DEALER socket of its own (identity ``<instance id>#hb``, :func:`beat_identity`;
ZMQ sockets are single-threaded, so the loop's control socket is not shared). A torch
forward, a Numba kernel (``nogil``) or a blocking copy leaves the GIL to it; the thread
needs microseconds of CPU per beat, so the scheduler serves it even on a loaded host
(measured in docs/reliability.md, "Liveness").

Every heartbeat carries a sequence number (:func:`next_seq`, shared with the loop's own
:meth:`~kvflow.serve.instance.loop.EventLoop.report_blocks`): the router keeps the block counts of the
newest one only, since the two sockets' messages may arrive out of order.

A decode instance's thread also renews P's leases (:class:`~kvflow.connector.lease.Renewals`):
every beat it sends a :class:`~kvflow.protocol.LeaseRenew` naming the requests D still means to
read to each paired P, on D's *lease socket* (a ROUTER that P's connect to at pairing, ``Register.lease_addr``).
Before, D sent them from its loop between decode steps, so one step longer than
``--kv-lease-s`` let P free blocks D was about to read (docs/reliability.md, "Liveness").

The thread starts only after the profile run (:meth:`~kvflow.serve.instance.loop.EventLoop.open_channels`):
nothing is sent while ``is_dummy_or_profile_run`` could be set (docs/design.md).
"""

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


def beat_identity(instance_id: str) -> bytes:
    """The ZMQ identity of ``instance_id``'s heartbeat socket."""
    return (instance_id + BEAT_SUFFIX).encode()


class HeartbeatThread(threading.Thread):
    """Send ``beat()`` to the router at ``router_url`` every ``period_s`` seconds until
    :meth:`stop`; ``parent_pid`` (nonzero): call ``on_orphan()`` once that process is no
    longer this one's parent.

    Parameters
    ----------
    ctx : zmq.Context
        The instance's context (the thread opens and closes its own socket in it).
    instance_id, router_url : str
        Who beats, and the router's control address.
    beat : callable
        Returns the :class:`~kvflow.protocol.Heartbeat` to send (called on this thread).
    period_s : float
        Seconds between beats (``ServeConfig.heartbeat_s``).
    renewals : Renewals or None
        D's lease renewals, sent after each beat (its socket closes with the thread).
    """

    def __init__(self, ctx: zmq.Context, instance_id: str, router_url: str,
                 beat: Callable[[], Heartbeat], period_s: float, *, parent_pid: int = 0,
                 on_orphan: Callable[[], None] = lambda: None,
                 renewals: Renewals | None = None) -> None:
        super().__init__(name=f"heartbeat-{instance_id}", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, beat_identity(instance_id))
        self.sock.setsockopt(zmq.LINGER, 0)
        # a router that is gone must not queue beats without bound: old ones are worthless
        self.sock.setsockopt(zmq.SNDHWM, 16)
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
        """End the thread (its socket closes on it) and wait up to ``timeout_s``."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
