"""D's half of a transfer bench in its own process (``python -m kvflow.bench.peer``).

CUDA IPC refuses a handle exported by its own process, and NIXL's UCX backend moves GPU
memory over ``cuda_ipc`` only between processes, so on GPUs the transfer bench runs D here: P
(the bench) drives it over a ZMQ REQ socket with msgpack commands, and the connector's own
messages reach D's ROUTER socket as in a server. The child prints one JSON line,
``{"ctl": port, "data": port}`` (both on 127.0.0.1), then serves until ``close``.

Commands (``{"op": ..., ...}`` -> reply):

- ``make`` (``kind``, ``config``, ``geometry``, ``layout``, ``dtype``, ``num_blocks``,
  ``device``, ``longest``) -> ``{"export": D's export}``: the receiver and its cache;
- ``attach`` (``export``: P's) -> ``{}``;
- ``recv`` (``ids``) -> ``{"copy_ms", "receive_ms"}``: the next connector message is a
  request into D's blocks ``ids``; replies after
  :meth:`~kvflow.connector.base.KVReceiver.receive` (``receive_ms``: its wall time, D's copy
  or scatter included; ``copy_ms``: the connector's, from its stats);
- ``zero`` -> ``{}``; ``digest`` (``ids``) -> ``{"sha256"}`` of those blocks
  (:func:`~kvflow.bench.cases.blocks_digest`);
- ``buffer`` (``nbytes``, ``device``) -> ``{"addr", "metadata", "mem", "device_id"}``: a
  buffer on ``device`` registered with a new NIXL agent (the bulk WRITE ceiling's target);
  ``free`` drops it;
- ``close`` -> ``{}``, then the process exits.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgspec


class _Peer:
    def __init__(self) -> None:
        import zmq
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.REP)
        self.data = self.ctx.socket(zmq.ROUTER)
        self.ports = {"ctl": self.ctl.bind_to_random_port("tcp://127.0.0.1"),
                      "data": self.data.bind_to_random_port("tcp://127.0.0.1")}
        self.receiver: Any = None
        self.cache: Any = None
        self.buffer: Any = None
        self.agent: Any = None

    def make(self, kind: str, config: dict | None, geometry: dict, layout: str, dtype: str,
             num_blocks: int, device: str, longest: int) -> dict:
        from kvflow.connector import make_receiver

        from .cases import make_spec
        self.spec = make_spec(geometry, layout, dtype)
        self.receiver = make_receiver(kind, self.spec, device, config=config,
                                      max_model_len=longest)
        self.cache = self.receiver.make_cache(num_blocks)
        return {"export": self.receiver.export()}

    def attach(self, export: dict) -> dict:
        from kvflow.connector import Peer
        self.receiver.attach(Peer("bench-p", self.spec, self.cache.num_blocks, **export))
        return {}

    def recv(self, ids: list[int]) -> dict:
        from kvflow.connector.messages import decode
        from .remote_pair import BENCH_REQ
        self.receiver.expect(BENCH_REQ)  # as D does at allocation (nixl: progress fast)
        _, head, *frames = self.data.recv_multipart(copy=False)
        t0 = time.perf_counter()
        stats = self.receiver.receive(decode(head), frames, self.cache, ids, "bench-p")
        if self.cache.buffer.is_cuda:
            import torch
            torch.cuda.synchronize(self.cache.buffer.device)
        return {"copy_ms": stats.copy_ms, "receive_ms": (time.perf_counter() - t0) * 1e3}

    def hold(self, on: bool) -> dict:
        """Progress D's agent fast (``on``) or not, as between a request's allocation and end
        (the same-descriptor ceiling's WRITEs come with no request)."""
        (self.receiver.expect if on else self.receiver.forget)("bench-hold")
        return {}

    def zero(self) -> dict:
        self.cache.buffer.zero_()
        return {}

    def digest(self, ids: list[int]) -> dict:
        from .cases import blocks_digest
        return {"sha256": blocks_digest(self.cache, ids)}

    def buffer_(self, nbytes: int, device: str) -> dict:
        import torch

        from kvflow.connector.transport.nixl_agent import Agent, mem_type
        self.free()
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.agent = Agent("bench-dst")
        self.agent.register(self.buffer)
        mem, dev = mem_type(self.buffer)
        return {"addr": self.buffer.data_ptr(), "metadata": self.agent.metadata(), "mem": mem,
                "device_id": dev}

    def free(self) -> dict:
        if self.agent is not None:
            self.agent.close()
        self.agent = self.buffer = None
        return {}

    def serve(self) -> None:
        ops = {"make": self.make, "attach": self.attach, "recv": self.recv, "hold": self.hold,
               "zero": self.zero, "digest": self.digest, "buffer": self.buffer_,
               "free": self.free}
        while True:
            cmd = msgspec.msgpack.decode(self.ctl.recv())
            op = cmd.pop("op")
            if op == "close":
                break
            try:
                reply = ops[op](**cmd)
            except Exception as exc:  # noqa: BLE001 - reported to P, which raises it
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.ctl.send(msgspec.msgpack.encode(reply))
        self.free()
        if self.receiver is not None:
            self.receiver.close()
        self.ctl.send(msgspec.msgpack.encode({}))
        self.ctx.destroy(linger=0)


def main() -> int:
    peer = _Peer()
    print(json.dumps(peer.ports), flush=True)
    peer.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
