"""A P-side DEALER connected to a D-side ROUTER on a free loopback port: the data link of the
transfer tests, without a server."""

from __future__ import annotations

import pytest
import zmq

from kvflow.serve.protocol import decode


@pytest.fixture
def zmq_link():
    """(p_sock, d_sock): what P sends on ``p_sock`` arrives on ``d_sock``."""
    ctx = zmq.Context()
    d_sock = ctx.socket(zmq.ROUTER)
    port = d_sock.bind_to_random_port("tcp://127.0.0.1")
    p_sock = ctx.socket(zmq.DEALER)
    p_sock.connect(f"tcp://127.0.0.1:{port}")
    yield p_sock, d_sock
    p_sock.close(0)
    d_sock.close(0)
    ctx.term()


def recv(d_sock):
    """(decoded header, payload frames) of the next message D gets, waiting at most 5 s."""
    assert d_sock.poll(5000), "no frames arrived within 5 s"
    _, head, *payload = d_sock.recv_multipart(copy=False)
    return decode(head), payload
