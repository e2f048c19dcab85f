"""D's side channel to the P workers it pulls from: one ZMQ DEALER socket per P address, used
from D's loader thread only. Both transports ask P over it (tcp: the KV comes back as frames;
nixl: P's agent and a check, the KV moves by NIXL READ).
"""

from __future__ import annotations

from typing import Any

import zmq

from .messages import decode, encode


class PullError(RuntimeError):
    """A pull that did not put the KV into D's blocks (P refused or timed out, bad frames, a
    failed NIXL READ)."""


class PeerLink:
    """D's DEALER sockets, one per P address (``tcp://host:port``).

    Parameters
    ----------
    timeout_s : float
        Longest wait for one answer of P (seconds); then :class:`PullError` and the socket is
        dropped (a late answer never reaches a later question).
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        s = self._socks.get(addr)
        if s is None:
            s = self._socks[addr] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
        return s

    def send(self, addr: str, msg: Any) -> None:
        """Send one message to P at ``addr``, expecting no answer."""
        self._sock(addr).send(encode(msg))

    def ask(self, addr: str, msg: Any, answer: type, what: str,
            req_id: str | None = None) -> tuple[Any, list[Any]]:
        """Send ``msg`` and wait for P's answer of type ``answer`` (with ``req_id``, when
        given; other answers, late ones of an earlier question, are skipped).

        Returns
        -------
        (answer, frames)
            The decoded answer and the raw frames after it (zmq ``Frame`` objects, not copied).

        Raises
        ------
        PullError
            No answer within ``timeout_s`` (naming ``what`` and ``addr``).
        """
        sock = self._sock(addr)
        sock.send(encode(msg))
        while True:
            if not sock.poll(int(self.timeout_s * 1000)):
                self.drop(addr)
                raise PullError(f"{what}: no answer from P at {addr} within {self.timeout_s} s")
            header, *frames = sock.recv_multipart(copy=False)
            reply = decode(header)
            if isinstance(reply, answer) and (req_id is None or reply.req_id == req_id):
                return reply, frames

    def drop(self, addr: str) -> None:
        """Close the socket to ``addr`` (P died or answered late); the next use reconnects."""
        s = self._socks.pop(addr, None)
        if s is not None:
            s.close(linger=0)

    def close(self) -> None:
        for addr in list(self._socks):
            self.drop(addr)
