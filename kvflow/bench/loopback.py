"""A ZMQ DEALER->ROUTER link on 127.0.0.1, as P's and D's halves talk in the transfer bench, and
the ``tcp`` connector's same-run ceiling over it: a plain zero-copy send of the payload."""

from __future__ import annotations

from .timing import time_calls


def link():
    """``(dealer, router)``: P's and D's ends of a fresh loopback link (LINGER 0)."""
    import zmq
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.ROUTER)
    port = d.bind_to_random_port("tcp://127.0.0.1")
    p = ctx.socket(zmq.DEALER)
    p.connect(f"tcp://127.0.0.1:{port}")
    for s in (p, d):
        s.setsockopt(zmq.LINGER, 0)
    return p, d


def loopback_ceiling(nbytes: int, *, warmup: int, reps: int) -> list[float]:
    """Seconds per plain ZMQ send+receive of ``nbytes`` (one frame, zero-copy) over loopback TCP."""
    import torch
    p, d = link()
    payload = torch.ones(nbytes, dtype=torch.uint8).numpy()

    def once():
        p.send(memoryview(payload), copy=False)
        _, frame = d.recv_multipart(copy=False)
        assert len(frame.buffer) == nbytes
    try:
        return time_calls([once], warmup=warmup, reps=reps)
    finally:
        p.close()
        d.close()
