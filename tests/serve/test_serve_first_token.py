"""P's first token is streamed before the KV reaches D, and every request carries its per-hop
timings (kvflow.serve.instance.first_token, kvflow.serve.timings), end to end on `python -m
kvflow.serve` (ipc-pull, request mode) against a colocated server. Faults apply to marked
prompts only: three BEL bytes (ids 7,7,7) make D hold the arrived transfer 1.5 s; three
backspaces (8,8,8) make D's receive fail. Every test ends with P's and D's blocks back."""

from __future__ import annotations

import json
import time

import pytest

from kvflow.serve.timings import HOPS, MILESTONES

from tests.serve_server import Server

SLOW, BROKEN = "\x07\x07\x07", "\x08\x08\x08"
FAULTS = {"KVFLOW_FAULT_RECEIVE_DELAY_S": "1.5", "KVFLOW_FAULT_MATCH": "7,7,7",
          "KVFLOW_FAULT_RECEIVE_FAIL": "8,8,8"}
TTFT_HOPS = ("router_in", "d_allocate", "to_p", "p_queue", "p_prefill", "first_token_to_router",
             "router_out")


@pytest.fixture(scope="module")
def servers():
    disagg = Server("--kv-connector", "ipc-pull", "--num-blocks", "40", env=FAULTS)
    coloc = Server("--mode", "colocated", "--num-blocks", "40")
    try:
        disagg.wait_healthy()
        coloc.wait_healthy()
        yield disagg, coloc
    finally:
        assert disagg.stop() == 0 and coloc.stop() == 0


@pytest.fixture(autouse=True)
def blocks_come_back(servers):
    disagg = servers[0]
    start = {"prefill": 40, "decode": 40}
    idle = {role: (n, 0) for role, n in start.items()}
    assert disagg.wait_settled(start, idle=True) == idle, "blocks held before the test"
    yield
    assert disagg.wait_settled(start, timeout=8, idle=True) == idle, "blocks not given back"


def stream(srv: Server, prompt: str, max_tokens: int) -> list[tuple[float, dict]]:
    """(seconds since the request, event) for every server-sent event but [DONE]."""
    t0, out = time.monotonic(), []
    with srv.client.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((time.monotonic() - t0, json.loads(line[6:])))
    return out


def tokens(events) -> list[int]:
    return [t for _, e in events for c in e.get("choices", []) for t in c["token_ids"]]


def colocated_tokens(coloc: Server, prompt: str, max_tokens: int) -> list[int]:
    r = coloc.complete(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_timings_are_present_ordered_and_add_up(servers):
    for srv, disagg in zip(servers, (True, False)):
        kv = srv.complete(prompt="timings " * 8, max_tokens=4, ignore_eos=True).json()["kvflow"]
        t, hops = kv["timings_ms"], kv["hops_ms"]
        want = [m for m in MILESTONES if disagg or m != "kv_done"]
        assert list(t) == want, t
        first_path = want[:want.index("first_token_out") + 1]
        assert all(t[a] <= t[b] for a, b in zip(first_path, first_path[1:])), t
        second_path = ["first_token_sampled"] + want[want.index("first_token_out") + 1:]
        assert all(t[a] <= t[b] for a, b in zip(second_path, second_path[1:])), t
        assert t["first_token_out"] <= t["second_token_out"] and t["allocate_sent"] >= 0
        assert set(hops) == set(HOPS) - (set() if disagg else {"kv_after_first_token",
                                                               "d_second_token"}), hops
        assert all(v >= 0 for v in hops.values()), hops
        assert sum(hops[h] for h in TTFT_HOPS) == pytest.approx(hops["ttft"], abs=0.01)
        assert hops["ttft"] == t["first_token_out"] and hops["ttst"] == t["second_token_out"]
        assert 0 < hops["ttft"] <= kv["ttft_ms"]


def test_first_token_streams_before_the_kv_arrives(servers):
    disagg, coloc = servers
    prompt = SLOW + "the transfer is slow"
    events = stream(disagg, prompt, 4)
    assert tokens(events) == colocated_tokens(coloc, prompt, 4)     # token-identical
    (t1, first), (t2, _) = events[0], events[1]
    assert first["choices"][0]["token_ids"] and "kvflow" not in first
    assert t2 - t1 >= 1.2, (t1, t2)  # token 1 came while D held the transfer for 1.5 s
    t = events[-1][1]["kvflow"]["timings_ms"]
    assert t["kv_done"] - t["first_token_out"] >= 1200, t
    assert events[-1][1]["kvflow"]["hops_ms"]["kv_after_first_token"] >= 1400


def test_max_tokens_1_ends_on_ps_token_and_d_frees_its_blocks(servers):
    disagg, coloc = servers
    prompt = SLOW + "one token only"
    t0 = time.monotonic()
    r = disagg.complete(prompt=prompt, max_tokens=1, ignore_eos=True)
    t_answer = time.monotonic()
    took = t_answer - t0
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == colocated_tokens(coloc, prompt, 1)
    assert body["choices"][0]["finish_reason"] == "length"
    assert took < 1.4, took  # answered on P's token, not after D's 1.5 s transfer
    kv = body["kvflow"]
    assert "blocks" not in kv and kv["decode_instance"].startswith("d-")
    assert list(kv["timings_ms"])[-1] == "first_token_out"
    # D still holds the blocks while the KV arrives (a heartbeat sent after the answer says
    # so), then frees them
    health = None
    while health is None:
        health = disagg.fresh_health(t_answer)
        time.sleep(0.02)
    assert time.monotonic() - t_answer < 1.2  # still within D's 1.5 s hold
    assert [i["free_blocks"] for i in health["instances"] if i["role"] == "decode"] == [38]
    back = disagg.wait_settled({"prefill": 40, "decode": 40}, timeout=5, idle=True)
    assert back == {"prefill": (40, 0), "decode": (40, 0)}
    assert disagg.requests_total("ok") >= 1


def test_transfer_failing_after_the_first_token_is_an_error_event_and_a_502(servers):
    disagg, _ = servers
    before = disagg.requests_total("error")
    events = stream(disagg, BROKEN + "the copy breaks", 4)
    assert len(tokens(events)) == 1                                   # P's token went out
    err = events[-1][1]["error"]
    assert err["type"] == "server_error" and "injected fault" in err["message"], err
    r = disagg.complete(prompt=BROKEN + "again, not streamed", max_tokens=4)
    assert r.status_code == 502 and "KV transfer failed" in r.json()["error"]["message"]
    assert disagg.requests_total("error") == before + 2
