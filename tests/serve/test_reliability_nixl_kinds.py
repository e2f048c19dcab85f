"""Failure kinds of issue 26 over the ``nixl`` connector (direct and staged), on in-process P +
D pairs (tests/reliability_harness.py) whose agents talk over UCX's TCP transport: a WRITE
failing after P's first token went out (with prefix caching, with max_tokens 1), an instance
paired anew with the same agent metadata, a D whose agent P cannot load, and a P declared dead
that still writes. Each ends in a refusal with its exact message or tokens identical to
colocated, with every block back on both sides; every wait is bounded (``SLOT_TIMEOUT_S`` is
cut to 0.3 s where a test waits it out). The staging slots' kinds are in
tests/serve/test_reliability_nixl_slots.py; a D killed mid-WRITE over staged nixl, served, in
tests/serve/test_reliability_nixl_kill.py."""

from __future__ import annotations

import time

import pytest

from kvflow.connector import Peer
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from kvflow.serve.protocol import Abort, Pair, PairResult, Prefill, Rejected, Tokens

from tests.reliability_harness import PD, every_block_back
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of

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
    assert rejected.kind == "transfer" and rejected.error == _failed_write_error(pd)
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

    from kvflow.connector.messages import decode_agent_info, encode_agent_info
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


def test_a_p_declared_dead_writes_later_and_d_reuses_none_of_its_blocks_meanwhile():
    """Direct nixl, a D of 3 blocks: the router declares P dead while it prefills (an Abort
    naming it, its process unseen: nixl P's may live on other hosts). D keeps the 3 blocks lent
    past its --kv-lease-s (0.3 s), so the next request is refused busy instead of being given
    blocks P still WRITEs into; P's late WRITEs and KVPushed give them back, and the next
    request is token-identical."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_TLS", tcp_tls())
        pd = PD(kv_connector="nixl", kv_connector_config=CONFIG["direct"], prefix=False,
                layerwise_min_tokens=0, d_blocks=3)
    pd.d.kv_lease_s = 0.3
    try:
        a, b = TEXT[:40], TEXT[60:100]
        req, alloc = pd.allocate(a)
        pd.d.on_abort(Abort(req_id=req, prefill_id=pd.p.instance_id, reason="missed "
                            "heartbeats", peer_dead=pd.p.instance_id, prefill_sent=True), [], None)
        time.sleep(0.5)
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent and pd.d.free_blocks() == 0
        _, busy = pd.allocate(b)
        assert isinstance(busy, Rejected) and (busy.kind, busy.error) == (
            "busy", "requested 3 blocks but only 0 of 3 are free")
        _, header, frames = pd.prefill(req, a, alloc)  # P was alive: it writes them now
        assert header.ok and header.num_blocks == 3
        pd.deliver(header, frames)
        pd.own(pd.p, Tokens)
        assert req not in pd.d.lent and pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
        assert tokens_of(pd.run(b)[3]) == colocated(pd, b)
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()
