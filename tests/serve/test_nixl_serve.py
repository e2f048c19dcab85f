"""Served on CPU with ``--kv-connector nixl`` (direct and staged) over UCX's TCP transport
(``UCX_TLS=tcp``): greedy outputs equal colocated serving token for token, every block comes
back on P and D, ``--host 0.0.0.0`` advertises a dialable address (the direct server's, which
every direct test then dials), P's first token streams before D has the KV, and a P killed
mid-prefill or a D killed mid-request is an HTTP 502 after which the survivor holds no block;
idle, P and D do not spin, and they listen on ``--host`` only. Skipped where NIXL is not
installed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvflow.bench.ports import listening
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls

from tests.procnet import cpu_seconds
from tests.serve_server import Server, healthy
from tests.serve.test_serve_first_token import stream, tokens
from tests.serve.test_serve import MAX_TOKENS, prompt_of

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
UCX = {"UCX_TLS": tcp_tls()}
LENGTHS = [1, 15, 16, 17, 150, 300]
MARK = "\x07\x07\x07"  # prompts holding token ids 7,7,7 get the fault delays
#: the direct server holds an arrived marked transfer 1.5 s on D (P's token goes out first)
SLOW_D = {"KVFLOW_FAULT_RECEIVE_DELAY_S": "1.5", "KVFLOW_FAULT_MATCH": "7,7,7"}


@pytest.fixture(scope="module")
def servers():
    s = {"colocated": Server("--mode", "colocated"),
         "direct": Server("--kv-connector", "nixl", "--block-size", "8",
                          "--max-num-batched-tokens", "64", "--host", "0.0.0.0",
                          "--advertise-host", "127.0.0.2", env=dict(UCX, **SLOW_D)),
         "staged": Server("--kv-connector", "nixl", "--kv-connector-config",
                          '{"mode": "staged", "layers_per_copy": 1}', env=UCX)}
    with healthy(s):
        yield s


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_nixl_is_token_identical_to_colocated_and_gives_every_block_back(servers, mode):
    srv, ref = servers[mode], servers["colocated"]
    start = srv.total_blocks()
    spec = srv.instance("decode")["spec"]
    bytes_per_block = 2 * spec["num_layers"] * spec["block_size"] * spec["num_kv_heads"] \
        * spec["head_dim"] * 4
    for n in LENGTHS:
        want = ref.complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        r = srv.complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"], \
            f"{mode}: prompt of {n} tokens"
        kv = r.json()["kvflow"]
        blocks = -(-n // spec["block_size"])
        assert (kv["kv_connector"], kv["blocks"]) == ("nixl", blocks)
        assert kv["payload_bytes"] == blocks * bytes_per_block
        assert kv["layerwise"] is True  # every prompt moves per layer group while P prefills
    assert srv.wait_free_blocks(start) == start


def test_wildcard_host_advertises_a_dialable_address(servers):
    srv = servers["direct"]  # --host 0.0.0.0 --advertise-host 127.0.0.2
    assert srv.health()["control_addr"].startswith("tcp://127.0.0.2:")
    assert srv.instance("decode")["data_addr"].startswith("tcp://127.0.0.2:")


def test_first_token_streams_before_the_kv_is_in(servers):
    """P sends its first token before waiting for its WRITEs; D holds the arrived KVPushed
    1.5 s (``KVFLOW_FAULT_RECEIVE_DELAY_S``), so token 1 reaches the client that much before
    token 2."""
    srv, ref = servers["direct"], servers["colocated"]
    start = srv.total_blocks()
    prompt = MARK + " the decode instance holds this transfer"
    events = stream(srv, prompt, 4)
    want = ref.complete(prompt=prompt, max_tokens=4, ignore_eos=True)
    assert tokens(events) == want.json()["choices"][0]["token_ids"]
    (t1, _), (t2, _) = events[0], events[1]
    assert t2 - t1 >= 1.2, (t1, t2)
    t = events[-1][1]["kvflow"]["timings_ms"]
    assert t["kv_done"] - t["first_token_out"] >= 1200, t
    assert srv.wait_free_blocks(start) == start


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_killed_mid_request_is_502_and_the_survivor_holds_no_block(victim):
    """P sleeps 3 s inside each prefill chunk of a marked prompt (``KVFLOW_FAULT_CHUNK_DELAY_S``);
    the victim is killed meanwhile. The client gets HTTP 502 naming the dead instance; the
    survivor's free blocks return to their start (D's lent blocks too: the router saw P exit)."""
    env = dict(UCX, KVFLOW_FAULT_CHUNK_DELAY_S="3", KVFLOW_FAULT_MATCH="7,7,7")
    srv = Server("--kv-connector", "nixl", "--max-num-batched-tokens", "16", env=env)
    try:
        srv.wait_healthy()
        survivor = "decode" if victim == "prefill" else "prefill"
        start = srv.total_blocks()
        out = {}
        th = threading.Thread(target=lambda: out.update(r=srv.complete(
            prompt=MARK + " this prompt is long enough to take two chunks", max_tokens=4)))
        th.start()
        time.sleep(2.0)  # P is inside its first chunk; D has allocated
        pid = srv.instance(victim)["pid"]
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        th.join(30)
        r = out["r"]
        assert r.status_code == 502, r.text
        assert f"{victim} instance" in r.json()["error"]["message"] and "died" in \
            r.json()["error"]["message"]
        assert time.monotonic() - t_kill < 5
        got = srv.wait_settled({survivor: start[survivor]}, timeout=10, idle=True)
        assert got[survivor] == (start[survivor], 0)
    finally:
        srv.stop()


def test_idle_instances_do_not_spin(servers):
    """An idle nixl P and D use well under a tenth of a core: NIXL's own progress thread (it
    polls with no delay) used 0.66 CPU-seconds per second each at load 8 (docs/nixl.md); kvflow's
    progress driver polls every 10 ms while nothing moves."""
    srv = servers["staged"]
    pids = {role: srv.instance(role)["pid"] for role in ("prefill", "decode")}
    time.sleep(0.5)  # the tests before left nothing in flight
    t0, before = time.monotonic(), {r: cpu_seconds(p) for r, p in pids.items()}
    time.sleep(3.0)
    dt = time.monotonic() - t0
    used = {r: (cpu_seconds(p) - before[r]) / dt for r, p in pids.items()}
    assert all(u < 0.1 for u in used.values()), used


def test_nixl_listens_only_on_host(servers):
    """With the default ``--host 127.0.0.1``, every listening socket of P and D (UCX's TCP
    listeners among them) is on the loopback address: UCX_NET_DEVICES is set to ``lo`` before
    the agent is created (the other tests of this module show that transfers still work)."""
    srv = servers["staged"]
    for role in ("prefill", "decode"):
        socks = listening(srv.instance(role)["pid"])
        assert socks, role
        assert {host for host, _ in socks} <= {"127.0.0.1", "::1"}, (role, socks)
