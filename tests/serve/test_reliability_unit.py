"""In-process pieces of the reliability work: prefix cache (ref counts, LRU eviction), pairing
refusals for every KV-cache field incl. layout (NHD <-> HND is refused, not converted), the
router's API key, CLI checks and the fault switch."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from kvflow import KVCacheSpec
from kvflow.blocks import BlockAllocator, PrefixCache, block_keys
from kvflow.serve.instance import faults
from kvflow.serve.__main__ import parse_args
from kvflow.serve.instance.pairing import check_pairing

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)


def test_block_keys_chain_the_whole_prefix():
    a = block_keys(list(range(40)), 16)
    b = block_keys([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and len(set(a)) == 2                 # the partial third block has no key
    assert a[0] != b[0] and a[1] != b[1]                      # block 1 equal, prefix differs
    assert block_keys(list(range(32)), 16) == a
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        block_keys([1], 0)


def test_prefix_cache_ref_counts_and_lru_eviction():
    alloc = BlockAllocator(6)
    pc = PrefixCache(alloc, block_size=2)
    t1 = alloc.allocate(3)
    assert pc.insert([1, 2, 3, 4, 5], t1) == 2               # full blocks 0-1 cached
    assert pc.insert([1, 2, 3, 4, 5], t1) == 0               # already cached: no new reference
    assert [alloc.ref_count(b) for b in t1] == [2, 2, 1]
    alloc.free(t1)                                            # the request ends
    assert alloc.num_free == 4 and pc.num_evictable == 2
    hit = pc.match([1, 2, 3, 4, 7, 7])
    assert hit == t1[:2] and [alloc.ref_count(b) for b in hit] == [2, 2]
    assert pc.match([1, 2, 9, 9]) == t1[:1]                   # partial hit: logical block 0
    assert pc.match([8, 8, 3, 4]) == []                       # k = 0: block 1 alone never hits
    assert pc.evict(5) == 0                                   # all cached blocks are in use
    alloc.free(hit + t1[:1])
    assert pc.evict(1) == 1 and len(pc) == 1                  # LRU: logical block 1 goes,
    assert pc.match([1, 2, 3, 4]) == t1[:1]                   # block 0 (used last) survives
    alloc.free(t1[:1])
    assert pc.clear() == 1 and alloc.num_free == 6


ONLY = "; P and D may differ only in block_size, layout (NHD/HND) and dtype"


@pytest.mark.parametrize("field, theirs, words", [
    ("num_kv_heads", 4, "num_kv_heads: 2 (p-1) vs 4 (d-2)"),
    ("head_dim", 64, "head_dim: 32 (p-1) vs 64 (d-2)"),
    ("num_layers", 2, "num_layers: 4 (p-1) vs 2 (d-2)"),
])
@pytest.mark.parametrize("connector", ["ipc-pull", "tcp", "ipc-push"])
def test_an_unmappable_mismatch_is_refused_naming_both_values(field, theirs, words, connector):
    error = check_pairing(SPEC, "p-1", SPEC.with_(**{field: theirs}).to_dict(), "d-2", connector)
    assert error == "KV cache spec mismatch, pairing refused: " + words + ONLY


@pytest.mark.parametrize("field, theirs, words", [
    ("block_size", 32, "block_size: 16 (p-1) vs 32 (d-2)"),
    ("dtype", torch.bfloat16, "dtype: torch.float32 (p-1) vs torch.bfloat16 (d-2)"),
    ("layout", "HND", "layout: NHD (p-1) vs HND (d-2)"),
])
def test_a_mappable_mismatch_pairs_only_over_a_reblocking_connector(field, theirs, words):
    theirs = SPEC.with_(**{field: theirs}).to_dict()
    for kind in ("ipc-pull", "tcp", "ipc-push"):
        assert check_pairing(SPEC, "p-1", theirs, "d-2", kind) == ""
    assert check_pairing(SPEC, "p-1", theirs, "d-2", "nixl") == (
        f"KV cache spec mismatch, pairing refused: {words}; the nixl connector moves only "
        f"equal specs (re-blocking connectors: ipc-pull, ipc-push, tcp)")


def test_mla_maps_only_to_mla():
    mla = SPEC.with_(layout="MLA", num_kv_heads=1)
    assert check_pairing(SPEC.with_(num_kv_heads=1), "p-1", mla.to_dict(), "d-2", "tcp") == (
        "KV cache spec mismatch, pairing refused: layout: NHD (p-1) vs MLA (d-2)" + ONLY)


def test_mismatched_d_attaches_nothing_and_writes_nothing():
    from tests.reliability_harness import make_instance
    from kvflow.connector.messages import KVReady
    from kvflow.serve.protocol import Pair
    from kvflow.serve.instance.decode import DecodeInstance
    d = make_instance(DecodeInstance, "decode", block_size=32)
    try:
        before = d.cache.buffer.clone()
        theirs = d.spec.with_(head_dim=2 * d.spec.head_dim)   # not mappable: a head is whole
        d.on_pair(Pair(peer_id="p-1", peer_role="prefill", peer_spec=theirs.to_dict(),
                       peer_num_blocks=8, shm_name="kvflow-prefill-1-abababababab"), [], None)
        res = d.out[-1]
        assert not res.ok and d.receiver.peer is None
        assert f"head_dim: {d.spec.head_dim} ({d.instance_id}) vs {theirs.head_dim}" in res.error
        d.send = lambda *a, **k: None
        d.on_allocate(__import__("kvflow.serve.protocol").serve.protocol.Allocate(
            req_id="r", token_ids=[1, 2], max_tokens=2), [], None)
        d.on_data(KVReady(req_id="r", src_block_ids=[0], first_token=1, num_prompt_tokens=2,
                          t_start=0.0), [], b"p-1")
        assert torch.equal(d.cache.buffer, before) and not d.seqs
        assert d.allocator.num_free == d.num_blocks
    finally:
        d.close()


def _app(api_key):
    from kvflow.model import ByteTokenizer
    from kvflow.serve.router.control import Controller
    from kvflow.serve.router.metrics import Metrics
    from kvflow.serve.router.app import create_app
    from kvflow.serve.router.router import Router
    ctl = Controller()
    app = create_app(Router(ctl, ByteTokenizer(), "kvflow-tiny", Metrics(), api_key=api_key))
    return ctl, app


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401),
                                            ("secret", 401), ("Bearer secret", 200)])
def test_api_key_guards_v1_only(header, status):
    ctl, app = _app("secret")
    try:
        with TestClient(app) as c:
            headers = {"Authorization": header} if header else {}
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == status
            if status == 401:
                assert r.json()["error"]["param"] == "authorization"
            assert c.get("/health").status_code == 503          # open, not ready
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == (401 if status == 401 else 503)
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()


def test_router_uses_constant_time_compare():
    import inspect
    from kvflow.serve.router.router import Router
    assert "hmac.compare_digest" in inspect.getsource(Router.authorized)


@pytest.mark.parametrize("argv, message", [
    (["--kv-lease-s", "0"], "--kv-lease-s must be a positive number of seconds, got 0.0"),
    (["--kv-lease-s", "0.3"], "--kv-lease-s 0.3 is shorter than 2 of D's lease renewals (one "
     "every heartbeat, 0.2 s): P would free blocks D still reads; use at least 0.4"),
    (["--admit-timeout-s", "-1"], "--admit-timeout-s must be a positive number of seconds, got -1.0"),
    (["--dead-after-s", "nan"], "--dead-after-s must be a positive number of seconds, got nan"),
])
def test_cli_rejects_bad_reliability_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_cli_defaults_bind_loopback_and_read_the_key_from_the_environment(monkeypatch):
    args = parse_args([])
    assert (args.host, args.api_key, args.kv_lease_s) == ("127.0.0.1", None, 5.0)
    monkeypatch.setenv("KVFLOW_API_KEY", "k3y")
    assert parse_args([]).api_key == "k3y"


def test_faults_are_off_unless_set_and_match_only_marked_prompts(monkeypatch):
    assert faults.delay_s("prefill", [7, 7, 7]) == 0.0
    monkeypatch.setenv("KVFLOW_FAULT_PREFILL_DELAY_S", "1.5")
    assert faults.delay_s("prefill", [1, 2]) == 1.5
    monkeypatch.setenv("KVFLOW_FAULT_MATCH", "7,7,7")
    assert faults.delay_s("prefill", [1, 7, 7, 7, 2]) == 1.5
    assert faults.delay_s("prefill", [1, 7, 7, 2]) == 0.0
    assert faults.delay_s("receive", [7, 7, 7]) == 0.0
