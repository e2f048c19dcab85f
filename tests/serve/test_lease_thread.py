"""Issue 26: D's lease renewals leave from its heartbeat thread, not from its loop.

A router, P and D started as separate processes over ipc-pull (D reads P's exported cache),
``--kv-lease-s 1.5``. D's decode steps of requests marked 5,5,5 sleep 3.5 s
(``KVFLOW_FAULT_STEP_DELAY_S``): D's loop handles no message for 3.5 s, more than P's lease.
Request B is allocated on D just before such a step; P prefills it and holds its blocks while
D's loop is blocked. Before, D renewed from its loop: no renewal for 3.5 s, P freed B's blocks
after 1.5 s ("no ack or lease renewal"), and D, reading more than 0.8 x the lease after P's send,
refused the transfer (HTTP 502). Now the thread renews every 0.2 s: P keeps the blocks and B
ends with the tokens of a colocated engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from tests.reliability_harness import greedy_tokens
from tests.serve.test_reliability_peers import COMMON, Cluster

LEASE_S, STEP_S = 1.5, 3.5  # a step under the router's 5 s wait for Allocated
ARGS = ["--kv-connector", "ipc-pull", "--kv-lease-s", f"{LEASE_S:g}"]
SLOW = [5, 5, 5] + [(11 * i) % 200 + 20 for i in range(40)]   # its decode steps take STEP_S
OTHER = [(7 * i) % 200 + 30 for i in range(36)]                # allocated before a slow step


class LoggedCluster(Cluster):
    """A :class:`Cluster` whose processes' stderr goes to ``<logdir>/<role>-<n>.log``
    (``logs[0]``: the router's, started with ``router_args`` too)."""

    def __init__(self, logdir, router_args=(), **kw) -> None:
        self.logdir, self.logs, self.router_args = logdir, [], list(router_args)
        super().__init__(**kw)

    def spawn(self, role, *args, env=None):
        extra = self.router_args if role == "router" else \
            ["--router-url", f"tcp://127.0.0.1:{self.cport}", *COMMON]
        path = self.logdir / f"{role}-{len(self.logs)}.log"
        self.logs.append(path)
        with open(path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--role", role, *extra,
                                     *args], env=dict(os.environ, **(env or {})),
                                    stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(proc)
        return proc


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    c = LoggedCluster(tmp_path_factory.mktemp("lease-thread"))
    c.p = c.spawn("prefill", *ARGS)
    c.p_log = c.logs[-1]
    c.d = c.spawn("decode", *ARGS, env={"KVFLOW_FAULT_STEP_DELAY_S": f"{STEP_S:g}",
                                         "KVFLOW_FAULT_MATCH": "5,5,5"})
    try:
        c.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 2, 150, "P and D paired")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference():
    from kvflow.model import load_model
    model, _ = load_model("kvflow-tiny")
    return lambda ids, n: greedy_tokens(model, model.kv_spec(16), ids, n)


def test_d_has_a_lease_socket_of_its_own_on_host(cl):
    d = cl.inst(cl.d.pid)
    assert d["lease_addr"].startswith("tcp://127.0.0.1:") and d["lease_addr"] != d["data_addr"]
    assert cl.inst(cl.p.pid)["lease_addr"] == ""


def test_a_blocked_d_loop_still_renews_and_p_keeps_the_blocks(cl, reference):
    slow: dict = {}
    first = threading.Event()

    def stream_slow():  # SLOW: P's token at once, then 2 decode steps of STEP_S each on D
        with cl.client.stream("POST", "/v1/completions", timeout=120, json={
                "prompt": SLOW, "max_tokens": 3, "ignore_eos": True, "stream": True}) as r:
            slow["status"], slow["tokens"] = r.status_code, []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    slow["tokens"] += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    first.set()
        first.set()

    th = threading.Thread(target=stream_slow)
    th.start()
    assert first.wait(60), slow
    # D is in (or about to start) a STEP_S step: OTHER is allocated before the next one, and
    # its KV, sent by P meanwhile, waits for D's loop longer than the lease
    r = cl.complete(prompt=OTHER, max_tokens=4, ignore_eos=True)
    th.join(120)
    assert r.status_code == 200, (r.text, cl.health()["errors"])
    body = r.json()
    transfer_ms = body["kvflow"]["transfer_ms"]
    assert transfer_ms > LEASE_S * 1e3, f"D read the KV {transfer_ms} ms after P sent it"
    assert body["choices"][0]["token_ids"] == reference(OTHER, 4)
    assert slow["status"] == 200 and slow["tokens"] == reference(SLOW, 3), slow
    assert "no ack or lease renewal" not in cl.p_log.read_text()     # P never freed them
    # P frees on D's ack and reports at its next beat (0.2 s), well inside the 1.5 s lease
    p = cl.inst(cl.p.pid, cl.wait(lambda h: True, 1.0, "a heartbeat after the ack", fresh=True))
    assert p["free_blocks"] == p["num_blocks"]   # the ack gave them back
