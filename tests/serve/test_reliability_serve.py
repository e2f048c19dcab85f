"""Failure kinds 1, 2, 5, 7, 9 end to end on one `python -m kvflow.serve` (P + D over ipc,
prefix caching on D). Faults are injected only into requests whose prompt holds three BEL
bytes (token ids 7,7,7): P sleeps 2 s before their prefill, D keeps their transfer in flight
2 s. Every test ends with P's and D's free blocks at their start and nothing running."""

from __future__ import annotations

import os
import stat
import time

import httpx
import pytest
import zmq

from kvflow.serve.protocol import Tokens, encode
from kvflow.segments import SHM_DIR

from tests.serve_server import Server

MARK = "\x07\x07\x07"
FAULTS = {"KVFLOW_FAULT_PREFILL_DELAY_S": "2", "KVFLOW_FAULT_RECEIVE_DELAY_S": "2",
          "KVFLOW_FAULT_MATCH": "7,7,7"}


@pytest.fixture(scope="module")
def server():
    srv = Server("--kv-connector", "ipc-pull", "--layerwise-min-tokens", "100000", "--enable-prefix-caching",
                 "--num-blocks", "40", "--admit-timeout-s", "1.5", "--kv-lease-s", "3",
                 env=FAULTS)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def blocks_come_back(server):
    start = {"prefill": 40, "decode": 40}
    idle = {role: (n, 0) for role, n in start.items()}
    assert server.wait_settled(start, idle=True) == idle, "blocks held or work running before the test"
    yield
    assert server.wait_settled(start, timeout=6, idle=True) == idle, "blocks not given back or work left waiting"


def test_prefix_hit_moves_only_missing_blocks(server):
    head = "A" * 31                                    # <bos> + 31 bytes = 2 full blocks
    a = server.complete(prompt=head, max_tokens=4, ignore_eos=True).json()
    assert a["kvflow"]["blocks"] == 2 and a["kvflow"]["cached_blocks"] == 0
    b = server.complete(prompt=head + "B" * 48, max_tokens=6, ignore_eos=True).json()  # 80 tokens
    assert b["usage"]["prompt_tokens"] == 80
    assert b["kvflow"]["blocks"] == 3 and b["kvflow"]["cached_blocks"] == 2
    spec = server.instance("decode")["spec"]
    per_block = 2 * spec["num_layers"] * 16 * spec["num_kv_heads"] * spec["head_dim"] * 4
    assert b["kvflow"]["payload_bytes"] == 3 * per_block
    c = server.complete(prompt=head, max_tokens=4, ignore_eos=True).json()              # k = all
    assert c["kvflow"]["blocks"] == 0 and c["kvflow"]["cached_blocks"] == 2
    assert c["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]


def _disconnect_after(server, seconds, prompt, max_tokens=8):
    """A streaming client that closes its connection ``seconds`` after it sent the request
    (True), or False if the stream ended before. A wall-clock deadline, not a read timeout:
    P's first token is streamed before the transfer ends, so the stream is not silent then."""
    import asyncio

    async def read() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=seconds + 30) as c:
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "stream": True, "max_tokens": max_tokens}) as r:
                async for _ in r.aiter_lines():
                    pass
    try:
        asyncio.run(asyncio.wait_for(read(), seconds))  # cancelled: the connection closes
    except asyncio.TimeoutError:
        return True
    return False


@pytest.mark.parametrize("stage, after", [("prefilling", 1.0), ("mid-transfer", 3.0)])
def test_client_disconnect_while_prefilling_or_mid_transfer(server, stage, after):
    before = server.requests_total("aborted"), server.requests_total("error")
    assert _disconnect_after(server, after, MARK + stage)
    deadline = time.monotonic() + 4
    while server.requests_total("aborted") == before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (server.requests_total("aborted"), server.requests_total("error")) == (before[0] + 1, before[1])


def test_client_disconnect_while_queued_behind_another_prefill(server):
    import threading
    th = threading.Thread(target=server.complete, kwargs=dict(prompt=MARK + "first", max_tokens=2))
    th.start()
    time.sleep(0.3)
    assert _disconnect_after(server, 1.0, MARK + "queued behind the first")
    th.join(20)


def test_client_disconnect_while_decoding(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x" * 99, "max_tokens": 400,
                                                       "stream": True, "ignore_eos": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
        # leaving the block closes the stream mid-decode: D frees the 32 blocks


def test_d_out_of_blocks_waits_a_bounded_time_then_503(server):
    # A marked 100 + 400-token request holds 32 of D's 40 blocks for >= 4 s (P's prefill and
    # D's transfer are slowed); an 11-block request meanwhile waits --admit-timeout-s, then 503.
    import threading
    first = {}

    def hold() -> None:  # its own client: 400 tokens on a loaded 2-core machine may take > 60 s
        with httpx.Client(base_url=server.url, timeout=180) as c:
            first["r"] = c.post("/v1/completions", json={"prompt": MARK + "x" * 96, "max_tokens": 400})
    th = threading.Thread(target=hold)
    th.start()
    deadline = time.monotonic() + 10
    while server.free_blocks()["decode"] != 8:
        assert time.monotonic() < deadline, "D never allocated the first request"
        time.sleep(0.05)
    t0 = time.monotonic()
    busy = server.complete(prompt="y" * 100, max_tokens=60)
    assert busy.status_code == 503 and 1.5 <= time.monotonic() - t0 < 4
    assert busy.json()["error"]["message"] == "requested 11 blocks but only 8 of 40 are free"
    th.join(180)
    assert first["r"].status_code == 200, first["r"].text  # the request that held the blocks


def test_over_capacity_is_400_before_any_transfer(server):
    def moved():
        text = server.client.get("/metrics").text
        return [ln for ln in text.splitlines() if ln.startswith("kvflow_transfer_bytes_total")]
    before = moved()
    r = server.complete(prompt="z" * 300, max_tokens=300)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "prompt (301 tokens) + max_tokens (300) = 601 exceeds "
                                 "max_model_len=512", "type": "invalid_request_error",
                                 "param": "max_tokens", "code": None}
    assert moved() == before


def test_quick_soak_passes(server, tmp_path):
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "kvflow.bench", "soak", "--url", server.url,
                          "--quick", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert run.returncode == 0, run.stdout + run.stderr
    (out,) = tmp_path.glob("soak-*.json")
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["soak_window"] * 3 + ["soak"]  # 12 s in 4 s windows
    res = rows[-1]
    assert res["requests"] > 0 and res["pass"] is True
    assert (res["leaked_blocks"], res["hung"], res["server_restarts"]) == (0, 0, 0)
    assert res["ok"] + res["errors"] + res["aborted"] == res["requests"]
    assert res["ttft_p50_ms"] is not None and res["ttft_p99_ms"] >= res["ttft_p50_ms"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": 5}, "prompt"), ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"), ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [256, 258]}, "prompt"),
    ({"prompt": [256, -1]}, "prompt"), ({"prompt": [256, 2**70]}, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"), ({"prompt": "hi", "seed": 2**64}, "seed"),
])
def test_bad_json_fields_are_400_naming_the_field(server, body, field):
    r = server.complete(**body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_non_utf8_and_non_json_bodies_are_400(server):
    for raw in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800 lone surrogate"}', b"not json", b""):
        r = server.client.post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        err = r.json()["error"]
        assert err["param"] in ("body", "prompt") and err["message"].startswith(err["param"]), err
    assert server.complete(prompt="still serving", max_tokens=2).status_code == 200


def test_garbage_control_frames_and_late_completions_are_ignored(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    d = server.instance("decode")
    sock.setsockopt(zmq.IDENTITY, d["id"].encode())  # even posing as D
    sock.connect(server.health()["control_addr"])
    for frame in (b"", b"\x00" * 50, b"\xc1garbage", encode(Tokens(req_id="cmpl-gone", token_ids=[1],
                                                                   finished=True))):
        sock.send(frame)
    sock.send_multipart([b"a", b"b", b"c"])
    time.sleep(0.5)
    sock.close()
    ctx.term()
    assert server.complete(prompt="still serving", max_tokens=2).status_code == 200


def test_shared_memory_is_0600_with_unguessable_names(server):
    p = server.instance("prefill")
    name = p["shm_name"]
    role, owner, rand = name.split("-")[1:]
    assert role == "prefill" and len(rand) >= 12 and int(rand, 16) >= 0
    assert owner.split(".")[0] == str(p["pid"])  # pid.start.pidns.boot: kvflow/segments.py
    mode = os.stat(os.path.join(SHM_DIR, name)).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert server.health()["control_addr"].startswith("tcp://127.0.0.1:")
