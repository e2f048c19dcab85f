"""P dying in the middle of a request: the client gets an error within 5 s, D gets every block
back, P's shared-memory segments (its cache, and its signal segment once the server stops) are
removed; the server still shuts down cleanly."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest

from kvflow.segments import SHM_DIR

from tests.serve_server import Server, pid_alive


@pytest.fixture(scope="module")
def server():
    # P sleeps 3 s before each prefill (test-only fault injection), so the kill lands mid-request.
    # Every prompt goes layerwise, so P has a signal segment (none when no prompt can).
    srv = Server("--kv-connector", "ipc-pull", "--layerwise-min-tokens", "0",
                 env={"KVFLOW_FAULT_PREFILL_DELAY_S": "3"})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_prefill_death_mid_request(server):
    d0 = server.instance("decode")
    p0 = server.instance("prefill")
    assert d0["free_blocks"] == d0["num_blocks"]
    result = {}

    def client():
        r = server.complete(prompt="The prefill instance will not live to see this prompt through.",
                            max_tokens=16)
        result["status"], result["body"], result["t"] = r.status_code, r.json(), time.monotonic()

    # P's signal segment (layerwise transfer, created at pairing) exists while P lives
    signals = os.path.join(SHM_DIR, f"kvflow-sig-{p0['id'].replace('-', '_')}-*")
    assert len(glob.glob(signals)) == 1
    th = threading.Thread(target=client)
    th.start()
    deadline = time.monotonic() + 10
    while server.instance("decode")["free_blocks"] == d0["num_blocks"]:  # D allocated: P is prefilling
        assert time.monotonic() < deadline, "D never allocated the request's blocks"
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(p0["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    th.join(10)
    assert not th.is_alive(), "client still waiting 10 s after P died"
    assert result["t"] - t_kill < 5.0
    assert result["status"] == 502
    msg = result["body"]["error"]["message"]
    assert msg.startswith(f"prefill instance {p0['id']} died") and "exited" in msg
    # D frees its blocks; the dead P's segment is gone; /health says not ready.
    deadline = time.monotonic() + 5
    while server.instance("decode")["free_blocks"] != d0["num_blocks"]:
        assert time.monotonic() < deadline, "D kept the dead request's blocks"
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(SHM_DIR, p0["shm_name"]))
    h = server.client.get("/health")
    assert h.status_code == 503 and any(p0["id"] in e for e in h.json()["errors"])
    r = server.complete(prompt="anyone there?", max_tokens=2)
    assert r.status_code == 503 and "no prefill/decode pair is ready" in r.json()["error"]["message"]
    # Shutdown still leaves nothing behind: no process, and no segment of any kind of the
    # killed P (its signal segment was left behind before issue 14).
    pids = set(server.seen_pids)
    assert server.stop() == 0
    assert not [p for p in pids if pid_alive(p)]
    assert glob.glob(signals) == []
