"""D's half of the data plane in the connector (:mod:`kvflow.connector.arrival`): what
``KVReceiver.on_message`` answers and sends for each message, on a receiver whose ``receive``
is scripted (the kinds' copies are tested in test_connector*.py, the served path in
test_reliability_*.py)."""

from __future__ import annotations

import time

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.blocks import BlockAllocator
from kvflow.connector import KVReceiver, Renewals, TransferError, TransferStats
from kvflow.connector.messages import KVAck, KVLayer, KVPushed, KVReady, LeaseRenew

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
STATS = TransferStats(blocks=2, payload_bytes=2 * SPEC.bytes_per_block, copy_ms=0.25)


class Scripted(KVReceiver):
    """``receive`` returns (or raises) ``self.result`` and records its calls."""
    name = "scripted"

    def __init__(self, **caps) -> None:
        super().__init__(SPEC)
        for k, v in caps.items():
            setattr(self, k, v)
        self.result, self.calls, self.sent, self.forgotten = STATS, [], [], []
        self.reply = lambda msg, peer: self.sent.append((msg, peer))
        self.allocator = BlockAllocator(8)
        self.keep(self.allocator, 1.0)

    def receive(self, header, frames, cache, dst_ids, peer_id=None):
        self.calls.append((header.req_id, list(dst_ids), peer_id))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def forget(self, req_id):
        self.forgotten.append(req_id)


def ready(req_id="r", t_start=0.0):
    return KVReady(req_id=req_id, src_block_ids=[0, 1], first_token=7, num_prompt_tokens=8,
                   t_start=t_start)


def test_a_complete_transfer_is_done_and_acked():
    rx = Scripted()
    a = rx.on_message(ready(t_start=time.time()), [], "p-1", [5, 6])
    assert (a.status, a.req_id, a.peer, a.stats, a.first_token) == ("done", "r", "p-1", STATS, 7)
    assert 0.0 <= a.transfer_ms < 5e3 and a.pushed == {} and rx.calls == [("r", [5, 6], "p-1")]
    assert rx.sent == [(KVAck(req_id="r", ok=True, error=""), "p-1")]


def test_a_request_d_cannot_receive_is_acked_with_an_error_and_ignored():
    rx = Scripted()
    a = rx.on_message(ready(), [], "p-1", None)
    assert a.status == "ignored" and rx.calls == []
    assert rx.sent == [(KVAck(req_id="r", ok=False, error="unknown or aborted request"), "p-1")]


def test_a_layerwise_part_waits_and_acks_ps_control_link():
    rx = Scripted()
    rx.result = None
    part = KVLayer(req_id="r", reply_to="p-ctl", layer_start=0, layer_stop=1, num_blocks=2)
    a = rx.on_message(part, [], "p-thread", [5, 6])
    assert (a.status, a.peer) == ("part", "p-ctl") and rx.sent == []
    assert rx.calls == [("r", [5, 6], "p-ctl")]


@pytest.mark.parametrize("acks", [True, False])
def test_a_failed_transfer_says_why_and_whether_the_blocks_may_be_reused(acks):
    rx = Scripted(acks=acks)
    rx.result = TransferError("frame 0 holds 12 bytes, the header says 16")
    a = rx.on_message(ready(), [], "p-1", [5, 6])
    assert (a.status, a.error, a.reusable) == (
        "failed", "frame 0 holds 12 bytes, the header says 16", not acks)
    assert a.exc is rx.result
    assert rx.sent == ([(KVAck(req_id="r", ok=False, error=a.error), "p-1")] if acks else [])


def test_ps_lease_is_checked_before_reading_its_memory_and_a_renewal_extends_it():
    rx = Scripted(reads_peer_memory=True)
    a = rx.on_message(ready(t_start=time.time() - 0.9), [], "p-1", [5, 6])  # 0.9 > 0.8 x 1 s
    assert (a.status, a.error) == (
        "failed", "P's lease of 1 s on the sent blocks expired before D could read them")
    assert rx.calls == []  # P may have reused the blocks: not read
    rx.renewals = Renewals(None, gap_s=0.8)
    rx.renewals.want(["p-1"], ["r2"])
    t_start = time.time() - 0.9
    rx.renewals.record("p-1", ["r2"], t_start + 0.5)
    assert rx.on_message(ready("r2", t_start), [], "p-1", [5, 6]).status == "done"


def test_a_held_transfer_is_taken_when_due_or_dropped_with_an_ack():
    rx = Scripted()
    assert rx.on_message(ready(), [], "p-1", [5, 6], delay_s=30).status == "part"
    assert rx.on_message(ready(), [], "p-1", [5, 6]).status == "ignored"  # already in flight
    assert rx.due(time.monotonic()) == [] and rx.calls == []
    (a,) = rx.due(time.monotonic() + 31)
    assert a.status == "done" and rx.calls == [("r", [5, 6], "p-1")] and not rx.inflight
    rx.sent.clear()
    rx.on_message(ready("r3"), [], "p-1", [5, 6], delay_s=30)
    assert rx.end("r3", [5, 6], "", may_write=True) is False  # an acking kind lends nothing
    assert rx.sent[-1] == (KVAck(req_id="r3", ok=False, error="aborted"), "p-1")
    assert rx.forgotten == ["r3"] and not rx.inflight


def test_blocks_p_may_write_stay_lent_until_its_kvpushed():
    rx = Scripted(acks=False, peer_writes=True)
    blocks = rx.allocator.allocate(3)
    assert rx.end("r", blocks, "aborted", may_write=True) is True
    assert rx.lent["r"].blocks == blocks and rx.allocator.num_free == 5
    a = rx.on_message(KVPushed(req_id="r", ok=True), [], "p-1", None)
    assert a.status == "ignored" and "r" not in rx.lent and rx.allocator.num_free == 8
    assert rx.calls == [] and rx.sent == []
    rx.on_message(KVPushed(req_id="q", ok=True), [], "p-1", [1], delay_s=30)
    assert rx.end("q", [1], "", may_write=True) is False  # P's last word is in: not lent


def test_the_loops_renewals_go_to_every_peer_and_are_recorded():
    rx = Scripted()
    rx.renewals = Renewals(None, gap_s=0.8)
    rx.renewals.want(["p-1", "p-2"], ["r"])
    t0 = time.time()
    rx.renew(["p-1", "p-2"], ["r"])
    assert rx.sent == [(LeaseRenew(req_ids=["r"]), "p-1"), (LeaseRenew(req_ids=["r"]), "p-2")]
    assert rx.renewals.renewed_since("r", "p-2", t0 - 0.1) >= t0


def test_a_message_for_p_is_dropped():
    rx = Scripted()
    assert rx.on_message(KVAck(req_id="r", ok=True), [], "p-1", [5]).status == "ignored"
    assert rx.calls == [] and rx.sent == []
