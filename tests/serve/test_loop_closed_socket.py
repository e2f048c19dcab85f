"""An instance's loop survives a message that closes another socket of the same poll: an
Unpair from the router drops D's link while the link also has a message waiting (a new user
saw P exit with ``ZMQError: Socket operation on non-socket`` after killing D mid-request)."""

from __future__ import annotations

import time
import types

import zmq

from kvflow.serve.protocol import Heartbeat, Unpair, encode
import kvflow.serve.instance.loop as loop_mod
from kvflow.serve.instance.loop import EventLoop


class _Loop(EventLoop):
    instance_id = "p-test"

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(heartbeat_s=0.05, parent_pid=0)
        self.seen: list[str] = []
        self.ctrl = ctx.socket(zmq.PULL)
        self.link = ctx.socket(zmq.PULL)
        self.sockets = {self.ctrl: "router", self.link: "decode d-test"}

    def report_blocks(self) -> None:
        self.stopping = len(self.seen) >= 1

    def on_unpair(self, msg, frames, ident) -> None:  # as P's: drop the link to that D
        self.seen.append(msg.peer_id)
        self.sockets.pop(self.link)
        self.link.close(linger=0)

    def on_heartbeat(self, msg, frames, ident) -> None:
        self.seen.append("heartbeat")

    def close(self) -> None:
        pass


class _RouterFirst(zmq.Poller):
    """A poller that hands back the router's socket first (a real one may too)."""

    def poll(self, timeout=None):
        return sorted(super().poll(timeout), key=lambda e: e[0].type != zmq.PULL or
                      e[0].getsockopt(zmq.LAST_ENDPOINT) != self.first)


def test_a_socket_closed_by_an_earlier_message_of_the_same_poll_is_not_read(monkeypatch):
    ctx = zmq.Context()
    try:
        loop = _Loop(ctx)
        ctrl_port = loop.ctrl.bind_to_random_port("tcp://127.0.0.1")
        link_port = loop.link.bind_to_random_port("tcp://127.0.0.1")
        to_ctrl, to_link = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        to_ctrl.connect(f"tcp://127.0.0.1:{ctrl_port}")
        to_link.connect(f"tcp://127.0.0.1:{link_port}")
        to_link.send(encode(Heartbeat(instance_id="d-test", free_blocks=1)))
        to_ctrl.send(encode(Unpair(peer_id="d-test", reason="exited", exited=True)))
        deadline = time.monotonic() + 5
        while not (loop.ctrl.poll(0) and loop.link.poll(0)) and time.monotonic() < deadline:
            time.sleep(0.01)  # both messages waiting: one poll returns both sockets
        _RouterFirst.first = loop.ctrl.getsockopt(zmq.LAST_ENDPOINT)
        monkeypatch.setattr(loop_mod.zmq, "Poller", _RouterFirst)
        loop.serve_forever()  # before the fix: ZMQError, socket operation on non-socket
        assert loop.seen == ["d-test"] and loop.link.closed
    finally:
        ctx.destroy(linger=0)
