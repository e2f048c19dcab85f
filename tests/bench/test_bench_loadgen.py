"""The serve load generator against a tiny fake OpenAI-shaped SSE server (FastAPI + uvicorn in a
thread): TTFT / TPOT / ITL from the stream, goodput against SLOs, workload and arrival shapes,
and the ``serve --url`` subcommand end to end."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.bench import loadgen
from kvflow.bench.__main__ import main

FIRST_S, GAP_S = 0.08, 0.02  # the fake server's time to first token and between tokens
LONG = 60  # prompts of more tokens are "long": while one streams, every gap is 3x as long
_LONG_IN_FLIGHT = [0]


def _fake_app():
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        if body["max_tokens"] > 100:
            return JSONResponse({"error": "too long"}, status_code=400)
        n_prompt = len(body["prompt"])

        long = n_prompt > LONG

        async def events():
            _LONG_IN_FLIGHT[0] += long
            try:
                await asyncio.sleep(FIRST_S)
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(GAP_S * (3 if _LONG_IN_FLIGHT[0] else 1))
                    yield _chunk(i, body["max_tokens"], n_prompt)
            finally:
                _LONG_IN_FLIGHT[0] -= long
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


def _chunk(i, max_tokens, n_prompt):
    chunk = {"choices": [{"text": f"t{i}", "index": 0}]}
    if i == max_tokens - 1:
        chunk["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": i + 1}
        chunk["kvflow"] = {"payload_bytes": 1000 * n_prompt, "transfer_ms": 1.5}
    return f"data: {json.dumps(chunk)}\n\n"


@pytest.fixture(scope="module")
def fake_url():
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(10)


def test_stream_timings_against_fake_server(fake_url):
    work = [loadgen.Request([65] * 10, 5, 10), loadgen.Request([66] * 3, 1, 3),
            loadgen.Request([67] * 3, 500, 3)]
    results, dur = asyncio.run(loadgen.run_load(fake_url, work, [0.0, 0.0, 0.0], model="m"))
    ok, one, bad = results
    assert ok.ok and ok.output_tokens == 5 and ok.prompt_tokens == 10
    assert ok.kvflow == {"payload_bytes": 10000, "transfer_ms": 1.5}
    assert FIRST_S <= ok.ttft_s < FIRST_S + 0.5
    # a gap seen by the client may shrink (two chunks read together on a loaded host), but the
    # last token cannot come before the server sent it: first token + 4 gaps
    assert len(ok.itl_s) == 4 and all(0 <= x < GAP_S + 0.3 for x in ok.itl_s)
    assert ok.e2e_s >= FIRST_S + 4 * GAP_S and sum(ok.itl_s) <= ok.e2e_s - ok.ttft_s
    assert ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / 4)
    assert one.ok and one.output_tokens == 1 and one.tpot_s is None and one.itl_s == []
    assert not bad.ok and bad.error.startswith('HTTP 400: {"error":"too long"}')
    s = loadgen.summarize(results, dur, slo_ttft_ms=10_000, slo_tpot_ms=10_000)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["goodput_rps"] == pytest.approx(2 / dur) and s["slo_attainment"] == pytest.approx(2 / 3)
    strict = loadgen.summarize(results, dur, slo_ttft_ms=FIRST_S * 1e3 / 2, slo_tpot_ms=10_000)
    assert strict["goodput_rps"] == 0 and strict["slo_attainment"] == 0


def test_summarize_exact_values():
    R = loadgen.Result
    results = [R(ok=True, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1]),   # TPOT 100 ms
               R(ok=True, output_tokens=5, ttft_s=0.2, e2e_s=0.6, itl_s=[0.1] * 4),   # TPOT 100 ms
               R(ok=True, output_tokens=2, ttft_s=0.5, e2e_s=1.5, itl_s=[1.0]),       # TPOT 1000 ms
               R(ok=False, error="boom")]
    s = loadgen.summarize(results, 2.0, slo_ttft_ms=300, slo_tpot_ms=200)
    assert s["ttft_ms_mean"] == pytest.approx(800 / 3)
    assert (s["ttft_ms_p50"], s["ttft_ms_p90"], s["ttft_ms_p99"]) == pytest.approx((200, 500, 500))
    assert s["tpot_ms_p50"] == pytest.approx(100) and s["e2e_ms_p99"] == pytest.approx(1500)
    assert s["itl_ms_p50"] == pytest.approx(100) and s["itl_ms_p99"] == pytest.approx(1000)
    assert s["throughput_rps"] == 1.5 and s["output_tok_s"] == 5.0
    assert s["goodput_rps"] == 1.0 and s["slo_attainment"] == 0.5  # the first two meet both SLOs
    assert s["errors"] == ["boom"]


def test_workload_and_arrivals():
    work = loadgen.build_workload(50, "16:32", "4", seed=3)
    assert all(16 <= len(w.prompt) == w.prompt_tokens <= 32 and w.max_tokens == 4 for w in work)
    assert all(32 <= t <= 126 for w in work for t in w.prompt)
    assert [w.prompt for w in work] == [w.prompt for w in loadgen.build_workload(50, "16:32", "4", seed=3)]
    assert loadgen.arrival_offsets(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert loadgen.arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    gaps = loadgen.arrival_offsets(4001, 10.0, "poisson", seed=1)
    assert gaps[-1] / 4000 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError, match=r"prompt_len='0:5': expected a positive token count"):
        loadgen.build_workload(1, "0:5", "4")
    with pytest.raises(ValueError, match=r"rate=0.0: expected a positive number"):
        loadgen.arrival_offsets(1, 0.0)


def test_dataset_file(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "hello", "max_tokens": 3}, {"prompt": [1, 2, 3]}]))
    work = loadgen.build_workload(3, "1", "1", dataset=str(path))
    assert [(w.prompt, w.max_tokens, w.prompt_tokens) for w in work] == [
        ("hello", 3, None), ([1, 2, 3], 16, 3), ("hello", 3, None)]
    path.write_text("{}")
    with pytest.raises(ValueError, match="must be a JSON list of objects with 'prompt'"):
        loadgen.build_workload(1, "1", "1", dataset=str(path))


def test_serve_subcommand_with_url(fake_url, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--quick", "--url", fake_url, "--rate", "inf,20", "--no-progress",
                 "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"]) == 0
    files = list((tmp_path / "bench" / "results").glob("serve-*.json"))
    rows = json.loads(files[0].read_text())["rows"]
    assert [(r["backend"], r["rate"], r["completed"]) for r in rows] == [("disagg", None, 8), ("disagg", 20.0, 8)]
    work = loadgen.build_workload(8, "16:48", "4:8", seed=0)  # the --quick workload
    for r in rows:
        assert len(r["ttft_ms"]) == 8 and min(r["ttft_ms"]) >= FIRST_S * 1e3
        assert r["goodput_rps"] == pytest.approx(r["throughput_rps"])
        assert r["payload_bytes"] == 1000 * sum(w.prompt_tokens for w in work)
        assert r["tokens"] == round(sum(w.prompt_tokens for w in work) / 8)
        assert r["transfer_ms"] == [1.5] * 8
    assert "TTFT p50" in capsys.readouterr().out


def test_chunk_tokens_counts_token_ids_even_with_empty_text():
    assert loadgen.chunk_tokens({"choices": [{"text": "", "token_ids": [200]}]}) == 1
    assert loadgen.chunk_tokens({"choices": [{"text": "ab", "token_ids": [1, 2]}]}) == 2
    assert loadgen.chunk_tokens({"choices": [{"text": "", "token_ids": []}]}) == 0
    assert loadgen.chunk_tokens({"choices": [{"text": "x"}]}) == 1   # no token_ids: one per text
    assert loadgen.chunk_tokens({"choices": [{"text": ""}]}) == 0


def test_mixed_load_reports_running_tpot_alone_and_beside_long_prompts(fake_url, tmp_path, capsys):
    """4 running requests of 12 tokens, then 2 long prompts (64 tokens: the fake server's gaps
    triple while one streams): the running TPOT beside them is over 1.5x the one alone."""
    assert main(["serve", "--url", fake_url, "--out-dir", str(tmp_path), "--no-progress",
                 "--num-requests", "2", "--rate", "inf", "--prompt-len", "64",
                 "--output-len", "30", "--mix-decodes", "4", "--mix-output-len", "12",
                 "--mix-prompt-len", "8", "--mix-delay-s", "0.1"]) == 0
    row = json.loads(next(tmp_path.glob("serve-*.json")).read_text())["rows"][0]
    assert row["completed"] == 2 and row["running_completed"] == row["running_alone_completed"] == 4
    assert GAP_S * 1e3 <= row["running_alone_tpot_ms_p50"] < 2 * GAP_S * 1e3
    assert row["running_tpot_ratio_p50"] > 1.5
    assert row["running_tpot_ratio_p99"] == pytest.approx(
        row["running_tpot_ms_p99"] / row["running_alone_tpot_ms_p99"])
    assert row["config"]["mix_decodes"] == 4 and row["running_errors"] == []
    assert "running requests (TPOT ms) beside the workload vs alone:" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--mix-decodes", "-1"], "serve: --mix-decodes must be >= 0, got -1"),
    (["--mix-decodes", "2", "--mix-output-len", "1"],
     "serve: --mix-output-len must be >= 2 tokens (a TPOT needs two), got '1'"),
    (["--mix-decodes", "2", "--mix-prompt-len", "0"],
     "serve: --mix-prompt-len: mix_prompt_len='0': expected a positive token count N or a range "
     "A:B with 0 < A <= B"),
])
def test_bad_mix_flags_refused(fake_url, tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--url", fake_url, "--out-dir", str(tmp_path), "--no-progress", *flags])
    assert str(e.value) == message
