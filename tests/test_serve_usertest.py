"""Bugs found by a new-user test of `python -m kvflow.serve`: a non-streaming client that
disconnects aborts its request (B1), a child that dies before registering stops the server
(B2), strict request types (B3), OpenAI's other completion fields (B4). One server for the
module (P + D over ipc, kvflow-tiny, max_model_len 2048)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from .serve_server import Server, free_port


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-model-len", "2048", "--memory-budget-mb", "64")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _settled(server, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        ok = all(i["free_blocks"] == i["num_blocks"] and i["num_running"] == 0 for i in h["instances"])
        if ok or time.monotonic() > deadline:
            return {i["role"]: (i["free_blocks"], i["num_blocks"], i["num_running"]) for i in h["instances"]}
        time.sleep(0.1)


def test_non_streaming_disconnect_aborts(server):
    """B1: curl -m 1 on a long non-streaming request frees P's and D's blocks at once."""
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2000,
                                            "ignore_eos": True})
    got = _settled(server, timeout=4.0)   # 2000 tokens take ~25 s on 2 CPU cores
    assert all(free == total and running == 0 for free, total, running in got.values()), got


def test_child_dying_before_registering_stops_the_server():
    """B2: a child that exits before registering (bad --backend) makes the server exit non-zero
    promptly, naming the child, its exit code and its error; no child is left running."""
    cmd = [sys.executable, "-m", "kvflow.serve", "--port", str(free_port()), "--backend", "nonsense",
           "--memory-budget-mb", "32", "--max-num-batched-tokens", "64"]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"server still running after 45 s:\n{exc.stdout}\n{exc.stderr}")
    took = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert took < 30, (took, text)
    assert "exited with code 1 before registering" in text, text
    assert "backend='nonsense' is unknown" in text.split("before registering")[-1], text
