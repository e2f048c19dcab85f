"""Failure kinds of issue 26 over the ``nixl`` connector, on in-process P + D pairs
(tests/reliability_harness.py) whose agents talk over UCX's TCP transport: a WRITE failing after
P's first token went out (with prefix caching, with max_tokens 1), a prompt one token over a
staging slot, a lost ``free`` notification and one that comes before P's write, a P and a D of
one cluster in other nixl modes, a D whose agent P cannot load, and an instance paired anew
with the same agent metadata. Each ends in a refusal with its exact
message or tokens identical to colocated, with every block back on both sides; every wait is
bounded (``SLOT_TIMEOUT_S`` is cut to 0.3 s where a test waits it out). A D killed mid-WRITE
over staged nixl is in tests/test_reliability_nixl_kill.py."""

from __future__ import annotations

import time

import pytest

from kvflow.connector import Peer
from kvflow.connector.nixl_agent import nixl_available, tcp_tls
from kvflow.protocol import Abort, Pair, PairResult, Prefill, Rejected, Tokens, decode
from kvflow.serve.decode import DecodeInstance
from kvflow.serve.prefill import PrefillInstance

from .reliability_harness import PD, every_block_back, make_instance
from .test_reliability_pd import TEXT, colocated, tokens_of

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
MARK = [7, 7, 7]  # prompts holding this run get KVFLOW_FAULT_WRITE_FAIL
CONFIG = {"direct": {"mode": "direct", "layers_per_copy": 1},
          "staged": {"mode": "staged", "layers_per_copy": 1, "staging_slots": 1}}


@pytest.fixture(scope="module", params=["direct", "staged"])
def pd(request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", tcp_tls())
        h = PD(kv_connector="nixl", kv_connector_config=CONFIG[request.param], prefix=True,
               layerwise_min_tokens=0)  # nixl's default: WRITEs per layer while P prefills
    h.mode = request.param
    yield h
    h.close()


@pytest.fixture(autouse=True)
def blocks_come_back(request):
    if "pd" not in request.fixturenames:
        yield
        return
    yield from every_block_back(request.getfixturevalue("pd"))


def _fail_a_write(pd, prompt, monkeypatch, max_tokens=8):
    """P posts the first WRITE (layer 0) of ``prompt``, drops the rest and fails the request
    after its first token went out (``KVFLOW_FAULT_WRITE_FAIL``); D gets P's KVPushed(ok=False).
    Returns (P's tokens, P's Rejected, D's last Tokens, D's Allocated)."""
    monkeypatch.setenv("KVFLOW_FAULT_WRITE_FAIL", "7,7,7")
    req, alloc = pd.allocate(prompt, max_tokens)
    _, header, frames = pd.prefill(req, prompt, alloc)
    monkeypatch.delenv("KVFLOW_FAULT_WRITE_FAIL")
    first = [m for m in pd.own(pd.p, Tokens) if m.req_id == req]
    (rejected,) = [m for m in pd.own(pd.p, Rejected) if m.req_id == req]
    assert not header.ok
    pd.deliver(header, frames)
    (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
    return first, rejected, end, alloc


def _failed_write_error(pd):
    return (f"prefill failed on {pd.p.instance_id}: NIXL WRITE of layers [1, 2) to "
            f"{pd.d.instance_id} failed: injected by KVFLOW_FAULT_WRITE_FAIL")


def test_a_write_failing_after_the_first_token_is_an_error_and_never_a_prefix_hit(
        pd, monkeypatch):
    prompt = MARK + TEXT[:37]
    first, rejected, end, _ = _fail_a_write(pd, prompt, monkeypatch)
    assert [t for m in first for t in m.token_ids] == colocated(pd, prompt)[:1]
    assert rejected.kind == "error" and rejected.error == _failed_write_error(pd)
    assert end.finished and end.finish_reason == "error" and end.token_ids == []
    assert end.error == ("KV transfer failed: prefill could not write the KV over NIXL: "
                         + _failed_write_error(pd))
    assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)  # D cached none of them
    alloc, _, _, toks = pd.run(prompt)
    assert alloc.num_cached_blocks == 0
    assert tokens_of(toks) == colocated(pd, prompt)


def test_a_write_failing_on_a_prefix_hit_keeps_only_the_good_prefix(pd, monkeypatch):
    base = TEXT[:32]
    pd.run(base)  # two full blocks in D's prefix cache
    prompt = base + MARK + TEXT[100:145]
    first, _, end, alloc = _fail_a_write(pd, prompt, monkeypatch)
    assert alloc.num_cached_blocks == 2
    assert [t for m in first for t in m.token_ids] == colocated(pd, prompt)[:1]
    assert end.finish_reason == "error" and end.error.endswith(_failed_write_error(pd))
    again, _, header, toks = pd.run(prompt)
    assert again.num_cached_blocks == 2 and header.num_blocks == 3  # only the missing move
    assert tokens_of(toks) == colocated(pd, prompt)


def test_max_tokens_1_answers_with_ps_token_and_d_frees_on_the_failed_write(pd, monkeypatch):
    prompt = MARK + TEXT[50:80]
    first, _, end, _ = _fail_a_write(pd, prompt, monkeypatch, max_tokens=1)
    assert [t for m in first for t in m.token_ids] == colocated(pd, prompt, 1)
    assert end.finish_reason == "error" and end.token_ids == []
    assert not pd.d.seqs and pd.d.free_blocks() == pd.d.num_blocks - len(pd.d.prefix)


def test_an_instance_paired_anew_with_the_same_agent_metadata_serves_the_same_tokens(
        pd, monkeypatch):
    """D and then P get the router's Pair again (each was declared dead and came back: the
    same processes, the same agent metadata). Staged, D's ``slot`` notice reaches P's agent
    before P re-attaches, and P drops it with the old pairing's notices (a stale ``slot``
    could name another P's slot): the first request fails after SLOT_TIMEOUT_S (exact message),
    D answers that failure with its slot again, and the next requests are token-identical."""
    import kvflow.connector.nixl_writer as nw
    monkeypatch.setattr(nw, "SLOT_TIMEOUT_S", 0.3)
    prompt = TEXT[20:60]
    want = colocated(pd, prompt)
    assert tokens_of(pd.run(prompt)[3]) == want
    pd.d.on_pair(Pair(peer_id=pd.p.instance_id, peer_role="prefill",
                      peer_spec=pd.p.spec.to_dict(), peer_num_blocks=pd.p.num_blocks,
                      peer_connector_md=pd.p.connector.export()["connector_md"],
                      peer_fingerprint=pd.p.fingerprint), [], None)
    assert pd.own(pd.d, PairResult)[-1].ok
    agent = pd.p.connector.agent
    deadline = time.monotonic() + 5
    while pd.mode == "staged" and not any(m.startswith(b"slot ") for ms in agent.notifs.values()
                                          for m in ms):
        assert time.monotonic() < deadline, "D's slot notice never reached P's agent"
        agent.progress()
        time.sleep(0.01)
    pd.p.connector.attach(Peer(pd.d.instance_id, pd.d.spec, pd.d.num_blocks,
                               **pd.d.receiver.export()), link=pd.link)
    if pd.mode == "staged":
        req, alloc = pd.allocate(prompt)
        _, header, frames = pd.prefill(req, prompt, alloc)
        assert header.error == (f"prefill failed on {pd.p.instance_id}: decode instance "
                                f"{pd.d.instance_id} assigned this prefill instance no staging "
                                f"slot within 0.3 s")
        pd.deliver(header, frames)
        assert pd.own(pd.d, Tokens)[-1].finish_reason == "error"
        pd.own(pd.p, Rejected)
    for _ in range(2):
        assert tokens_of(pd.run(prompt)[3]) == want


def test_a_d_whose_agent_p_cannot_load_is_never_paired_and_a_prefill_naming_it_is_refused(pd):
    """A router Pair naming a D whose NIXL agent metadata P cannot load (a D P cannot map): P
    answers PairResult(ok=False) naming it, holds nothing for it, and a Prefill naming that D
    is refused with P's exact message; the paired D serves on."""
    import msgspec

    from kvflow.protocol import decode_agent_info, encode_agent_info
    info = decode_agent_info(pd.d.receiver.export()["connector_md"])
    bad = encode_agent_info(msgspec.structs.replace(info, metadata=b"not an agent's metadata"))
    gone = "d-unmappable"
    pd.p.on_pair(Pair(peer_id=gone, peer_role="decode", peer_spec=pd.d.spec.to_dict(),
                      peer_num_blocks=pd.d.num_blocks, data_addr="tcp://127.0.0.1:9",
                      peer_fingerprint=pd.d.fingerprint, peer_connector_md=bad), [], None)
    (res,) = pd.own(pd.p, PairResult)
    assert not res.ok and res.peer_id == gone
    assert res.error.startswith(f"cannot attach to {gone}: NIXL could not load the agent "
                                f"metadata of {gone} (23 bytes): ")
    assert gone not in pd.p.connector.links and gone not in pd.p.connector.peers
    pd.p.on_prefill(Prefill(req_id="r-gone", token_ids=TEXT[:20], decode_id=gone,
                            decode_block_ids=[0, 1]), [], None)
    (rej,) = pd.own(pd.p, Rejected)
    assert rej.error == (f"prefill instance {pd.p.instance_id} is not paired with decode "
                         f"instance {gone!r} (paired: {[pd.d.instance_id]})")
    assert tokens_of(pd.run(TEXT[:20])[3]) == colocated(pd, TEXT[:20])


def _staged_pair(**kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", tcp_tls())
        return PD(kv_connector="nixl", kv_connector_config=CONFIG["staged"], prefix=False,
                  layerwise_min_tokens=0, **kw)


def test_a_prompt_one_token_over_a_staging_slot_is_refused_and_the_slot_serves_on():
    """D of 10 blocks: its slot holds 10 blocks (160 tokens) while P's holds 16. At the slot
    (159 tokens + max_tokens 1: 10 blocks) the tokens are colocated's; one token over (161),
    D refuses the Allocate naming the prompt, and a Prefill naming 11 of D's blocks anyway (a
    router's bug) is refused by P before any WRITE (a WRITE past the slot would land in the
    next P's slot). The slot then serves the next request."""
    pd = _staged_pair(d_blocks=10)
    try:
        prompt = (TEXT * 2)[:159]
        alloc, _, header, toks = pd.run(prompt, max_tokens=1)
        assert header.payload_bytes == pd.d.receiver.slot_bytes == 10 * pd.d.spec.bytes_per_block
        assert tokens_of(toks) == colocated(pd, prompt, 1)
        over = (TEXT * 2)[:161]
        req, refused = pd.allocate(over, 1)
        assert isinstance(refused, Rejected) and refused.req_id == req
        assert (refused.kind, refused.param, refused.error) == (
            "capacity", "prompt", "prompt (161 tokens) + max_tokens (1) needs 11 blocks of 16 "
            "tokens; the cache has 10")
        req = "r-over"
        pd.p.on_prefill(Prefill(req_id=req, token_ids=over, decode_id=pd.d.instance_id,
                                decode_block_ids=list(range(10)) + [0], num_cached_blocks=0,
                                max_tokens=1, ignore_eos=True), [], None)
        pd.p.work()
        error = (f"prefill failed on {pd.p.instance_id}: request {req} moves 11 blocks (161 "
                 f"tokens, 0 cached on D); a staging slot of decode instance "
                 f"{pd.d.instance_id} holds 10")
        (rej,) = [m for m in pd.own(pd.p, Rejected) if m.req_id == req]
        assert rej.error == error and pd.p.connector.copier.posted == 0  # nothing written
        (frames,) = pd.link.frames  # D is told; it holds no request of that id
        pd.link.frames.clear()
        assert decode(frames[0]).error == error
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
        _, _, _, toks = pd.run(prompt[:100])
        assert tokens_of(toks) == colocated(pd, prompt[:100])
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()


def test_a_lost_free_notice_fails_one_request_in_a_bounded_wait_then_the_slot_serves(
        monkeypatch):
    """D's ``free`` of request 1 is lost: P waits at most SLOT_TIMEOUT_S for it before
    request 2, then fails request 2 (its exact message); D answers P's failure by sending its
    slot's state again (``slot K``, ``free`` of the last request read from it), so request 3 is
    token-identical: the pair is not broken for good."""
    import kvflow.connector.nixl_writer as nw
    monkeypatch.setattr(nw, "SLOT_TIMEOUT_S", 0.3)
    pd = _staged_pair()
    try:
        agent = pd.d.receiver.agent
        real, lost = agent.notify, []

        def notify(peer_id, message):
            if message.startswith(b"free ") and not lost:
                lost.append(message)
                return
            real(peer_id, message)
        monkeypatch.setattr(agent, "notify", notify)
        prompt = TEXT[:40]
        want = colocated(pd, prompt)
        r1, _, _, toks = pd.run(prompt)
        assert tokens_of(toks) == want and lost == [b"free " + r1.req_id.encode()]
        req, alloc = pd.allocate(prompt)
        t0 = time.monotonic()
        _, header, frames = pd.prefill(req, prompt, alloc)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        error = (f"prefill failed on {pd.p.instance_id}: decode instance {pd.d.instance_id} "
                 f"did not free its staging slot of request {r1.req_id} within 0.3 s")
        assert not header.ok and header.error == error
        (rej,) = [m for m in pd.own(pd.p, Rejected) if m.req_id == req]
        assert rej.error == error and not [m for m in pd.own(pd.p, Tokens) if m.req_id == req]
        pd.deliver(header, frames)
        (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
        assert end.finish_reason == "error" and end.error.endswith(error)
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
        for _ in range(2):
            assert tokens_of(pd.run(prompt)[3]) == want
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()


def test_a_p_of_another_nixl_mode_takes_no_staging_slot_and_a_staged_p_pairs():
    """One cluster, a staged D of one slot, a direct P registered first and a staged P: the
    direct P is refused naming both modes (on D too, so it holds no slot), and the staged P
    gets the slot."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", tcp_tls())
        d = make_instance(DecodeInstance, "decode", kv_connector="nixl",
                          kv_connector_config=CONFIG["staged"])
        direct = make_instance(PrefillInstance, "prefill", kv_connector="nixl",
                               kv_connector_config=CONFIG["direct"])
        staged = make_instance(PrefillInstance, "prefill", kv_connector="nixl",
                               kv_connector_config=CONFIG["staged"])
    try:
        for p in (direct, staged):
            d.on_pair(Pair(peer_id=p.instance_id, peer_role="prefill", peer_spec=p.spec.to_dict(),
                           peer_num_blocks=p.num_blocks, peer_fingerprint=p.fingerprint,
                           peer_connector_md=p.connector.export()["connector_md"]), [], None)
        bad, ok = [m for m in d.out if isinstance(m, PairResult)]
        assert not bad.ok and bad.error == (
            f"cannot attach to {direct.instance_id}'s cache: nixl mode mismatch, pairing "
            f"refused: staged (this decode instance) vs direct ({direct.instance_id})")
        assert ok.ok and d.receiver.slots == {staged.instance_id: 0} and d.waiting_pairs == {}
    finally:
        for inst in (d, direct, staged):
            inst.close()


def test_a_free_notice_that_comes_before_ps_write_still_frees_the_slot(monkeypatch):
    """The client gives up while P prefills: D ends the request first (its ``free`` goes out
    before P wrote the slot) and ignores P's late KVPushed, so no other ``free`` comes. P keeps
    that early notice, and the next request does not wait for one (SLOT_TIMEOUT_S 0.3 s
    would fail it)."""
    import kvflow.connector.nixl_writer as nw
    monkeypatch.setattr(nw, "SLOT_TIMEOUT_S", 0.3)
    pd = _staged_pair()
    try:
        prompt = TEXT[:40]
        req, alloc = pd.allocate(prompt)
        pd.d.on_abort(Abort(req_id=req, reason="client gone", prefill_sent=True), [], None)
        assert req not in pd.d.seqs and req in pd.d.lent  # P may still write them
        _, header, frames = pd.prefill(req, prompt, alloc)  # P's Abort comes after its prefill
        pd.p.on_abort(Abort(req_id=req, reason="client gone", prefill_sent=True), [], None)
        assert header.ok
        pd.deliver(header, frames)  # late: ignored, D's lent blocks come back
        pd.own(pd.p, Tokens)
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
        assert tokens_of(pd.run(prompt)[3]) == colocated(pd, prompt)
    finally:
        pd.close()
