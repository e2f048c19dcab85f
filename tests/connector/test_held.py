"""P's held-until-ack state (:mod:`kvflow.connector.held`): what ``hold``, D's ack, a renewal and
the lease's end free, and the lines P logs, on a sender with no kind behind it."""

from __future__ import annotations

from kvflow.connector import Freed, Kept
from kvflow.connector.held import HeldSide
from kvflow.connector.messages import KVAck, LeaseRenew
from kvflow.serve.protocol import Abort


class Sender(HeldSide):
    instance_id = "p-0"

    def __init__(self):
        self.released = []

    def release(self, req_id):
        self.released.append(req_id)


def test_hold_keeps_what_d_reads_and_answers_what_frees_now():
    s = Sender()
    assert s.hold("a", [3, 4], None) == [3, 4] and "a" not in s.held       # no ack comes
    assert s.hold("b", [5], Kept([], keep=b"buf")) == [5]
    assert s.held["b"].blocks == [] and s.held["b"].keep == b"buf"
    assert s.hold("c", [6, 7], Kept([6, 7])) == []
    assert s.held["c"].blocks == [6, 7]


def test_ack_frees_the_held_blocks_and_names_a_drop():
    s = Sender()
    s.hold("r", [1, 2], Kept([1, 2]))
    s.hold("q", [9], Kept([9]))
    assert s.on_message(KVAck(req_id="r", ok=True), [], "d-0") == [Freed("r", [1, 2], "")]
    assert s.on_message(KVAck(req_id="q", ok=False, error="aborted"), [], "d-0") == [
        Freed("q", [9], "p-0: decode dropped q: aborted", "warning")]
    assert s.held == {} and s.released == ["r", "q"]
    assert s.on_message(KVAck(req_id="r", ok=True), [], "d-0") == [Freed("r", [], "")]


def test_renewal_restarts_the_lease_and_expiry_frees_the_rest():
    s = Sender()
    s.hold("r", [1], Kept([1]))
    s.hold("q", [2], Kept([2]))
    s.held["r"].since = s.held["q"].since = 100.0
    assert s.on_message(LeaseRenew(req_ids=["r", "gone"]), [], "d-0") == []
    assert s.held["r"].since > 100.0 and s.held["q"].since == 100.0
    now = s.held["r"].since + 1.0
    assert s.expire(1.5, now=now) == [
        Freed("q", [2], "p-0: no ack or lease renewal for q in 1.5 s; blocks freed", "error")]
    assert list(s.held) == ["r"] and s.released == ["q"]
    assert s.expire(1.5, now=now + 1.0) == [
        Freed("r", [1], "p-0: no ack or lease renewal for r in 1.5 s; blocks freed", "error")]


def test_a_message_that_is_not_ps_is_none_and_drop_frees():
    s = Sender()
    assert s.on_message(Abort(req_id="x"), [], None) is None
    s.hold("r", [4], Kept([4]))
    assert s.drop("r") == [4] and s.drop("r") == [] and s.released == ["r", "r"]
    assert isinstance(Kept([1]).since, float)
