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
:meth:`~kvflow.serve.loop.EventLoop.report_blocks`): the router keeps the block counts of the
newest one only, since the two sockets' messages may arrive out of order.

A decode instance's thread also renews P's leases (:class:`Renewals`): every beat it sends a
:class:`~kvflow.protocol.LeaseRenew` naming the requests D still means to read to each paired
P, on D's *lease socket* (a ROUTER that P's connect to at pairing, ``Register.lease_addr``).
Before, D sent them from its loop between decode steps, so one step longer than
``--kv-lease-s`` let P free blocks D was about to read (docs/reliability.md, "Liveness").

The thread starts only after the profile run (:meth:`~kvflow.serve.loop.EventLoop.open_channels`):
nothing is sent while ``is_dummy_or_profile_run`` could be set (docs/design.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Callable

import zmq

from kvflow.protocol import Heartbeat, LeaseRenew, encode

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


class Renewals:
    """D's lease renewals, sent by its heartbeat thread: the loop says what to renew
    (:meth:`want`), the thread sends it (:meth:`send`) and records when renewals naming a
    request really left for a P; :meth:`renewed_since` tells the loop whether P's lease still
    holds. Thread-safe.

    Parameters
    ----------
    sock : zmq.Socket
        D's lease socket (ROUTER, ``ROUTER_MANDATORY``), bound; once the thread runs only the
        thread uses it (:meth:`send`; ZMQ sockets are single-threaded).
    gap_s : float
        The longest gap between renewals that keeps a lease alive as D judges it: 0.8 x
        ``--kv-lease-s`` (the 20% margin covers delivery and P's own loop); settable.
    """

    def __init__(self, sock: zmq.Socket | None, gap_s: float) -> None:
        self.sock, self.gap_s = sock, gap_s
        self._lock = threading.Lock()
        self._peers: tuple[str, ...] = ()
        self._req_ids: tuple[str, ...] = ()
        # (P id, req id) -> (first, last): time.time() of the first and the last renewal of the
        # latest run that left for that P with no gap of gap_s or more between them
        self._runs: dict[tuple[str, str], tuple[float, float]] = {}
        self.sent = 0  # LeaseRenew messages that left (all peers)

    def want(self, peers, req_ids) -> None:
        """From now on renew ``req_ids`` (the requests D still means to read: ALLOCATED or
        RECEIVING) with every P of ``peers`` (ids); records of other requests are dropped."""
        with self._lock:
            self._peers, self._req_ids = tuple(peers), tuple(req_ids)
            keep = set(self._req_ids)
            self._runs = {k: v for k, v in self._runs.items() if k[1] in keep}

    def wanted(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(peers, req_ids)`` as last set by :meth:`want`."""
        with self._lock:
            return self._peers, self._req_ids

    def record(self, peer_id: str, req_ids, wall: float) -> None:
        """A renewal naming ``req_ids`` left for P ``peer_id`` at ``wall`` (``time.time()``
        taken before the send)."""
        with self._lock:
            still = set(self._req_ids)  # a request ended meanwhile keeps no record
            for r in req_ids:
                if r not in still:
                    continue
                first, last = self._runs.get((peer_id, r), (wall, wall))
                self._runs[(peer_id, r)] = (first, wall) if wall - last < self.gap_s else (wall, wall)

    def renewed_since(self, req_id: str, peer_id: str | None, t_start: float) -> float:
        """``time.time()`` of the last renewal of ``req_id`` that kept P ``peer_id``'s lease
        (started at P's send, ``t_start``) alive: renewals left with no gap of ``gap_s`` from
        ``t_start`` on; 0.0 if none did (a gap ends the lease: a renewal after it renews
        nothing, P may have freed the blocks). ``peer_id`` None: the best of any P."""
        with self._lock:
            runs = [v for (p, r), v in self._runs.items()
                    if r == req_id and (peer_id is None or p == peer_id)]
        best = 0.0
        for first, last in runs:
            if last >= t_start and (first <= t_start or first - t_start < self.gap_s):
                best = max(best, last)
        return best

    def send(self) -> int:
        """One :class:`~kvflow.protocol.LeaseRenew` to every wanted P (on the thread only);
        returns to how many it left. A P not connected (yet, or any more:
        ``EHOSTUNREACH``) or whose queue is full (its loop stalls: ``EAGAIN``) does not count."""
        peers, req_ids = self.wanted()
        if not req_ids or not peers:
            return 0
        frame, wall, sent = encode(LeaseRenew(req_ids=list(req_ids))), time.time(), 0
        for peer in peers:
            try:
                self.sock.send_multipart([peer.encode(), frame], zmq.NOBLOCK)
            except zmq.ZMQError:  # not connected, or its queue is full: not renewed there
                continue
            self.record(peer, req_ids, wall)
            sent += 1
        self.sent += sent
        return sent


def lease_socket(ctx: zmq.Context, host: str) -> tuple[zmq.Socket, int]:
    """D's lease socket, bound to a free port of ``host``: ``(socket, port)``."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a P not connected raises: not counted
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a P paired anew reconnects under its old id
    sock.setsockopt(zmq.SNDHWM, 16)           # renewals a stalled P has not read are worthless
    return sock, sock.bind_to_random_port(f"tcp://{host}")


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
