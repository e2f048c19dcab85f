"""Issue 14 kind 4 end to end: ipc push (P writes into D's blocks) with separately started
processes -- a router (``--dead-after-s 1 --hung-after-s 1``: a silent P of this host whose
process lives is declared dead after 1 s, not 60), two P's and a D of 4 blocks (one 64-token request
fills it). Prompts marked 7,7,7 make every prefill chunk (16 tokens) of a P 0.4 s slow; prompts
marked 8,8,8 keep their transfer 3 s in flight on D.

- A prefill of 4 slow chunks (1.6 s) outlasts ``--dead-after-s`` and ``--hung-after-s``: P's
  heartbeat thread beats on inside each chunk, so it is not declared dead (not even late) and
  the request completes (it was HTTP 502).
- A P stopped in the middle of a prefill (SIGSTOP: a forward that takes too long) is declared
  dead and its request fails, but its process lives: D keeps the 4 blocks lent to it, so the
  next request waits for them instead of being admitted onto blocks the P writes once it runs
  again (it was, and decoded different tokens than a colocated engine)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.serve.test_reliability_peers import Cluster

PUSH = ["--kv-connector", "ipc-push", "--layerwise-min-tokens", "0", "--max-num-batched-tokens", "16"]
P_ENV = {"KVFLOW_FAULT_CHUNK_DELAY_S": "0.4", "KVFLOW_FAULT_MATCH": "7,7,7"}
D_ENV = {"KVFLOW_FAULT_RECEIVE_DELAY_S": "3", "KVFLOW_FAULT_MATCH": "8,8,8"}
MAX_TOKENS = 8


def prompt(mark: int, seed: int) -> list[int]:
    """56 token ids (64 with the new ones: D's 4 blocks), starting with a 3-token mark."""
    return [mark] * 3 + [(seed + 37 * i) % 240 + 10 for i in range(53)]


def colocated(token_ids: list[int]) -> list[int]:
    """Greedy tokens of one kvflow-tiny engine, prefill in the same 16-token chunks."""
    from kvflow import PagedKVCache
    from kvflow.engine import Engine
    from kvflow.model import load_model
    from kvflow.serve.instance.sampling import sample_token
    model, _ = load_model("kvflow-tiny")
    eng = Engine(model, PagedKVCache(model.kv_spec(16), 8))
    table, n = list(range(4)), len(token_ids)
    out = [sample_token(eng.prefill(token_ids, table, chunk_size=16), 0.0, 0, 0)]
    while len(out) < MAX_TOKENS:
        out.append(sample_token(eng.decode([(out[-1], n + len(out) - 1, table)])[0], 0.0, 0, len(out)))
    return out


@pytest.fixture(scope="module")
def cl():
    c = Cluster(dead_after_s=1, hung_after_s=1)  # a SIGSTOPped P is declared dead within ~1 s
    c.ps = [c.spawn("prefill", *PUSH, env=P_ENV) for _ in range(2)]
    c.d = c.spawn("decode", *PUSH, "--num-blocks", "4", env=D_ENV)
    try:
        c.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 3
               and all(i["paired_with"] for i in h["instances"]), 150, "2 P's and D paired")
        yield c
    finally:
        for p in c.ps:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        c.close()


def complete(cl, token_ids, timeout_s=30):
    return cl.complete(prompt=token_ids, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0,
                       timeout_s=timeout_s)


def test_prefill_longer_than_dead_after_s_heartbeats_between_chunks(cl):
    toks = prompt(7, 1)                          # 4 chunks x 0.4 s > --dead-after-s 1
    t0 = time.monotonic()
    r = complete(cl, toks)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 >= 1.6
    assert r.json()["choices"][0]["token_ids"] == colocated(toks)
    assert not [e for e in cl.health()["errors"] if "missed heartbeats" in e]


def test_blocks_lent_to_a_p_declared_dead_are_not_reused_while_it_lives(cl):
    a, b = prompt(7, 2), prompt(8, 3)
    want_b = colocated(b)
    # P's take requests in turn: after this one, the marked request goes to the other P
    probe = cl.complete(prompt=[5] * 10, max_tokens=2, ignore_eos=True)
    assert probe.status_code == 200
    served = probe.json()["kvflow"]["prefill_instance"]
    slow = next(i for i in cl.health()["instances"] if i["role"] == "prefill" and i["id"] != served)
    th_a, out_a = _in_background(complete, cl, a)
    time.sleep(0.5)                              # the slow P is inside A's prefill
    os.kill(slow["pid"], signal.SIGSTOP)
    try:
        cl.wait(lambda h: all(i["id"] != slow["id"] for i in h["instances"]), 10, "slow P declared dead")
        th_a.join(10)
        assert out_a["r"].status_code == 502
        assert out_a["r"].json()["error"]["message"].startswith(f"prefill instance {slow['id']} died")
        # B needs all 4 of D's blocks: it waits until the stopped P, once it runs again, has
        # finished A's prefill and push (at a load of 16 on 2 cores: 17 s after SIGCONT, and
        # a CI run passed 30 s), so its bound is a hang guard, not a timing
        th_b, out_b = _in_background(complete, cl, b, 120)
        time.sleep(0.7)                          # B is admitted (before the fix) and pushed
    finally:
        os.kill(slow["pid"], signal.SIGCONT)     # the stopped P runs on: it writes A's KV
    th_b.join(120)
    assert out_b["r"].status_code == 200, out_b["r"].text
    assert out_b["r"].json()["choices"][0]["token_ids"] == want_b
    cl.wait(lambda h: len(h["instances"]) == 3 and all(
        i["free_blocks"] == i["num_blocks"] for i in h["instances"]), 10, "P back, blocks free",
        fresh=True)


def _in_background(fn, *args):
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=fn(*args)))
    th.start()
    return th, out
