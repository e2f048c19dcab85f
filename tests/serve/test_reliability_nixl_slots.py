"""Failure kinds of issue 26 at a staged nixl D's staging slots, on in-process P + D pairs
(tests/reliability_harness.py) whose agents talk over UCX's TCP transport: a prompt one token
over a slot, a lost ``free`` notification, a ``free`` that comes before P's write, and a P of
another nixl mode. Each ends in a refusal with its exact message or tokens identical to
colocated, with every block back on both sides; every wait is bounded (``SLOT_TIMEOUT_S`` is
cut to 0.3 s where a test waits it out)."""

from __future__ import annotations

import time

import pytest

from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from kvflow.serve.protocol import Abort, Pair, PairResult, Prefill, Rejected, Tokens, decode
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.instance.prefill import PrefillInstance

from tests.reliability_harness import PD, make_instance
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
CONFIG = {"direct": {"mode": "direct", "layers_per_copy": 1},
          "staged": {"mode": "staged", "layers_per_copy": 1, "staging_slots": 1}}


def _staged_pair(**kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", tcp_tls())
        return PD(kv_connector="nixl", kv_connector_config=CONFIG["staged"], prefix=False,
                  layerwise_min_tokens=0, **kw)


@pytest.fixture(scope="module")
def pd():
    """One staged pair (one slot) for the notice tests; each starts and ends with every block
    free."""
    h = _staged_pair()
    yield h
    h.close()


@pytest.fixture
def blocks_back(pd):
    full = (pd.p.num_blocks, pd.d.num_blocks)
    assert pd.free() == full
    yield
    assert not pd.p.pending and not pd.p.queue and not pd.d.seqs and not pd.d.lent
    assert pd.free() == full


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


@pytest.mark.usefixtures("blocks_back")
def test_a_lost_free_notice_fails_one_request_in_a_bounded_wait_then_the_slot_serves(
        pd, monkeypatch):
    """D's ``free`` of request 1 is lost: P waits at most SLOT_TIMEOUT_S for it before
    request 2, then fails request 2 (its exact message); D answers P's failure by sending its
    slot's state again (``slot K``, ``free`` of the last request read from it), so request 3 is
    token-identical: the pair is not broken for good."""
    import kvflow.connector.nixl_writer as nw
    monkeypatch.setattr(nw, "SLOT_TIMEOUT_S", 0.3)
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


@pytest.mark.usefixtures("blocks_back")
def test_a_free_notice_that_comes_before_ps_write_still_frees_the_slot(pd, monkeypatch):
    """The client gives up while P prefills: D ends the request first (its ``free`` goes out
    before P wrote the slot) and ignores P's late KVPushed, so no other ``free`` comes. P keeps
    that early notice, and the next request does not wait for one (SLOT_TIMEOUT_S 0.3 s
    would fail it)."""
    import kvflow.connector.nixl_writer as nw
    monkeypatch.setattr(nw, "SLOT_TIMEOUT_S", 0.3)
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
