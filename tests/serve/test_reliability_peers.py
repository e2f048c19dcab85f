"""Failure kinds 3, 6 and 8 with separately started processes: a router (`--role router`),
one P and two Ds started at once (one with a KV cache no connector maps: kvflow-llama-32l's
32 layers, 8 KV heads of 128 against kvflow-tiny's 4, 2 of 32), then peers killed and
restarted. Marked prompts (three BEL bytes, token ids 7,7,7) get a 3 s prefill delay on P and
a 3 s in-flight transfer on D, so a kill lands at a known stage. The router sees a kill by the process's exit (same host, 0.1 s
ticks); heartbeats may stop for 5 s before it declares an instance dead, as a first prefill on 2
shared, busy cores can take over 1 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvflow.segments import Owner
from kvflow.segments import SHM_DIR

from kvflow.bench.ports import free_port

from tests.serve_server import heartbeats_after, pid_alive

MARK = "\x07\x07\x07"
FAULTS = {"KVFLOW_FAULT_PREFILL_DELAY_S": "3", "KVFLOW_FAULT_RECEIVE_DELAY_S": "3",
          "KVFLOW_FAULT_MATCH": "7,7,7"}
COMMON = ["--max-model-len", "256", "--num-blocks", "40", "--layerwise-min-tokens", "100000",
          "--kv-lease-s", "3"]


class Cluster:
    """A router started alone (``--dead-after-s dead_after_s``, ``--hung-after-s
    hung_after_s``: how long a silent instance of this host whose process lives is only
    late); instances join by ``spawn``."""

    def __init__(self, dead_after_s: float = 5, hung_after_s: float = 60) -> None:
        self.port, self.cport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.spawn("router", "--port", str(self.port), "--control-port", str(self.cport),
                   "--dead-after-s", str(dead_after_s), "--hung-after-s", str(hung_after_s))
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def spawn(self, role, *args, env=None):
        extra = [] if role == "router" else ["--router-url", f"tcp://127.0.0.1:{self.cport}", *COMMON]
        proc = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--role", role, *extra, *args],
                                env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def health(self):
        try:
            return self.client.get("/health").json()
        except httpx.TransportError:
            return {"status": "down", "instances": [], "errors": []}

    def wait(self, pred, timeout=60.0, what="condition", fresh=False):
        """Poll /health until ``pred(health)``; with ``fresh``, only on snapshots whose every
        count comes from a heartbeat sent after the wait began (:func:`heartbeats_after`)."""
        start = time.monotonic()
        while time.monotonic() < start + timeout:
            t_ask = time.monotonic()
            h = self.health()
            if (not fresh or heartbeats_after(h, start, t_ask)) and pred(h):
                return h
            time.sleep(0.05)
        raise AssertionError(f"{what} not reached in {timeout} s: {self.health()}")

    def inst(self, pid, h=None):
        return next((i for i in (h or self.health())["instances"] if i["pid"] == pid), None)

    def complete(self, timeout_s: float = 30, **body):
        return self.client.post("/v1/completions", json=body, timeout=timeout_s)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.client.close()


@pytest.fixture(scope="module")
def cl():
    c = Cluster()
    c.p = c.spawn("prefill", env=FAULTS)
    c.d_bad = c.spawn("decode", "--model", "kvflow-llama-32l")
    c.d = c.spawn("decode", env=FAULTS)
    try:
        c.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 3, 150, "P, D, D registered")
        yield c
    finally:
        c.close()


def in_background(fn, **kw):
    out = {}
    th = threading.Thread(target=lambda: out.update(r=fn(**kw), t=time.monotonic()))
    th.start()
    return th, out


def test_instances_started_at_once_get_distinct_ports_and_names(cl):
    insts = cl.health()["instances"]
    assert len({i["id"] for i in insts}) == 3
    d_addrs = [i["data_addr"] for i in insts if i["role"] == "decode"]
    assert len(d_addrs) == 2 and d_addrs[0] != d_addrs[1]
    assert all(a.startswith("tcp://127.0.0.1:") for a in d_addrs)


def test_mismatch_refused_naming_both_values_and_p_keeps_serving(cl):
    p, bad, good = cl.inst(cl.p.pid), cl.inst(cl.d_bad.pid), cl.inst(cl.d.pid)
    h = cl.wait(lambda h: len(h["errors"]) >= 2, 10, "both refusals")
    def refusal(a, b, x, y):  # a's values first, as the instance that checks names them
        return (f"KV cache spec mismatch, pairing refused: num_layers: {x[0]} ({a}) vs {y[0]} "
                f"({b}); num_kv_heads: {x[1]} ({a}) vs {y[1]} ({b}); head_dim: {x[2]} ({a}) vs "
                f"{y[2]} ({b}); P and D may differ only in block_size, layout (NHD/HND) and dtype")
    tiny, big = (4, 2, 32), (32, 8, 128)
    assert refusal(p["id"], bad["id"], tiny, big) in h["errors"], h["errors"]
    assert refusal(bad["id"], p["id"], big, tiny) in h["errors"], h["errors"]
    assert bad["paired_with"] == [] and p["paired_with"] == [good["id"]]
    for _ in range(3):
        r = cl.complete(prompt="Still serving the matching decode instance.", max_tokens=4,
                        ignore_eos=True)
        assert r.status_code == 200, (r.text, cl.health()["errors"])
        assert r.json()["kvflow"]["decode_instance"] == good["id"]
    cl.reference = r.json()["choices"][0]["token_ids"]
    bad = cl.inst(cl.d_bad.pid)
    assert bad["free_blocks"] == bad["num_blocks"] and bad["num_running"] == 0  # nothing written


def test_kill_d_mid_transfer_p_frees_within_2s_then_a_new_d_works(cl):
    p = cl.inst(cl.p.pid)
    prompt = MARK + "D will die mid-transfer"
    blocks = -(-(1 + len(prompt)) // 16)            # <bos> + one token per byte, 16 per block
    th, out = in_background(cl.complete, prompt=prompt, max_tokens=4)
    def sent(h):  # P's prefill is over: this request (only) is pending on P, holding its blocks
        i = cl.inst(cl.p.pid, h)
        return i["num_running"] == 1 and i["free_blocks"] == p["num_blocks"] - blocks
    cl.wait(sent, 15, "P sent, holds blocks", fresh=True)
    time.sleep(0.5)                      # D holds the transfer in flight (RECEIVING)
    cl.d.kill()
    t_kill = time.monotonic()
    cl.wait(lambda h: cl.inst(cl.p.pid, h)["free_blocks"] == p["num_blocks"], 2.0, "P frees", fresh=True)
    assert time.monotonic() - t_kill < 2.0
    # same host: the router saw the process exit (0.1 s ticks), not the heartbeats stop (5 s)
    assert any(e.endswith(f"(pid {cl.d.pid}) exited") for e in cl.health()["errors"])
    th.join(10)
    assert out["r"].status_code == 502 and "died" in out["r"].json()["error"]["message"]
    # A new D pairs with the same P and serves.
    cl.d2 = cl.spawn("decode")
    cl.wait(lambda h: h["status"] == "ok" and cl.inst(cl.d2.pid) is not None, 60, "new D paired")
    r = cl.complete(prompt="Still serving the matching decode instance.", max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, (r.text, cl.health()["errors"])
    assert r.json()["choices"][0]["token_ids"] == cl.reference
    assert r.json()["kvflow"]["decode_instance"] == cl.inst(cl.d2.pid)["id"]


def test_kill_p_mid_prefill_d_frees_and_client_gets_an_error(cl):
    d = cl.inst(cl.d2.pid)
    old_p = cl.inst(cl.p.pid)
    th, out = in_background(cl.complete, prompt=MARK + "P will die mid-prefill", max_tokens=4)
    cl.wait(lambda h: cl.inst(cl.d2.pid, h)["free_blocks"] < d["num_blocks"], 15, "D allocated",
            fresh=True)
    time.sleep(0.5)                      # P sleeps 3 s inside the prefill
    cl.p.kill()
    t_kill = time.monotonic()
    cl.p.wait(5)                         # reaped, as its parent would
    th.join(10)
    assert not th.is_alive() and out["t"] - t_kill < 3.0
    assert out["r"].status_code == 502
    assert out["r"].json()["error"]["message"].startswith(f"prefill instance {old_p['id']} died")
    cl.wait(lambda h: cl.inst(cl.d2.pid, h)["free_blocks"] == d["num_blocks"], 3.0, "D frees",
            fresh=True)
    cl.old_p = old_p


def test_restart_after_crash_ignores_and_removes_leftovers(cl):
    # What a crashed P leaves when nobody cleaned up: a segment named after its dead process.
    me = Owner.me()
    stale = f"kvflow-prefill-{Owner(cl.p.pid, 1, me.pid_ns, me.boot).tag}-{'ab' * 6}"
    path = os.path.join(SHM_DIR, stale)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"\xff" * 4096)
    os.close(fd)
    assert not pid_alive(cl.p.pid)
    p2 = cl.spawn("prefill")
    cl.wait(lambda h: h["status"] == "ok" and cl.inst(p2.pid) is not None, 60, "new P paired")
    assert not os.path.exists(path), "stale segment of a dead owner not removed"
    new = cl.inst(p2.pid)
    assert new["shm_name"] not in (stale, cl.old_p["shm_name"])
    assert not os.path.exists(os.path.join(SHM_DIR, cl.old_p["shm_name"]))
    r = cl.complete(prompt="Still serving the matching decode instance.", max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, (r.text, cl.health()["errors"])
    assert r.json()["choices"][0]["token_ids"] == cl.reference
    assert r.json()["kvflow"]["prefill_instance"] == new["id"]
    d = cl.inst(cl.d2.pid)
    assert cl.wait(lambda h: cl.inst(p2.pid, h)["free_blocks"] == new["num_blocks"]
                   and cl.inst(cl.d2.pid, h)["free_blocks"] == d["num_blocks"], 3, "all free", fresh=True)
