"""P's lease links (:class:`kvflow.connector.LeaseLinks`): one DEALER per paired D, named by P's
id, connected to D's lease socket; D's renewals arrive on it, :meth:`drain` reads every link,
:meth:`drop` and :meth:`close` close them."""

from __future__ import annotations

import time

import pytest
import zmq

from kvflow.connector import LeaseLinks, Renewals, lease_socket
from kvflow.connector.messages import LeaseRenew, decode


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _renew_until_sent(renewals: Renewals, n: int = 1, timeout_s: float = 5.0) -> None:
    t_end = time.monotonic() + timeout_s
    while renewals.sent < n:  # the DEALER's connect completes asynchronously
        assert time.monotonic() < t_end, "no renewal reached P's lease link"
        renewals.send()
        time.sleep(0.01)


def test_links_connect_by_p_id_and_drain_reads_the_renewals_of_every_d(ctx):
    links = LeaseLinks("p-1")
    d_socks = [lease_socket(ctx, "127.0.0.1") for _ in range(2)]
    try:
        for i, (_, port) in enumerate(d_socks):
            sock = links.connect(ctx, f"d-{i}", f"tcp://127.0.0.1:{port}")
            assert sock.type == zmq.DEALER and sock.getsockopt(zmq.IDENTITY) == b"p-1"
            assert sock.getsockopt(zmq.LINGER) == 0
        assert list(links) == ["d-0", "d-1"]
        for i, (sock, _) in enumerate(d_socks):
            r = Renewals(sock, gap_s=1.0)
            r.want(["p-1"], [f"req-{i}"])  # D addresses P by the link's identity
            _renew_until_sent(r)
        seen: list[list[str]] = []

        def read(sock):
            while sock.poll(2000):
                msg = decode(sock.recv_multipart()[0])
                assert isinstance(msg, LeaseRenew)
                seen.append(msg.req_ids)
                if not sock.poll(0):
                    return
        links.drain(read)
        assert sorted(seen) == [["req-0"], ["req-1"]]
    finally:
        links.close()
        for sock, _ in d_socks:
            sock.close(0)


def test_drop_and_close_close_the_links_and_return_them(ctx):
    links = LeaseLinks("p-1")
    d_sock, port = lease_socket(ctx, "127.0.0.1")
    try:
        a = links.connect(ctx, "d-a", f"tcp://127.0.0.1:{port}")
        b = links.connect(ctx, "d-b", f"tcp://127.0.0.1:{port}")
        assert links.drop("d-a") is a and a.closed and list(links) == ["d-b"]
        assert links.drop("d-a") is None  # not linked (any more): nothing to close
        calls: list = []
        links.drain(calls.append)
        assert calls == [b]
        assert links.close() == [b] and b.closed and list(links) == []
        assert links.close() == []
    finally:
        d_sock.close(0)
