"""Issue 26: a D killed mid-WRITE over staged nixl (``--kv-connector nixl``, ``{"mode":
"staged"}``, UCX over TCP) and replaced by a D with a new agent, with separately started
processes (tests/serve/test_reliability_peers.py's ``Cluster``). P sleeps 2 s after each layer
group's WRITE of a marked prompt (``KVFLOW_FAULT_WRITE_DELAY_S``; kvflow-tiny's 4 layers, one
per WRITE), so the kill lands between two WRITEs into D's staging slot. The client gets HTTP
502 naming the dead D within a bound, P frees every block, and the new D gets the staging
slot and serves tokens identical to colocated. Before it, a WRITE failing after P's first
token (``KVFLOW_FAULT_WRITE_FAIL``, prompts marked 8,8,8) streams that token and then an error;
after it, a prompt filling the slot's 16 blocks and one of 257 tokens, one over it (refused,
HTTP 400), close the module."""

from __future__ import annotations

import time

import pytest

from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls

from tests.reliability_harness import greedy_tokens
from tests.serve.test_reliability_peers import Cluster, in_background

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
STAGED = ["--kv-connector", "nixl", "--kv-connector-config",
          '{"mode": "staged", "layers_per_copy": 1, "staging_slots": 1}']
UCX = {"UCX_TLS": tcp_tls()}
SLOW_WRITES = dict(UCX, KVFLOW_FAULT_WRITE_DELAY_S="2", KVFLOW_FAULT_MATCH="7,7,7",
                   KVFLOW_FAULT_WRITE_FAIL="8,8,8")  # 8,8,8: layer 0 written, then a failure
PROMPT = "Still serving after the decode instance died."


@pytest.fixture(scope="module")
def cl():
    c = Cluster()
    c.p = c.spawn("prefill", *STAGED, env=SLOW_WRITES)
    c.d = c.spawn("decode", *STAGED, env=UCX)
    try:
        c.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 2, 150, "P, D paired")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(cl):
    """Colocated greedy tokens of the served model and spec (kvflow-tiny: seeded weights)."""
    from kvflow.layout import KVCacheSpec
    from kvflow.model.loader import load_model
    model, tok = load_model("kvflow-tiny")
    spec = KVCacheSpec.from_dict(cl.inst(cl.p.pid)["spec"])
    return lambda text, n=4: greedy_tokens(model, spec, tok.encode(text), n)


def _complete(cl, prompt, n=4):
    return cl.complete(prompt=prompt, max_tokens=n, ignore_eos=True)


def test_a_write_failing_after_the_first_token_streams_it_then_an_error(cl, reference):
    """Served over staged nixl: P's token streams, then the error event names the failed
    WRITE; not streamed it is a 502; with max_tokens 1 the answer is P's token. Every block
    comes back on both sides."""
    from tests.serve.test_serve_first_token import stream, tokens
    start = {i["pid"]: i["num_blocks"] for i in cl.health()["instances"]}
    prompt = "\x08\x08\x08 the WRITE breaks after layer 0"
    d_id = cl.inst(cl.d.pid)["id"]
    events = stream(cl, prompt, 4)
    assert tokens(events) == reference(prompt, 1)  # P's token went out, nothing after it
    err = events[-1][1]["error"]
    assert err["type"] == "server_error", err
    assert err["message"].endswith(f"NIXL WRITE of layers [1, 2) to {d_id} failed: injected "
                                   f"by KVFLOW_FAULT_WRITE_FAIL"), err
    r = _complete(cl, prompt)
    assert r.status_code == 502 and "KVFLOW_FAULT_WRITE_FAIL" in r.json()["error"]["message"]
    r = _complete(cl, prompt, 1)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference(prompt, 1)
    cl.wait(lambda h: all(i["free_blocks"] == start[i["pid"]] and i["num_running"] == 0
                          for i in h["instances"]), 10, "every block back", fresh=True)


def test_d_killed_mid_write_is_a_502_p_frees_and_a_new_d_gets_the_slot(cl, reference):
    want = reference(PROMPT)
    r = _complete(cl, PROMPT)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    p = cl.inst(cl.p.pid)
    old_d = cl.inst(cl.d.pid)
    th, out = in_background(cl.complete, prompt="\x07\x07\x07 D dies between two WRITEs",
                            max_tokens=4)
    time.sleep(3.0)  # P posted layer 0's WRITE (and slept 2 s), then layer 1's: mid-WRITE
    assert th.is_alive()
    cl.d.kill()
    t_kill = time.monotonic()
    th.join(15)
    assert not th.is_alive() and out["t"] - t_kill < 5.0
    assert out["r"].status_code == 502, out["r"].text
    assert out["r"].json()["error"]["message"].startswith(f"decode instance {old_d['id']} died")
    cl.wait(lambda h: cl.inst(cl.p.pid, h)["free_blocks"] == p["num_blocks"]
            and cl.inst(cl.p.pid, h)["num_running"] == 0, 10, "P frees", fresh=True)
    cl.d2 = cl.spawn("decode", *STAGED, env=UCX)
    cl.wait(lambda h: h["status"] == "ok" and cl.inst(cl.d2.pid, h) is not None, 90,
            "new D paired")
    for _ in range(2):
        r = _complete(cl, PROMPT)
        assert r.status_code == 200, (r.text, cl.health()["errors"])
        assert r.json()["choices"][0]["token_ids"] == want
        assert r.json()["kvflow"]["decode_instance"] == cl.inst(cl.d2.pid)["id"]
    d2 = cl.inst(cl.d2.pid)
    cl.wait(lambda h: cl.inst(cl.d2.pid, h)["free_blocks"] == d2["num_blocks"]
            and cl.inst(cl.p.pid, h)["free_blocks"] == p["num_blocks"], 10, "both free",
            fresh=True)


def test_a_prompt_at_the_staging_slot_is_served_and_one_token_over_is_refused(cl, reference):
    """--max-model-len 256, 16-token blocks: a slot holds 16 blocks (256 tokens), the longest
    prompt's. 253 bytes + <bos> = 254 tokens (+ max_tokens 2) move 16 blocks into it; a prompt
    of 257 tokens, one over the slot, is refused by the router before any instance sees it."""
    at = ("staging slot " * 20)[:253]
    r = _complete(cl, at, 2)
    assert r.status_code == 200, r.text
    assert r.json()["kvflow"]["blocks"] == 16
    assert r.json()["choices"][0]["token_ids"] == reference(at, 2)
    r = _complete(cl, at + "!!!", 1)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("prompt (257 tokens) + max_tokens (1) = 258 "
                                            "exceeds max_model_len=256")
