"""ipc-push (P writes into D's exported cache, kvflow.connector.ipc_push) on an in-process P + D pair
(tests/reliability_harness.py): token identity with a colocated engine, prefix hits, and who
owns D's blocks when a request ends early -- D keeps them ("lent") until P's KVPushed says it
wrote its last byte, unless the Prefill never went out or P's process is gone. Every test ends
with P's and D's free-block counts at their start."""

from __future__ import annotations

import time

import pytest
import torch

from kvflow.context import forward_context
from kvflow.connector.messages import KVPushed
from kvflow.serve.protocol import Abort, Prefill, Rejected, Tokens, decode
from kvflow.segments import host_id
from kvflow.connector import Peer, PrefillJob, TransferError

from tests.reliability_harness import PD, FakeLink, every_block_back, time_out_on_d
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of


@pytest.fixture(scope="module")
def pd():
    h = PD(kv_connector="ipc-push")
    yield h
    h.close()


@pytest.fixture(autouse=True)
def blocks_come_back(pd):
    yield from every_block_back(pd)


def d_blocks(pd, ids):
    return [t[ids].clone() for t in pd.d.cache.tensors()]


@pytest.mark.parametrize("mode", ["layerwise", "request"])
def test_push_is_token_identical_and_p_frees_its_blocks_at_send(pd, mode):
    pd.p.connector.layerwise_min_tokens = 0 if mode == "layerwise" else 1 << 30
    try:
        req, alloc = pd.allocate(TEXT[:150])
        p_table, hdr, frames = pd.prefill(req, TEXT[:150], alloc)
    finally:
        pd.p.connector.layerwise_min_tokens = 1 << 30
    assert isinstance(hdr, KVPushed) and hdr.ok and frames == []
    assert (hdr.num_blocks, hdr.layerwise) == (10, mode == "layerwise")
    assert hdr.payload_bytes == 10 * pd.d.spec.bytes_per_block
    assert pd.p.allocator.num_used == 0            # P's blocks: free once its copies are done
    for dt, pt in zip(pd.d.cache.tensors(), pd.p.cache.tensors()):  # D's table got P's bytes
        assert torch.equal(dt[alloc.block_ids[:10]], pt[p_table[:10]])
    pd.deliver(hdr)
    pd.decode_all()
    msgs = pd.take(pd.d, Tokens)
    assert tokens_of(msgs) == colocated(pd, TEXT[:150])
    kv = msgs[1].kvflow  # D's first message (token 2); msgs[0] is P's token
    assert (kv["kv_connector"], kv["layerwise"], kv["blocks"]) == ("ipc-push", mode == "layerwise", 10)
    assert kv["exposed_ms"] >= 0 and kv["prefill_ms"] > 0


def test_prefix_hit_pushes_only_the_missing_blocks(pd):
    first = TEXT[:32]
    pd.run(first)
    prompt = first + TEXT[100:148]
    req, alloc = pd.allocate(prompt)
    assert alloc.num_cached_blocks == 2
    before = d_blocks(pd, alloc.block_ids[:2])
    p_table, hdr, _ = pd.prefill(req, prompt, alloc)
    assert hdr.num_blocks == 3
    assert all(torch.equal(a, b) for a, b in zip(before, d_blocks(pd, alloc.block_ids[:2])))
    for logical in range(2, 5):
        for dt, pt in zip(pd.d.cache.tensors(), pd.p.cache.tensors()):
            assert torch.equal(dt[alloc.block_ids[logical]], pt[p_table[logical]])
    pd.deliver(hdr)
    pd.decode_all()
    assert tokens_of(pd.take(pd.d, Tokens)) == colocated(pd, prompt)


def test_d_keeps_blocks_of_an_aborted_request_until_p_has_pushed(pd):
    req, alloc = pd.allocate(TEXT[:40])
    pd.d.on_abort(Abort(req_id=req, prefill_sent=True), [], None)
    assert req in pd.d.lent and pd.d.allocator.num_used == len(alloc.block_ids)
    _, hdr, _ = pd.prefill(req, TEXT[:40], alloc)  # P did not hear of the abort yet: it writes
    assert hdr.ok
    pd.deliver(hdr)
    assert req not in pd.d.lent and not pd.own(pd.d, Tokens)  # D sent nothing for it


def test_abort_while_queued_on_p_tells_d_to_free(pd):
    req, alloc = pd.allocate(TEXT[:40])
    pd.p.on_prefill(Prefill(req_id=req, token_ids=TEXT[:40], decode_id=pd.d.instance_id,
                            decode_block_ids=alloc.block_ids), [], None)
    pd.abort(req)
    assert not pd.p.has_work() and req in pd.d.lent
    (frame,) = pd.link.frames.pop()
    done = decode(frame)
    assert isinstance(done, KVPushed) and not done.ok and done.error == "aborted"
    pd.deliver(done)
    assert req not in pd.d.lent


def test_abort_before_the_prefill_went_out_or_with_p_exited_frees_d_at_once(pd):
    req, _ = pd.allocate(TEXT[:40])
    pd.d.on_abort(Abort(req_id=req, prefill_sent=False), [], None)
    assert req not in pd.d.lent and pd.d.allocator.num_used == 0
    req, _ = pd.allocate(TEXT[:40])  # the router saw P's process exit: it writes nothing more
    pd.d.on_abort(Abort(req_id=req, peer_dead=pd.p.instance_id, prefill_id=pd.p.instance_id,
                        peer_exited=True), [], None)
    assert req not in pd.d.lent and pd.d.allocator.num_used == 0


def dead_pid() -> int:
    import subprocess
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_receive_timeout_keeps_the_blocks_lent_until_p_is_done_or_dead(pd):
    try:
        req, end = time_out_on_d(pd, TEXT[:40])
        assert end.error == "no KV from prefill within 0.1 s"
        time.sleep(0.15)
        pd.d.heartbeat(force=True)
        assert req in pd.d.lent and pd.d.allocator.num_used > 0  # P is alive: it may write
        # the router's abort names the P; once that P's process is gone the blocks come back
        pd.d.on_abort(Abort(req_id=req, prefill_id="p-gone"), [], None)
        assert pd.d.lent[req].peer == "p-gone"
        pd.d.lent.peer_pids["p-gone"] = dead_pid()
        pd.d.lent.peer_hosts["p-gone"] = host_id()  # its pid is comparable with D's
        pd.d._last_peer_check = 0.0
        pd.d.heartbeat(force=True)
        assert req not in pd.d.lent and "p-gone" not in pd.d.lent.peer_pids
    finally:
        pd.d.receive_timeout_s = 120.0


def test_kvpushed_not_ok_fails_the_request_and_frees_at_once(pd):
    req, alloc = pd.allocate(TEXT[:40])
    pd.deliver(KVPushed(req_id=req, ok=False, error="GPU on fire"))
    (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
    assert end.error == "KV transfer failed: prefill could not push the KV: GPU on fire"
    assert req not in pd.d.lent


def test_bad_decode_block_ids_fail_on_p_and_write_nothing(pd):
    req, alloc = pd.allocate(TEXT[:40])
    snap = [t.clone() for t in pd.d.cache.tensors()]
    pd.p.on_prefill(Prefill(req_id=req, token_ids=TEXT[:40], decode_id=pd.d.instance_id,
                            decode_block_ids=[alloc.block_ids[0], 999, alloc.block_ids[2]]), [], None)
    pd.p.work()
    done = decode(pd.link.frames.pop()[0])
    want = f"prefill failed on {pd.p.instance_id}: decode_block_ids holds block 999, not in [0, 48)"
    assert isinstance(done, KVPushed) and not done.ok and done.error == want
    (rej,) = pd.take(pd.p, Rejected)
    assert (rej.kind, rej.error) == ("transfer", want)
    assert pd.p.allocator.num_used == 0
    assert all(torch.equal(a, b) for a, b in zip(snap, pd.d.cache.tensors()))
    pd.deliver(done)
    (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
    assert end.error == f"KV transfer failed: prefill could not push the KV: {want}"


def test_over_capacity_prefill_tells_d(pd):
    pd.p.on_prefill(Prefill(req_id="huge", token_ids=[1] * 300, decode_id=pd.d.instance_id),
                    [], None)
    (rej,) = pd.take(pd.p, Rejected)
    done = decode(pd.link.frames.pop()[0])
    assert rej.kind == "capacity" and not done.ok and done.error == rej.error
    assert done.error.startswith("prompt of 300 tokens needs 19 blocks; prefill instance")


def test_dummy_run_writes_and_sends_nothing(pd):
    snap = [t.clone() for t in pd.d.cache.tensors()]
    sent = pd.p.connector.messages_sent
    pd.p.connector.dummy_run(pd.p.engine, pd.p.cfg.max_num_batched_tokens, 48)
    assert pd.p.connector.messages_sent == sent and not pd.link.frames
    assert all(torch.equal(a, b) for a, b in zip(snap, pd.d.cache.tensors()))
    with forward_context(is_dummy_or_profile_run=True):
        with pytest.raises(RuntimeError, match="PushSender.send_done during a dummy/profile run"):
            pd.p.connector.send_done(pd.link, "x", ok=True)


def test_attach_without_an_export_names_the_flag(pd):
    with pytest.raises(TransferError) as e:
        pd.p.connector.attach(Peer("d-x", pd.d.spec, pd.d.num_blocks), link=FakeLink())
    assert str(e.value) == ("decode instance d-x exported no cache to push into (is it running "
                            "with --kv-connector ipc-push?)")
    assert "d-x" not in pd.p.connector.links                 # nothing stays attached


def pd_spec():
    return __import__("kvflow").KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8,
                                            block_size=4, dtype=torch.float32)


def test_direction_resolution_and_pairing_names():
    from kvflow.connector import make_sender, resolve_connector
    from kvflow.serve.__main__ import parse_args
    from kvflow.serve.instance.colocated import ColocatedInstance
    from kvflow.serve.launch.server import instance_config
    assert resolve_connector("auto", "cuda") == "ipc-push" and resolve_connector("auto") == "ipc-pull"
    parent = parse_args(["--kv-connector", "ipc-push"])
    assert instance_config(parent, "prefill", "tcp://127.0.0.1:1").kv_connector == "ipc-push"
    assert ColocatedInstance.connector_name(None) == "none"                 # no connector
    spec = pd_spec()
    assert make_sender("ipc-push", spec).layerwise_min_tokens == 16384
    assert make_sender("auto", spec).layerwise_min_tokens == 16384
    assert make_sender("ipc-push", spec, layerwise_min_tokens=7).layerwise_min_tokens == 7
    with pytest.raises(ValueError, match="kv_connector must be 'auto' or one of ipc-pull, "
                                         "ipc-push, tcp, nixl; got 'up'"):
        resolve_connector("up")
    with pytest.raises(SystemExit):
        parse_args(["--kv-connector", "sideways"])


# ---- PushSender on its own: exact bytes, one launch per group of layers --------------------
@pytest.mark.parametrize("group,chunk", [(1, None), (3, 48), (4, 64), (8, 100)])
def test_writer_copies_each_group_once_per_chunk_byte_exact(group, chunk):
    from kvflow import PagedKVCache
    from kvflow.engine import Engine
    from kvflow.model import load_model
    from kvflow.connector import ipc_push
    model, _ = load_model("kvflow-tiny")
    spec = model.kv_spec(16)
    w = ipc_push.PushSender(spec, backend="numba", layers_per_copy=group, layerwise_min_tokens=0)
    eng = Engine(model, w.make_cache(24))
    dst = PagedKVCache(spec, 24)
    dst.buffer.fill_(0xAB)
    w.peers["d-1"] = dst
    calls = []
    real = w.copier._copy
    w.copier._copy = lambda pairs, layers, cap, stats: (calls.append((layers, cap)),
                                                 real(pairs, layers, cap, stats))[1]
    toks = [(5 * i + 1) % 250 for i in range(150)]
    blocks, dst_ids = list(range(2, 12)), [20, 3, 7, 0, 11, 19, 4, 9, 15, 1]
    w.links["d-1"] = FakeLink()
    job = PrefillJob("r", toks, blocks, "d-1", dst_ids)
    hook = w.begin(job)
    logits = eng.prefill(toks, blocks, chunk_size=chunk, on_chunk=hook)
    assert w.finish(job, int(logits.argmax())) is None
    done = decode(w.links["d-1"].frames.pop()[0])
    L = spec.num_layers
    chunks = -(-150 // (chunk or 150))
    want = [(lo, min(lo + group, L)) for lo in range(0, L, group)]
    assert [c[0] for c in calls] == want * chunks
    assert [c[1] for c in calls] == ([16] * (len(want) - 1) + [16]) * (chunks - 1) + \
        [16] * (len(want) - 1) + [None]        # the very last group: the whole GPU
    for t_p, t_d in zip(eng.cache.tensors(), dst.tensors()):
        assert torch.equal(t_d[dst_ids].view(torch.uint8), t_p[blocks].view(torch.uint8))
        rest = [b for b in range(24) if b not in dst_ids]
        assert bool((t_d[rest].view(torch.uint8) == 0xAB).all())
    assert (done.ok, done.num_blocks, done.layerwise) == (True, 10, True)
    assert done.first_token == int(logits.argmax()) and w.prefilling == {}


def test_writer_refuses_bad_settings_and_short_tables():
    from kvflow import PagedKVCache
    from kvflow.connector import ipc_push
    spec = __import__("kvflow").KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4,
                                            dtype=torch.float32)
    for kw, msg in (({"layers_per_copy": 0}, "layers_per_copy must be an int >= 1, got 0"),
                    ({"max_ctas": 0}, "max_ctas must be an int >= 1, got 0"),
                    ({"layers_per_copy": True}, "layers_per_copy must be an int >= 1, got True")):
        with pytest.raises(ValueError) as e:
            ipc_push.PushSender(spec, **kw)
        assert str(e.value) == msg
    w = ipc_push.PushSender(spec)
    w.make_cache(8)
    with pytest.raises(TransferError) as e:
        w.begin(PrefillJob("r", [1, 2, 3], [0], "d-1", [0]))
    assert str(e.value) == ("push to decode instance 'd-1', which is not paired with this prefill "
                            "instance (paired: [])")
    w.peers["d-1"] = PagedKVCache(spec, 8)
    with pytest.raises(TransferError) as e:
        w.begin(PrefillJob("r", [1] * 9, [0, 1, 2], "d-1", [0, 1]))
    assert str(e.value) == ("decode_block_ids has 2 blocks and P's table 3; the 9-token prompt "
                            "needs 3")
    assert w.prefilling == {}  # a refused begin keeps nothing


def test_kv_digest_diagnostic_matches_the_pushed_bytes(pd, monkeypatch):
    from kvflow.serve.instance import faults
    assert faults.kv_digest(pd.d.cache, [0, 1], 40) is None  # off unless asked for
    monkeypatch.setenv("KVFLOW_DEBUG_KV_DIGEST", "1")
    alloc, p_table, hdr, toks = pd.run(TEXT[:40])
    got = toks[1].kvflow["kv_digest"]  # D's first message (toks[0] is P's token)
    assert got == faults.kv_digest(pd.p.cache, p_table, 40) and got != [0, 0]
    assert all(0 <= v < 2**61 for v in got)


def test_push_options_need_ipc_push(capsys):
    from kvflow.serve.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--kv-connector", "tcp", "--kv-connector-config", '{"max_ctas": 8}'])
    assert capsys.readouterr().err == ("kvflow.serve: error: --kv-connector-config key 'max_ctas' "
                                       "is not an option of connector 'tcp' (it takes receive_max_ctas)\n")
    cfg = parse_args(["--kv-connector", "ipc-push", "--kv-connector-config", '{"max_ctas": 8}'])
    assert cfg.kv_connector_config == {"max_ctas": 8}
