"""A transfer bench pair with D in its own process (:mod:`.peer`): what P and D are in serving,
and what CUDA IPC and NIXL's ``cuda_ipc`` need (neither maps memory of its own process).

:class:`RemotePair` has :class:`~kvflow.bench.transfer._Pair`'s interface (``request``,
``check``, ``close``): P's half lives here, D's in the child, and one timed request is P's
``send_prefilled`` plus D's ``receive`` and its reply (a ZMQ round trip on 127.0.0.1, ~0.1 ms).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec

from .nixl import best_of_chunks, connector_of

#: Seconds P waits for the child's reply to one command.
REPLY_TIMEOUT_S = 120.0


#: The request id of every bench request.
BENCH_REQ = "bench"


def bench_job(spec, src_ids: list[int], dst_ids: list[int]):
    """The :class:`~kvflow.connector.PrefillJob` of one bench request: P's blocks ``src_ids``
    full of computed KV (no model runs), for D's blocks ``dst_ids``."""
    from kvflow.connector import PrefillJob
    return PrefillJob(BENCH_REQ, [0] * (len(src_ids) * spec.block_size), src_ids, "bench-d",
                      dst_ids)


class RemoteD:
    """The child process running :mod:`.peer` and P's sockets to it.

    Raises
    ------
    RuntimeError
        The child did not start, answered with an error (its message), or not within
        :data:`REPLY_TIMEOUT_S`.
    """

    def __init__(self) -> None:
        import zmq
        self.proc = subprocess.Popen([sys.executable, "-m", "kvflow.bench.peer"],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bench's D process exited ({self.proc.wait()}) before it "
                               f"listened")
        ports = json.loads(line)
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.REQ)
        self.ctl.setsockopt(zmq.RCVTIMEO, int(REPLY_TIMEOUT_S * 1e3))
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.connect(f"tcp://127.0.0.1:{ports['ctl']}")
        self.link = self.ctx.socket(zmq.DEALER)
        self.link.setsockopt(zmq.LINGER, 0)
        self.link.connect(f"tcp://127.0.0.1:{ports['data']}")

    def send(self, op: str, **kw: Any) -> None:
        """Send command ``op`` (its reply comes from :meth:`reply`)."""
        self.ctl.send(msgspec.msgpack.encode({"op": op, **kw}))

    def reply(self) -> dict:
        """The reply to the last command sent."""
        import zmq
        try:
            out = msgspec.msgpack.decode(self.ctl.recv())
        except zmq.Again:
            raise RuntimeError(f"the bench's D process did not answer within "
                               f"{REPLY_TIMEOUT_S:g} s") from None
        if "error" in out:
            raise RuntimeError(f"the bench's D process: {out['error']}")
        return out

    def call(self, op: str, **kw: Any) -> dict:
        self.send(op, **kw)
        return self.reply()

    def close(self) -> None:
        try:
            self.call("close")
        except Exception:  # noqa: BLE001 - the child is killed below anyway
            pass
        self.ctx.destroy(linger=0)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RemotePair:
    """P's half here (connector ``kind`` of :mod:`.nixl`'s bench kinds or a connector name),
    D's half on ``d_device`` in a :class:`RemoteD`; paired as the server pairs them."""

    def __init__(self, kind: str, spec, geometry: dict, num_blocks: int, device: str,
                 d_device: str, longest: int | None = None) -> None:
        from kvflow.connector import Peer, make_sender
        self.name = kind
        connector, config = connector_of(kind)
        longest = longest or num_blocks * spec.block_size
        self.d = RemoteD()
        try:
            self.sender = make_sender(connector, spec, device, config=config,
                                      instance_id="bench-p", max_model_len=longest)
            self.p_cache = self.sender.make_cache(num_blocks)
            export = self.d.call("make", kind=connector, config=config, geometry=geometry,
                                 layout=spec.layout, dtype=str(spec.dtype).removeprefix("torch."),
                                 num_blocks=num_blocks, device=d_device,
                                 longest=longest)["export"]
            self.d.call("attach", export=self.sender.export())
            self.sender.attach(Peer("bench-d", spec, num_blocks, **export), link=self.d.link)
        except BaseException:
            self.close()
            raise
        from .cases import scramble
        scramble(self.p_cache.buffer)

    def request(self, src_ids: list[int], dst_ids: list[int]):
        """One request end to end (P's send, D's receive and reply); returns D's copy ms."""
        self.d.send("recv", ids=list(dst_ids))
        handoff = self.sender.send_prefilled(bench_job(self.p_cache.spec, src_ids, dst_ids), 0)
        out = self.d.reply()
        del handoff
        return _Stats(out["copy_ms"], out["receive_ms"])

    def hold(self, on: bool) -> None:
        """D's receiver progresses fast (``on``) or not, as while a request's KV may come."""
        self.d.call("hold", on=on)

    def check(self, src_ids: list[int], dst_ids: list[int]) -> bool:
        """One request into zeroed D blocks; D's blocks equal P's byte for byte (SHA-256)."""
        from .cases import blocks_digest
        self.d.call("zero")
        self.request(src_ids, dst_ids)
        return self.d.call("digest", ids=list(dst_ids))["sha256"] == \
            blocks_digest(self.p_cache, src_ids)

    def close(self) -> None:
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.close()
        self.d.close()


class _Stats:
    def __init__(self, copy_ms: float, receive_ms: float) -> None:
        self.copy_ms, self.receive_ms = copy_ms, receive_ms


def remote_write_ceiling(nbytes: int, *, device: str, d_device: str, warmup: int,
                         reps: int) -> tuple[list[float], int]:
    """:func:`.nixl.write_ceiling` with the target buffer on ``d_device`` in a :class:`RemoteD`
    (NIXL over ``cuda_ipc`` between GPU processes): seconds per WRITE and the descriptor size."""
    import torch
    d = RemoteD()
    try:
        buf = d.call("buffer", nbytes=nbytes, device=d_device)
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        return best_of_chunks(src, buf["addr"], buf["metadata"], (buf["mem"], buf["device_id"]),
                              warmup=warmup, reps=reps)
    finally:
        d.close()
