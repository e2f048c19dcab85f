"""The lease on sent blocks: D's renewals (:class:`Renewals`, sent from its lease socket,
:func:`lease_socket`) and P's links that receive them (:class:`LeaseLinks`); P's side is
:mod:`.held`. docs/reliability.md, "Liveness".
"""

from __future__ import annotations

import threading
import time

import zmq

from kvflow.connector.messages import LeaseRenew, encode


class Renewals:
    """D's lease renewals, thread-safe: the loop says what to renew (:meth:`want`), the heartbeat
    thread sends it on ``sock`` (:meth:`send`, then only the thread uses it) and records what left;
    :meth:`renewed_since` tells the loop whether P's lease still holds, with gaps under ``gap_s``
    (0.8 x ``--kv-lease-s``, settable)."""

    def __init__(self, sock: zmq.Socket | None, gap_s: float) -> None:
        self.sock, self.gap_s = sock, gap_s
        self._lock = threading.Lock()
        self._peers: tuple[str, ...] = ()
        self._req_ids: tuple[str, ...] = ()
        # (P id, req id) -> time.time() of the first and last renewal of the latest run with
        # no gap of gap_s or more
        self._runs: dict[tuple[str, str], tuple[float, float]] = {}
        self.sent = 0  # LeaseRenew messages that left (all peers)

    def want(self, peers, req_ids) -> None:
        """From now on renew ``req_ids`` with every P of ``peers`` (ids); records of other
        requests are dropped."""
        with self._lock:
            self._peers, self._req_ids = tuple(peers), tuple(req_ids)
            keep = set(self._req_ids)
            self._runs = {k: v for k, v in self._runs.items() if k[1] in keep}

    def wanted(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(peers, req_ids)`` as last set by :meth:`want`."""
        with self._lock:
            return self._peers, self._req_ids

    def record(self, peer_id: str, req_ids, wall: float) -> None:
        """A renewal naming ``req_ids`` left for P ``peer_id`` at ``wall`` (``time.time()``)."""
        with self._lock:
            for r in set(self._req_ids).intersection(req_ids):  # an ended request keeps none
                first, last = self._runs.get((peer_id, r), (wall, wall))
                self._runs[(peer_id, r)] = (first, wall) if wall - last < self.gap_s else (wall, wall)

    def renewed_since(self, req_id: str, peer_id: str | None, t_start: float) -> float:
        """``time.time()`` of the last renewal of ``req_id`` keeping P ``peer_id``'s lease (from
        ``t_start``) with no gap of ``gap_s``, else 0.0; ``peer_id`` None: any P's."""
        with self._lock:
            runs = [v for (p, r), v in self._runs.items()
                    if r == req_id and (peer_id is None or p == peer_id)]
        return max((last for first, last in runs if last >= t_start
                    and (first <= t_start or first - t_start < self.gap_s)), default=0.0)

    def send(self) -> int:
        """One :class:`~kvflow.connector.messages.LeaseRenew` to every wanted P (on the thread only);
        returns to how many it left (a P not connected or whose queue is full does not count)."""
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


class LeaseLinks:
    """P's links to its paired D's lease sockets: one DEALER per D, named by P's id, polled with P's
    other sockets and read before P judges a lease (:meth:`drain`); iterating gives D ids."""

    def __init__(self, instance_id: str) -> None:
        self.identity = instance_id.encode()
        self.socks: dict[str, zmq.Socket] = {}  # D id -> DEALER

    def __iter__(self):
        return iter(self.socks)

    def connect(self, ctx: zmq.Context, peer_id: str, addr: str) -> zmq.Socket:
        """Connect to D ``peer_id``'s lease socket at ``addr``; returns the socket, to poll."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        self.socks[peer_id] = sock
        return sock

    def drain(self, read) -> None:
        """Call ``read(sock)`` on every link."""
        for sock in list(self.socks.values()):
            read(sock)

    def drop(self, peer_id: str) -> zmq.Socket | None:
        """Close the link to D ``peer_id``; returns the closed socket (None: there was none)."""
        sock = self.socks.pop(peer_id, None)
        if sock is not None:
            sock.close(0)
        return sock

    def close(self) -> list[zmq.Socket]:
        """Close every link; returns the closed sockets."""
        socks = list(self.socks.values())
        for sock in socks:
            sock.close(0)
        self.socks.clear()
        return socks
