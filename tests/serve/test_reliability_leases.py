"""Blocks that a peer process accesses are never reused while that process exists (issue 14
kind 4), on an in-process P + D pair (tests/reliability_harness.py).

Push (P writes into D's blocks): a P the router declared dead (missed heartbeats: a slow
prefill) but whose process lives may still write the blocks D lent it, so D keeps them until
P's KVPushed, or until P's process is gone (D judges it as the router does: same host and pid
namespace), or -- for a P it cannot judge -- until ``kv_lease_s`` after the router declared it
dead. Pull (D reads P's blocks): P keeps sent blocks of a D declared dead until D's ack or the
lease, unless the router saw D's process exit. And P heartbeats between prefill chunks, so a
long prefill is not taken for a dead P. Served end to end in tests/serve/test_serve_leases.py."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvflow.connector import Peer
from kvflow.connector.messages import KVPushed
from kvflow.serve.protocol import Abort, Pair, Prefill, Rejected, Tokens, Unpair, decode
from kvflow.segments import host_id
from kvflow.serve.instance.prefill import PrefillInstance

from tests.reliability_harness import PD, FakeLink, make_instance
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of

A, B = TEXT[:40], TEXT[60:100]   # 40 tokens + 8 new ones: 3 blocks of 16 each


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def pair_d_with(pd: PD, peer_id: str, pid: int, peer_host_id: str) -> None:
    """The router's Pair to D, naming P's process (pid and host id)."""
    pd.d.on_pair(Pair(peer_id=peer_id, peer_role="prefill", peer_spec=pd.p.spec.to_dict(),
                      peer_num_blocks=pd.p.num_blocks, peer_pid=pid, peer_host_id=peer_host_id,
                      peer_fingerprint=pd.p.fingerprint),
                 [], None)
    assert pd.d.out.pop().ok


@pytest.fixture
def push():
    """P, a second P (both pushing into D) and a D of 3 blocks: one request fills it."""
    pd = PD(kv_connector="ipc-push", d_blocks=3, prefix=False)
    p2 = make_instance(PrefillInstance, "prefill", kv_connector="ipc-push")
    p2.connector.attach(Peer(pd.d.instance_id, pd.d.spec, pd.d.num_blocks,
                             **pd.d.receiver.export()), link=FakeLink())
    for p in (pd.p, p2):
        pair_d_with(pd, p.instance_id, os.getpid(), host_id())  # in this process: alive
    pd.p2 = p2
    yield pd
    assert not pd.d.lent and not pd.d.seqs and pd.free() == (pd.p.num_blocks, 3)
    p2.close()
    pd.close()


def run_on(pd: PD, p, req: str, prompt: list[int], alloc) -> KVPushed:
    """P ``p`` prefills ``req`` (the Prefill it got earlier or now) and pushes into D."""
    if not any(m.req_id == req for m in p.queue):
        p.on_prefill(Prefill(req_id=req, token_ids=prompt, decode_id=pd.d.instance_id,
                                     decode_block_ids=alloc.block_ids), [], None)
    p.work()
    done = decode(p.connector.links[pd.d.instance_id].frames.pop()[0])
    assert isinstance(done, KVPushed) and done.req_id == req and done.ok
    return done


def test_p_declared_dead_but_alive_keeps_its_lent_blocks_until_it_pushed(push):
    pd = push
    req_a, alloc_a = pd.allocate(A, req_id="a")
    pd.p.on_prefill(Prefill(req_id=req_a, token_ids=A, decode_id=pd.d.instance_id,
                                    decode_block_ids=alloc_a.block_ids), [], None)
    # P's prefill of A outlasts --dead-after-s: the router declares P dead and aborts A on D
    pd.d.on_abort(Abort(req_id=req_a, peer_dead=pd.p.instance_id, prefill_id=pd.p.instance_id), [], None)
    assert (end := pd.take(pd.d, Tokens)) == [] and req_a in pd.d.lent, end
    # the next request must not land on the blocks P is still writing
    _, busy = pd.allocate(B, req_id="b")
    assert isinstance(busy, Rejected) and busy.kind == "busy"
    assert busy.error == "requested 3 blocks but only 0 of 3 are free"
    pd.deliver(run_on(pd, pd.p, req_a, A, alloc_a))   # P's late writes, then its KVPushed
    assert req_a not in pd.d.lent and pd.d.allocator.num_free == 3
    req_b, alloc_b = pd.allocate(B, req_id="b2")     # served by the other P, token-identical
    pd.deliver(run_on(pd, pd.p2, req_b, B, alloc_b))
    pd.decode_all()
    toks = [m for m in pd.own(pd.p2, Tokens) + pd.own(pd.d, Tokens) if m.req_id == req_b]
    assert tokens_of(toks) == colocated(pd, B)  # p2's first token, then D's


@pytest.mark.parametrize("how", ["D sees the process gone", "the router saw it exit"])
def test_lent_blocks_come_back_at_once_when_the_writing_process_is_gone(push, how):
    pd = push
    gone = "p-gone"
    if how == "D sees the process gone":
        pair_d_with(pd, gone, dead_pid(), host_id())
    req, _ = pd.allocate(A)
    pd.d.on_abort(Abort(req_id=req, peer_dead=gone, prefill_id=gone,
                        peer_exited=how == "the router saw it exit"), [], None)
    assert req not in pd.d.lent and pd.d.allocator.num_free == 3


def test_a_p_d_cannot_judge_keeps_lent_blocks_for_the_lease_after_it_was_declared_dead(push):
    pd = push
    far = "p-far"
    pair_d_with(pd, far, 1, "another-boot/4026531836")  # another pid namespace: pids mean nothing
    pd.d.kv_lease_s = 0.3
    try:
        req, _ = pd.allocate(A)
        pd.d.on_abort(Abort(req_id=req, prefill_id=far), [], None)   # ended, P not declared dead
        time.sleep(0.4)
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent                                       # it may still write
        pd.d.on_abort(Abort(req_id=req, peer_dead=far, prefill_id=far), [], None)
        t_dead = time.monotonic()
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent                                       # the lease runs from now
        while req in pd.d.lent:
            assert time.monotonic() - t_dead < 2.0, "lent blocks never came back"
            time.sleep(0.05)
            pd.d.heartbeat(force=True)
        assert time.monotonic() - t_dead >= 0.3 and pd.d.allocator.num_free == 3
    finally:
        pd.d.kv_lease_s = 5.0


def test_unpair_of_a_p_the_router_saw_exit_gives_its_lent_blocks_back_at_once(push):
    pd, far = push, "p-far"
    pair_d_with(pd, far, 1, "another-boot/4026531836")  # D cannot judge it itself
    req, _ = pd.allocate(A)
    pd.d.on_abort(Abort(req_id=req, prefill_id=far), [], None)
    assert req in pd.d.lent
    pd.d.on_unpair(Unpair(peer_id=far, reason="exited", exited=True), [], None)
    assert req not in pd.d.lent and pd.d.allocator.num_free == 3
    assert far not in pd.d.lent.peer_pids                       # no lease renewals to it


def test_a_silent_remote_p_is_forgotten_a_lease_after_its_unpair(push, monkeypatch):
    """A connector whose P's may live on other hosts (nixl) cannot judge a silent P: what it
    keeps for it (a staging slot, lent blocks) comes back ``kv_lease_s`` after the router's
    Unpair, or never if it pairs again first."""
    pd, far = push, "p-far"
    monkeypatch.setattr(pd.d.receiver, "host_local", False)
    detached = []
    monkeypatch.setattr(pd.d.receiver, "detach", detached.append)
    pair_d_with(pd, far, 1, "another-boot/4026531836")
    pd.d.kv_lease_s = 0.3
    try:
        req, _ = pd.allocate(A)
        pd.d.on_abort(Abort(req_id=req, prefill_id=far), [], None)
        pd.d.on_unpair(Unpair(peer_id=far, reason="missed heartbeats"), [], None)
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent and detached == []               # it may still write
        pair_d_with(pd, far, 1, "another-boot/4026531836")       # it paired again: kept
        time.sleep(0.4)
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent and detached == [] and not pd.d.unpaired
        pd.d.on_unpair(Unpair(peer_id=far, reason="missed heartbeats"), [], None)
        t0 = time.monotonic()
        while req in pd.d.lent:
            assert time.monotonic() - t0 < 2.0, "lent blocks never came back"
            time.sleep(0.05)
            pd.d.heartbeat(force=True)
        assert time.monotonic() - t0 >= 0.3 and detached == [far]
        assert pd.d.allocator.num_free == 3
    finally:
        pd.d.kv_lease_s = 5.0


def test_pull_p_keeps_blocks_a_live_d_may_still_read_until_its_ack():
    pd = PD(prefix=False)
    try:
        req, alloc = pd.allocate(A)
        _, ready, _ = pd.prefill(req, A, alloc)
        held = pd.p.allocator.num_used
        assert held == 3
        # D declared dead by missed heartbeats (its process lives): P must not reuse the blocks
        pd.p.on_abort(Abort(req_id=req, peer_dead=pd.d.instance_id), [], None)
        assert pd.p.allocator.num_used == held and req in pd.p.pending
        pd.deliver(ready)                                 # D reads them and acks: now free
        assert pd.p.allocator.num_used == 0 and not pd.p.pending
        pd.decode_all()
        assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, A)
        req, alloc = pd.allocate(B)                       # D's process exited: free at once
        pd.prefill(req, B, alloc)
        pd.p.on_abort(Abort(req_id=req, peer_dead=pd.d.instance_id, peer_exited=True), [], None)
        assert pd.p.allocator.num_used == 0
        pd.d.on_abort(Abort(req_id=req, prefill_sent=False), [], None)
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()


@pytest.mark.parametrize("connector", ["ipc-pull", "ipc-push"])
def test_p_heartbeats_throughout_a_slow_prefill(connector, monkeypatch):
    """A 64-token prompt in 16-token chunks, each forward made 0.25 s slow: P's heartbeat
    thread beats every 0.2 s all along, inside the chunks too (issue 26; before issue 14:
    nothing for the whole prefill, then one beat between chunks)."""
    pd = PD(kv_connector=connector, prefix=False)
    try:
        monkeypatch.setenv("KVFLOW_FAULT_CHUNK_DELAY_S", "0.25")
        pd.p.cfg.max_num_batched_tokens = 16
        req, alloc = pd.allocate(TEXT[:64])
        # beats the thread makes (no router listens here: after 16 queued beats, SNDHWM, a send
        # is dropped, so beats_sent stops counting once set-up on loaded cores took > 3.2 s)
        made, beat = [], pd.p.beats.beat
        pd.p.beats.beat = lambda: (made.append(time.monotonic()), beat())[1]
        t0 = time.monotonic()
        _, sent, _ = pd.prefill(req, TEXT[:64], alloc)
        took, beats = time.monotonic() - t0, len([t for t in made if t >= t0])
        assert took >= 1.0 and beats >= int(took / pd.p.cfg.heartbeat_s) - 2, (took, beats)
        pd.deliver(sent)
        pd.decode_all()
        assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, TEXT[:64])
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()
