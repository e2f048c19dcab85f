"""D's lease renewals (:class:`kvflow.connector.lease.Renewals`, sent by D's heartbeat thread on
its lease socket): only renewals that left for a connected P count, a gap in them ends the
lease as D judges it, and P reads the renewals that came during a long prefill before it judges
a lease. Served end to end in tests/serve/test_lease_thread.py."""

from __future__ import annotations

import time

import pytest
import zmq

from kvflow.connector.messages import LeaseRenew
from kvflow.serve.protocol import decode
from kvflow.connector import Renewals, lease_socket

from tests.reliability_harness import PD
from tests.serve.test_reliability_pd import TEXT


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_only_renewals_that_left_for_a_connected_p_count(ctx):
    sock, port = lease_socket(ctx, "127.0.0.1")
    r = Renewals(sock, gap_s=4.0)
    r.want(["p-1"], ["r1", "r2"])
    t0 = time.time()
    assert r.send() == 0 and r.sent == 0           # p-1 not connected: EHOSTUNREACH, not counted
    assert r.renewed_since("r1", "p-1", t0 - 1) == 0.0
    p = ctx.socket(zmq.DEALER)
    p.setsockopt(zmq.IDENTITY, b"p-1")
    p.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while r.send() == 0:                            # until the connection is up
        assert time.monotonic() < deadline, "P never connected"
        time.sleep(0.02)
    assert p.poll(5000)
    assert decode(p.recv()) == LeaseRenew(req_ids=["r1", "r2"])
    left = r.renewed_since("r1", "p-1", t0)
    assert t0 <= left <= time.time()
    assert r.renewed_since("r1", "p-2", t0) == 0.0   # renewed with p-1 only
    assert r.renewed_since("r1", None, t0) == left
    r.want(["p-1"], ["r2"])                           # r1 ended on D: its record goes
    assert r.renewed_since("r1", "p-1", t0) == 0.0 and r.renewed_since("r2", "p-1", t0) == left
    p.close(0)
    sock.close(0)


def test_a_gap_in_the_renewals_ends_the_lease_a_later_renewal_renews_nothing():
    r = Renewals(None, gap_s=1.0)
    r.want(["p"], ["r"])
    for t in (100.0, 100.5, 101.2):                   # gaps < 1 s: one run
        r.record("p", ["r"], t)
    assert r.renewed_since("r", "p", 100.2) == 101.2  # sent at 100.2, renewed through 101.2
    r.record("p", ["r"], 102.5)                       # 1.3 s gap: P may have freed at 101.2 + lease
    assert r.renewed_since("r", "p", 100.2) == 0.0    # (before, D counted this renewal)
    assert r.renewed_since("r", "p", 101.8) == 102.5  # a send after the gap: the new run holds
    assert r.renewed_since("r", "p", 103.0) == 0.0    # nothing left since that send
    r.record("p", ["gone"], 103.0)                    # a request D no longer reads: not recorded
    assert r.renewed_since("gone", "p", 102.9) == 0.0


def test_p_reads_renewals_that_came_during_a_long_prefill_before_a_lease_ends(ctx):
    pd = PD(prefix=False, lease_s=0.3)
    sock, port = lease_socket(ctx, "127.0.0.1")
    r = Renewals(sock, gap_s=0.24)
    try:
        pd.p._lease_link(pd.d.instance_id, f"tcp://127.0.0.1:{port}")
        req, alloc = pd.allocate(TEXT[:40])
        table, hdr, frames = pd.prefill(req, TEXT[:40], alloc)
        assert req in pd.p.pending
        r.want([pd.p.instance_id], [req])
        t_end = time.monotonic() + 0.9                # 3 leases of renewals P's loop never polls
        while time.monotonic() < t_end:               # (its loop is in a long prefill)
            r.send()
            time.sleep(0.05)
        assert r.sent >= 3, "no renewal reached P's lease link"
        pd.p._expire()                                # reads them first: the lease holds
        assert req in pd.p.pending and pd.p.allocator.num_free == pd.p.num_blocks - len(table)
        time.sleep(0.4)                               # renewals stop: the lease ends
        pd.p._expire()
        assert req not in pd.p.pending and pd.p.allocator.num_free == pd.p.num_blocks
        pd.abort(req)
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()
        sock.close(0)
