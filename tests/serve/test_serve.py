"""End to end on CPU: `python -m kvflow.serve` in disagg mode (ipc and tcp) against colocated.

Four servers (colocated; ipc pull, ipc push and tcp disagg) start once for the module (in
parallel). Greedy outputs of disaggregated serving
must equal colocated serving token for token for English prompts of 1..300 tokens; the bytes
moved equal blocks x bytes_per_block; every test gives back every block on P and D; over-long
prompts get HTTP 400 and move nothing; SIGINT leaves no process and no shared-memory segment.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from kvflow.segments import SHM_DIR

from tests.serve_server import Server, healthy, pid_alive

TEXT = ("The quick brown fox jumps over the lazy dog while the decode instance waits for its "
        "blocks. Prefill computes the keys and values of every prompt token, layer by layer, "
        "and the transfer moves those blocks into the cache of the decode instance, which then "
        "generates one token per step until it reaches the length it was asked for. Paged "
        "attention reads them back through the block table.")
# Prompt lengths in tokens (byte tokenizer: one per byte, plus <bos>): 1 .. 300, across block edges.
LENGTHS = [1, 2, 15, 16, 17, 64, 150, 300]
MAX_TOKENS = 12


def prompt_of(n: int):
    return [256] if n == 1 else TEXT[: n - 1]


@pytest.fixture(scope="module")
def servers():
    s = {"colocated": Server("--mode", "colocated"),
         "ipc": Server("--kv-connector", "ipc-pull"),
         "ipc-push": Server("--kv-connector", "ipc-push"),
         "tcp": Server("--kv-connector", "tcp", "--block-size", "8")}
    with healthy(s):
        yield s


@pytest.fixture(scope="module")
def reference(servers):
    """Colocated greedy outputs per prompt length."""
    out = {}
    for n in LENGTHS:
        r = servers["colocated"].complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        out[n] = r.json()["choices"][0]["token_ids"]
        assert len(out[n]) == MAX_TOKENS
    return out


@pytest.fixture(autouse=True)
def blocks_come_back(request, servers):
    """Every test ends with every instance's free-block count where it started."""
    if request.node.name.startswith("test_sigint"):
        yield
        return
    # Between tests nothing is in flight, so every block is free; heartbeats carry the counts,
    # so wait for them rather than snapshot a count a late heartbeat has not updated yet.
    start = {k: s.total_blocks() for k, s in servers.items() if s.proc.poll() is None}
    for k, want in start.items():
        assert servers[k].wait_free_blocks(want) == want, f"{k}: blocks held before the test"
    yield
    for k, want in start.items():
        assert servers[k].wait_free_blocks(want) == want, f"{k}: blocks not given back"


@pytest.mark.parametrize("transfer", ["ipc", "ipc-push", "tcp"])
def test_disagg_is_token_identical_to_colocated(servers, reference, transfer):
    srv = servers[transfer]
    spec = srv.instance("decode")["spec"]
    bytes_per_block = 2 * spec["num_layers"] * spec["block_size"] * spec["num_kv_heads"] * spec["head_dim"] * 4
    for n in LENGTHS:
        r = srv.complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == reference[n], f"{transfer}: prompt of {n} tokens"
        assert body["usage"]["prompt_tokens"] == n
        kv = body["kvflow"]
        blocks = -(-n // spec["block_size"])
        assert kv["kv_connector"] == {"ipc": "ipc-pull"}.get(transfer, transfer)
        assert kv["blocks"] == blocks
        assert kv["payload_bytes"] == blocks * bytes_per_block
        assert kv["prefill_instance"].startswith("p-") and kv["decode_instance"].startswith("d-")
        assert kv["transfer_ms"] > 0


def test_colocated_moves_nothing(servers):
    kv = servers["colocated"].complete(prompt="Hello there", max_tokens=2).json()["kvflow"]
    assert (kv["kv_connector"], kv["blocks"], kv["payload_bytes"]) == ("none", 0, 0)
    assert kv["prefill_instance"] == kv["decode_instance"]


def test_over_capacity_prompt_is_400_and_moves_nothing(servers):
    srv = servers["ipc"]
    before = srv.client.get("/metrics").text
    r = srv.complete(prompt="x" * 600, max_tokens=4)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("prompt (601 tokens) + max_tokens (4) = 605 exceeds "
                                            "max_model_len=512")
    r = srv.complete(prompt="x" * 400, max_tokens=200)
    assert r.status_code == 400 and "= 601 exceeds max_model_len=512" in r.json()["error"]["message"]
    assert _metric(srv.client.get("/metrics").text, 'kvflow_transfer_bytes_total{connector="ipc-pull"}') == \
        _metric(before, 'kvflow_transfer_bytes_total{connector="ipc-pull"}')


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "", "max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "stream": "yes please"}, "stream"),
    ({"prompt": "hi", "max_tokns": 3}, "max_tokns"),
    ({"prompt": [256, 9999]}, "prompt"),
])
def test_bad_body_is_400_naming_the_field(servers, body, field):
    r = servers["tcp"].complete(**body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


def test_streaming_sends_every_token_then_done(servers, reference):
    srv = servers["tcp"]
    with srv.client.stream("POST", "/v1/completions", json={
            "prompt": prompt_of(64), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[64]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (MAX_TOKENS - 1) + ["length"]
    assert chunks[-1]["kvflow"]["blocks"] == 8 and "kvflow" not in chunks[0]


def test_sampling_with_temperature_is_seeded_and_identical_across_modes(servers):
    body = dict(prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    a = servers["ipc"].complete(**body).json()["choices"][0]["token_ids"]
    b = servers["colocated"].complete(**body).json()["choices"][0]["token_ids"]
    c = servers["ipc"].complete(**dict(body, seed=8)).json()["choices"][0]["token_ids"]
    assert a == b and a != c


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_health_models_and_metrics(servers):
    srv = servers["ipc"]
    h = srv.health()
    assert h["status"] == "ok" and {i["role"] for i in h["instances"]} == {"prefill", "decode"}
    p, d = srv.instance("prefill"), srv.instance("decode")
    assert p["paired_with"] == [d["id"]] and d["paired_with"] == [p["id"]]
    m = srv.client.get("/v1/models").json()
    assert m["data"][0]["id"] == "kvflow-tiny" and m["data"][0]["max_model_len"] == 512
    srv.complete(prompt=prompt_of(40), max_tokens=4)
    text = srv.client.get("/metrics").text
    assert _metric(text, "kvflow_ttft_seconds_count") >= 1
    assert _metric(text, "kvflow_tpot_seconds_count") >= 1
    assert _metric(text, 'kvflow_transfer_bytes_total{connector="ipc-pull"}') > 0
    assert _metric(text, 'kvflow_transfer_seconds_count{connector="ipc-pull"}') >= 1
    # The gauge and /health both follow D's heartbeats: once the request's blocks are back,
    # they agree (read both again until a heartbeat between the two reads is not in the way).
    want = srv.wait_free_blocks(srv.total_blocks())
    gauge = f'kvflow_free_blocks{{instance="{d["id"]}",role="decode"}}'
    deadline = time.monotonic() + 5
    while _metric(srv.client.get("/metrics").text, gauge) != want["decode"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(srv.client.get("/metrics").text, gauge) == want["decode"] == d["num_blocks"]


def test_profile_sized_caches_without_num_blocks(servers):
    # No --num-blocks was given: each instance sized its cache by a profile run and started.
    for srv in servers.values():
        for inst in srv.health()["instances"]:
            assert inst["num_blocks"] > 100


def test_sigint_leaves_no_process_and_no_segment(servers):
    for name in ("ipc", "ipc-push", "tcp", "colocated"):
        srv = servers[name]
        srv.health()
        assert srv.seen_pids and all(pid_alive(p) for p in srv.seen_pids)
        if name.startswith("ipc"):  # pull: P's segment; push: D's
            assert srv.seen_shm and all(os.path.exists(os.path.join(SHM_DIR, s)) for s in srv.seen_shm)
        t0 = time.monotonic()
        assert srv.stop() == 0
        assert time.monotonic() - t0 < 10
        assert not [p for p in srv.seen_pids if pid_alive(p)]
        assert not [s for s in srv.seen_shm if os.path.exists(os.path.join(SHM_DIR, s))]
        assert "kvflow.serve: stopped" in srv.output()
