"""The router's side of the control plane, run by a test: a ZMQ ROUTER that real P and D
instances register with, and a hand-run event loop (:meth:`FakeRouter.pump`) that drives one
iteration of every instance's loop. Subclasses say which instances it drives."""

from __future__ import annotations

import time

import zmq

from kvflow.serve.protocol import Heartbeat, Pair, decode, encode


class FakeRouter:
    """A ROUTER socket on a free loopback port (:attr:`addr`) and the messages it received
    (:attr:`inbox`, heartbeats left out)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.inbox: list = []
        self.regs: dict = {}  # instance id -> its Register message (filled by the subclass)

    def instances(self) -> list:
        raise NotImplementedError

    def to(self, inst, msg) -> None:
        self.router.send_multipart([inst.instance_id.encode(), encode(msg)])

    def pair(self, p, d) -> None:
        """The router's two Pair messages (``kvflow.serve.control.Controller._pair``) for P
        ``p`` and D ``d``, from their Register messages in :attr:`regs`."""
        rp, rd = self.regs[p.instance_id], self.regs[d.instance_id]
        self.to(p, Pair(peer_id=rd.instance_id, peer_role="decode", peer_spec=rd.spec,
                        peer_num_blocks=rd.num_blocks, data_addr=rd.data_addr, shm_name=rd.shm_name,
                        peer_pid=rd.pid, peer_fingerprint=rd.fingerprint,
                        lease_addr=rd.lease_addr))
        self.to(d, Pair(peer_id=rp.instance_id, peer_role="prefill", peer_spec=rp.spec,
                        peer_num_blocks=rp.num_blocks, shm_name=rp.shm_name, peer_pid=rp.pid,
                        peer_fingerprint=rp.fingerprint))

    def pump(self, timeout_ms: int = 2) -> None:
        """One loop iteration of every instance, then collect what reached the router."""
        insts = self.instances()
        poller = zmq.Poller()
        for s in [self.router, *(s for i in insts for s in i.sockets)]:
            poller.register(s, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        for inst in insts:
            for sock in list(inst.sockets):
                if sock in ready:
                    inst.drain(sock)
            if inst.has_work():
                inst.work()
            inst.heartbeat()
        while True:
            try:
                msg = decode(self.router.recv_multipart(zmq.NOBLOCK)[1])
            except zmq.Again:
                return
            if not isinstance(msg, Heartbeat):
                self.inbox.append(msg)

    def wait_for(self, kind, count: int = 1, req_id: str | None = None,
                 timeout: float = 30.0) -> list:
        """Take ``count`` messages of ``kind`` (a type or tuple) for ``req_id`` from the inbox,
        pumping until they are there; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [m for m in self.inbox
                   if isinstance(m, kind) and getattr(m, "req_id", req_id) == req_id]
            if len(got) >= count:
                for m in got[:count]:
                    self.inbox.remove(m)
                return got[:count]
            self.pump()
        raise TimeoutError(f"no {kind} x{count} within {timeout} s; inbox {self.inbox}")

    def close(self) -> None:
        for inst in self.instances():
            inst.close()
        self.router.close(0)
        self.ctx.term()
