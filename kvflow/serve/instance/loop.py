"""The ZMQ event loop every serving instance runs: poll, dispatch each message to its
``on_<type>`` handler, one unit of work, housekeeping; a bad frame or handler is logged."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import zmq

from kvflow.connector import is_data_message
from kvflow.context import sends_allowed
from kvflow.serve.protocol import Heartbeat, Leaving, decode_or_log, encode

from .heartbeat import HeartbeatThread, next_seq

log = logging.getLogger("kvflow.serve")


class EventLoop:
    """Sockets, sends and the poll loop of one instance; subclasses set ``instance_id`` and
    ``cfg`` and provide :meth:`free_blocks`."""

    instance_id: str
    cfg: Any
    LEAVE_LINGER_MS = 300  # how long a stopping instance waits for its Leaving to go

    def __init__(self) -> None:
        self.stopping = False
        self.ctx: zmq.Context | None = None
        self.ctrl: zmq.Socket | None = None
        self.sockets: dict[Any, str] = {}
        self._last_hb = 0.0
        self.messages_sent = 0
        self.beats: HeartbeatThread | None = None
        self.stop_signal: tuple[int, float] | None = None  # (signum, monotonic time received)
        self._ctrl_linger_ms = 0

    def open_channels(self) -> None:
        """Create the ZMQ context, the control socket and the heartbeat thread (after the
        profile run)."""
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 1000)  # ending the context never hangs
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, self.instance_id.encode())
        self.ctrl.setsockopt(zmq.LINGER, 500)
        self.ctrl.connect(self.cfg.router_url)
        self.sockets[self.ctrl] = "router"
        self.beats = HeartbeatThread(self.ctx, self.instance_id, self.cfg.router_url,
                                     self.heartbeat_message, self.cfg.heartbeat_s,
                                     parent_pid=self.cfg.parent_pid or 0,
                                     on_orphan=lambda: setattr(self, "stopping", True),
                                     renewals=self.lease_renewals())
        self.beats.start()

    def lease_renewals(self):
        """The :class:`~kvflow.connector.Renewals` the heartbeat thread sends (D's), or None."""
        return None

    def send_ctrl(self, msg: Any) -> None:
        self.send(self.ctrl, msg)

    def send(self, sock: zmq.Socket, msg: Any, *, ident: bytes | None = None) -> None:
        if not sends_allowed():
            raise RuntimeError("send during a dummy/profile run: nothing may be sent while "
                               "is_dummy_or_profile_run is set")
        frame = encode(msg)
        sock.send_multipart([ident, frame] if ident is not None else [frame])
        self.messages_sent += 1

    def has_work(self) -> bool:
        return False

    def work(self) -> None:
        """One unit of work (a prefill, a decode step)."""

    def free_blocks(self) -> int:
        raise NotImplementedError

    def heartbeat_message(self) -> Heartbeat:
        """This instance's :class:`Heartbeat` now (free blocks, running requests; numbered)."""
        return Heartbeat(instance_id=self.instance_id, free_blocks=self.free_blocks(),
                         num_running=self.num_running(), seq=next_seq())

    def report_blocks(self) -> None:
        """Send a :class:`Heartbeat` on the control socket now (after blocks were freed)."""
        self.send_ctrl(self.heartbeat_message())

    def heartbeat(self, force: bool = False) -> None:
        """The loop's housekeeping, every iteration; ``force``: report the block counts now.
        Without a heartbeat thread (an instance driven by hand) it also beats here."""
        now = time.monotonic()
        if force:
            self.report_blocks()
        if self.beats is not None or now - self._last_hb < self.cfg.heartbeat_s:
            return  # the thread beats and watches the parent
        self._last_hb = now
        if not force:
            self.report_blocks()
        if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
            log.error("%s: parent %d is gone; exiting", self.instance_id, self.cfg.parent_pid)
            self.stopping = True

    def num_running(self) -> int:
        return 0

    def drain(self, sock: zmq.Socket) -> None:
        """Dispatch every message waiting on ``sock`` without blocking."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.dispatch(sock, frames)

    def dispatch(self, sock: zmq.Socket, frames: list[Any]) -> None:
        ident = None
        if sock.type == zmq.ROUTER:
            ident, frames = frames[0].bytes, frames[1:]
        if not frames:
            return
        msg = decode_or_log(frames[0], self.sockets[sock])
        if msg is None:
            return
        handler = self.on_data if is_data_message(msg) else \
            getattr(self, f"on_{type(msg).__name__.lower()}", None)
        if handler is None:
            log.error("%s: unexpected %s from %s; dropped", self.instance_id,
                      type(msg).__name__, self.sockets[sock])
            return
        try:
            handler(msg, frames[1:], ident)
        except Exception:  # one bad request must not take the instance down
            log.exception("%s: handling %s failed", self.instance_id, type(msg).__name__)

    def on_data(self, msg: Any, frames: list[Any], ident: bytes | None) -> None:
        """A data-plane message (P and D hand it to their connector); here: its ``on_<type>``
        handler, else it is logged and dropped."""
        handler = getattr(self, f"on_{type(msg).__name__.lower()}", None)
        if handler is None:
            log.error("%s: unexpected %s on a data link; dropped", self.instance_id,
                      type(msg).__name__)
            return
        handler(msg, frames, ident)

    def serve_forever(self) -> None:
        poller, polled = zmq.Poller(), set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)
        try:
            while not self.stopping:
                if polled != set(self.sockets):  # a socket was opened (pairing) or closed
                    poller, polled = zmq.Poller(), set(self.sockets)
                    for sock in polled:
                        poller.register(sock, zmq.POLLIN)
                timeout = 0 if self.has_work() else int(self.cfg.heartbeat_s * 250)
                for sock, _ in poller.poll(timeout):
                    if sock in self.sockets and not sock.closed:  # an earlier message of this
                        self.drain(sock)  # poll may have closed it (an Unpair drops a link)
                if self.has_work():
                    self.work()
                self.heartbeat()
        finally:
            self._leave()
            self.close()
            if self.stop_signal is not None:
                signum, t0 = self.stop_signal
                log.info("%s: stopped by %s in %.2f s (sockets and cache closed)", self.instance_id,
                         signal.Signals(signum).name, time.monotonic() - t0)

    def _leave(self) -> None:
        """After SIGINT/SIGTERM tell the router (:class:`~kvflow.serve.protocol.Leaving`): a stop, not a
        death."""
        if self.stop_signal is None or self.ctrl is None or self.ctrl.closed:
            return
        if self.beats is not None:  # no beat may follow the Leaving
            self.beats.stop()
            self.beats = None
        name = signal.Signals(self.stop_signal[0]).name
        with contextlib.suppress(zmq.ZMQError):  # the router gone or its queue full: it judges
            self.ctrl.send(encode(Leaving(instance_id=self.instance_id, reason=name)), zmq.NOBLOCK)
            self._ctrl_linger_ms = self.LEAVE_LINGER_MS

    def _on_stop_signal(self, signum: int, frame) -> None:
        """SIGINT / SIGTERM while serving: stop after the current unit of work."""
        if self.stop_signal is None:
            self.stop_signal = (signum, time.monotonic())
        self.stopping = True

    def close(self) -> None:
        if self.beats is not None:  # its socket closes before the context ends
            self.beats.stop()
            self.beats = None
        for sock in list(self.sockets):
            sock.close(self._ctrl_linger_ms if sock is self.ctrl else 0)
        self.sockets.clear()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
