"""Failure kinds 1, 2, 5 and 7 on an in-process P + D pair (tests/reliability_harness.py):
prefix hit on D moves only the missing blocks, by logical position; nothing to move still
completes; abort at every stage and leases give every block back; over-capacity and busy
admission. Every test ends with P's and D's free-block counts at their start."""

from __future__ import annotations

import time

import pytest
import torch

from kvflow.connector.messages import KVAck, KVReady, LeaseRenew
from kvflow.serve.protocol import Rejected, Tokens

from tests.reliability_harness import PD, every_block_back, greedy_tokens, time_out_on_d

BS = 16
TEXT = list(range(1, 200))  # token ids 1..199 (byte tokenizer: all in the vocabulary)


@pytest.fixture(scope="module")
def pd():
    h = PD()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def blocks_come_back(pd):
    yield from every_block_back(pd)


def colocated(pd, token_ids, max_tokens=8):
    """Greedy tokens of one engine doing prefill and decode in one cache (the reference)."""
    assert pd.d.spec.block_size == BS
    return greedy_tokens(pd.d.model, pd.d.spec, token_ids, max_tokens)


def tokens_of(msgs):
    assert msgs[-1].finished and msgs[-1].finish_reason == "length", msgs[-1]
    return [t for m in msgs for t in m.token_ids]


def test_prefix_hit_moves_exactly_the_missing_blocks_in_logical_order(pd):
    first = TEXT[:32]
    alloc_a, _, hdr_a, toks_a = pd.run(first)
    assert alloc_a.num_cached_blocks == 0 and len(hdr_a.src_block_ids) == 2   # k = 0: all move
    assert tokens_of(toks_a) == colocated(pd, first)
    d_a = alloc_a.block_ids
    # 80-token prompt sharing logical blocks 0-1 with the first: D holds them, k = 2.
    prompt = first + TEXT[100:148]
    req, alloc = pd.allocate(prompt)
    assert alloc.num_cached_blocks == 2 and alloc.block_ids[:2] == d_a[:2]
    p_table, hdr, frames = pd.prefill(req, prompt, alloc)
    assert isinstance(hdr, KVReady) and len(p_table) == 5
    assert hdr.src_block_ids == p_table[2:5]                                   # P's logical 2,3,4
    d_table = alloc.block_ids
    before = [t[d_table[:2]].clone() for t in pd.d.cache.tensors()]
    pd.deliver(hdr, frames)
    for logical in range(5):  # every element of D's logical block = P's logical block
        for t, (dt, pt) in enumerate(zip(pd.d.cache.tensors(), pd.p.cache.tensors())):
            assert torch.equal(dt[d_table[logical]], pt[p_table[logical]]), (logical, t)
    # D's cached blocks 0-1 were not written by the transfer.
    assert all(torch.equal(t[d_table[:2]], b) for t, b in zip(pd.d.cache.tensors(), before))
    pd.decode_all()
    toks = pd.take(pd.d, Tokens)
    assert toks[0].index == 0 and "blocks" not in toks[0].kvflow  # P's first token
    assert toks[1].kvflow["blocks"] == 3 and toks[1].kvflow["cached_blocks"] == 2
    assert tokens_of(toks) == colocated(pd, prompt)


def test_fully_cached_prompt_moves_nothing_and_completes_within_1s(pd):
    prompt = TEXT[:48]
    pd.run(prompt)
    req, alloc = pd.allocate(prompt)                                           # k = all
    _, hdr, frames = pd.prefill(req, prompt, alloc)
    assert alloc.num_cached_blocks == 3 and hdr.src_block_ids == []
    t0 = time.monotonic()
    pd.deliver(hdr, frames)                     # D gets its completion: it decodes at once
    assert time.monotonic() - t0 < 1.0 and pd.d.has_work()
    pd.d.work()
    second = pd.d.out[-1]                       # D's first message: the second token
    assert isinstance(second, Tokens) and second.req_id == req and second.index == 1
    assert second.kvflow["blocks"] == 0 and second.kvflow["payload_bytes"] == 0
    pd.decode_all()
    assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, prompt)


def test_prompt_shorter_than_a_block_moves_its_one_partial_block(pd):
    req, alloc = pd.allocate([256, 5, 6])
    _, hdr, frames = pd.prefill(req, [256, 5, 6], alloc)
    assert alloc.num_cached_blocks == 0 and len(hdr.src_block_ids) == 1
    t0 = time.monotonic()
    pd.deliver(hdr, frames)
    assert time.monotonic() - t0 < 1.0 and pd.d.has_work()  # the KV is in: D decodes
    pd.decode_all()
    assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, [256, 5, 6])


def test_abort_while_queued_on_p(pd):
    req, alloc = pd.allocate(TEXT[:40])
    from kvflow.serve.protocol import Prefill
    pd.p.on_prefill(Prefill(req_id=req, token_ids=TEXT[:40], decode_id=pd.d.instance_id), [], None)
    pd.abort(req)
    assert not pd.p.has_work()


def test_abort_after_p_sent_holds_until_d_acks_then_late_transfer_is_ignored(pd):
    req, alloc = pd.allocate(TEXT[:40])
    table, hdr, frames = pd.prefill(req, TEXT[:40], alloc)
    pd.abort(req)
    assert pd.p.pending[req].blocks == table      # D may be reading: P still holds them
    pd.deliver(hdr, frames)                        # the late KVReady reaches D
    assert not pd.own(pd.d, Tokens)                # ignored: no token for an aborted request
    assert req not in pd.p.pending                 # D's "not ok" ack freed P's blocks


def test_abort_with_dead_peer_frees_p_at_once(pd):
    """D's process exited (the router saw it): nobody reads P's blocks any more. A D declared
    dead only for missed heartbeats may still read them: tests/serve/test_reliability_leases.py."""
    req, alloc = pd.allocate(TEXT[:40])
    pd.prefill(req, TEXT[:40], alloc)
    pd.abort(req, peer_dead=pd.d.instance_id, peer_exited=True)
    assert req not in pd.p.pending


def test_abort_mid_transfer_and_while_decoding(pd, monkeypatch):
    monkeypatch.setenv("KVFLOW_FAULT_RECEIVE_DELAY_S", "30")
    req, alloc = pd.allocate(TEXT[:40])
    pd.deliver(*pd.prefill(req, TEXT[:40], alloc)[1:])
    assert req in pd.d.receiver.inflight and pd.d.seqs[req].req.state.name == "RECEIVING"
    pd.d.on_abort(__import__("kvflow.serve.protocol").serve.protocol.Abort(req_id=req), [], None)
    acks = pd.take(pd.d, KVAck)
    assert [(a.req_id, a.ok) for a in acks] == [(req, False)]
    pd.p.on_data(acks[0], [], None)
    pd.p.on_abort(__import__("kvflow.serve.protocol").serve.protocol.Abort(req_id=req), [], None)
    monkeypatch.delenv("KVFLOW_FAULT_RECEIVE_DELAY_S")
    req, alloc = pd.allocate(TEXT[:40], max_tokens=50)
    pd.deliver(*pd.prefill(req, TEXT[:40], alloc)[1:])
    pd.d.work()
    assert pd.d.seqs[req].req.state.name == "DECODING"
    pd.abort(req)
    pd.take(pd.d, Tokens)


def test_lease_expires_without_renewal_and_holds_with_it(pd):
    pd.p.kv_lease_s = pd.d.kv_lease_s = 0.3
    try:
        req, alloc = pd.allocate(TEXT[:40])
        table, hdr, frames = pd.prefill(req, TEXT[:40], alloc)
        for _ in range(4):                      # D renews every heartbeat: P keeps the blocks
            time.sleep(0.1)
            pd.d.heartbeat(force=True)
            renewals = [m for m in pd.d.out if isinstance(m, LeaseRenew)]
            assert renewals and req in renewals[-1].req_ids
            pd.renew()
            pd.p.heartbeat(force=True)
            assert req in pd.p.pending
        time.sleep(0.35)                        # no renewal: the lease ends, P frees
        pd.p.heartbeat(force=True)
        assert req not in pd.p.pending
        pd.deliver(hdr, frames)                 # D would read reused blocks: refuses instead
        (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
        assert end.finish_reason == "error" and "lease of 0.3 s" in end.error
    finally:
        pd.p.kv_lease_s = pd.d.kv_lease_s = 5.0


def test_d_frees_a_request_whose_kv_never_comes(pd):
    try:
        req, end = time_out_on_d(pd, TEXT[:40])
        assert end.error == "no KV from prefill within 0.1 s"
    finally:
        pd.d.receive_timeout_s = 120.0


def test_over_capacity_refused_before_any_transfer_and_busy_when_full(pd):
    _, rej = pd.allocate(TEXT[:100], max_tokens=156)       # 256 tokens = max_model_len: fits
    assert not isinstance(rej, Rejected)
    pd.abort(rej.req_id)
    _, rej = pd.allocate(TEXT[:100], max_tokens=157)
    assert isinstance(rej, Rejected) and rej.kind == "capacity"
    assert rej.error == "prompt (100 tokens) + max_tokens (157) = 257 exceeds max_model_len=256"
    assert not pd.link.frames
    held = [pd.allocate(TEXT[:100], max_tokens=156)[0] for _ in range(3)]  # 16 blocks each
    _, rej = pd.allocate(TEXT[:20], max_tokens=10)
    assert isinstance(rej, Rejected) and rej.kind == "busy"
    assert rej.error == "requested 2 blocks but only 0 of 48 are free"
    for r in held:
        pd.abort(r)


def test_prefix_hit_over_tcp_moves_only_the_missing_blocks():
    from kvflow.connector.messages import KVData
    pd = PD(kv_connector="tcp")
    try:
        first = TEXT[:32]
        pd.run(first)
        prompt = first + TEXT[100:148]
        req, alloc = pd.allocate(prompt)
        p_table, hdr, frames = pd.prefill(req, prompt, alloc)
        assert alloc.num_cached_blocks == 2 and isinstance(hdr, KVData) and hdr.num_blocks == 3
        assert not pd.p.allocator.num_used               # tcp: P's blocks freed at send
        pd.deliver(hdr, frames)
        for logical in range(2, 5):
            for dt, pt in zip(pd.d.cache.tensors(), pd.p.cache.tensors()):
                assert torch.equal(dt[alloc.block_ids[logical]], pt[p_table[logical]])
        pd.decode_all()
        assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, prompt)
        pd.d.prefix.clear()
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks) and not pd.p.pending
    finally:
        pd.close()


def test_one_d_paired_with_two_p_reads_each_request_from_its_own_p():
    """D paired with P1 then P2 keeps both mappings: a request prefilled by either P is read
    from that P's cache (not from the last paired one) and is token-identical."""
    import os

    from kvflow.connector import Peer
    from kvflow.serve.protocol import Pair, Prefill, decode
    from kvflow.serve.instance.prefill import PrefillInstance

    from tests.reliability_harness import FakeLink, make_instance
    pd = PD(prefix=False)
    p2 = make_instance(PrefillInstance, "prefill")
    try:
        p2.connector.attach(Peer(pd.d.instance_id, pd.d.spec, pd.d.num_blocks), link=FakeLink())
        pd.d.on_pair(Pair(peer_id=p2.instance_id, peer_role="prefill", peer_spec=p2.spec.to_dict(),
                          peer_num_blocks=p2.num_blocks, shm_name=p2.connector.export()["shm_name"],
                          peer_pid=os.getpid(), peer_fingerprint=p2.fingerprint), [], None)
        assert pd.d.out[-1].ok and sorted(pd.d.receiver.peers) == sorted([pd.p.instance_id,
                                                                          p2.instance_id])
        for p, prompt in ((pd.p, TEXT[:40]), (p2, TEXT[50:120]), (pd.p, TEXT[5:90])):
            req, alloc = pd.allocate(prompt)
            p.on_prefill(Prefill(req_id=req, token_ids=prompt, decode_id=pd.d.instance_id,
                                 decode_block_ids=alloc.block_ids), [], None)
            p.work()
            hdr = decode(p.connector.links[pd.d.instance_id].frames.pop()[0])
            pd.d.on_data(hdr, [], p.instance_id.encode())
            (ack,) = pd.take(pd.d, KVAck)
            p.on_data(ack, [], None)
            pd.decode_all()
            toks = pd.own(p, Tokens) + pd.own(pd.d, Tokens)  # this P's first token, then D's
            assert tokens_of(toks) == colocated(pd, prompt), p.instance_id
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks) and p2.allocator.num_used == 0
    finally:
        p2.close()
        pd.close()
