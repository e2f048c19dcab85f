"""The served part of ``python -m kvflow.bench ipc`` saves a row per server start and mode as
it is measured (``serve_ipc_start``), so a stop keeps the starts served so far; once every start
ran, the result file holds the pooled ``serve_ipc_gpu`` rows instead (token identity against
colocated needs every mode). The server runs are replaced by recorded results here."""

from __future__ import annotations

import argparse
import json

from kvflow.bench import ipc_served
from kvflow.bench.record import RowSink, partial_path
from kvflow.bench.schema import env_info


def _result(ttft_s: float, text: list[int]) -> dict:
    kv = {"ttft_ms": ttft_s * 1e3, "payload_bytes": 4096, "transfer_ms": 1.0, "prefill_ms": 2.0,
          "copy_ms": 0.5, "hops_ms": {"ttft": ttft_s * 1e3}}
    return {"ttft": ttft_s, "tpot": 0.001, "text": text, "kvflow": kv}


def _args() -> argparse.Namespace:
    return argparse.Namespace(serve_tokens=[32], max_tokens=2, serve_device="cpu",
                              model="kvflow-tiny", serve_dtype="float32", chunk=64,
                              server_args="", serve_reps=2, serve_starts=2,
                              serve_modes="pull-request,colocated", _gpus=[0, 1])


def _fake_serving(monkeypatch, seen: list) -> None:
    def serve_once(name, common, prompts, a):
        seen.append(name)
        k = len(seen)
        return {32: [_result(0.01 * k, [1, 2]), _result(0.01 * k + 0.001, [3, 4])]}
    monkeypatch.setattr(ipc_served, "_serve_once", serve_once)


def test_each_start_is_saved_as_measured_and_the_result_holds_the_pooled_rows(
        monkeypatch, tmp_path):
    seen: list[str] = []
    _fake_serving(monkeypatch, seen)
    env = env_info("cpu")
    sink = RowSink(tmp_path / "ipc.json", {"env": env}, "ipc", quiet=True)
    ipc_served.run_serve(_args(), env, sink)
    assert seen == ["pull-request", "colocated"] * 2
    measured = [json.loads(line) for line in partial_path(sink.path).read_text().splitlines()[1:]]
    assert [(r["op"], r["backend"], r["start"]) for r in measured] == [
        ("serve_ipc_start", "pull-request", 1), ("serve_ipc_start", "colocated", 1),
        ("serve_ipc_start", "pull-request", 2), ("serve_ipc_start", "colocated", 2)]
    assert measured[0]["client_ttfts_ms"] == [10.0, 11.0]
    assert measured[3]["client_ttfts_ms"] == [40.0, 41.0]
    assert [(r["op"], r["backend"]) for r in sink] == [("serve_ipc_gpu", "pull-request"),
                                                       ("serve_ipc_gpu", "colocated")]
    pull = sink[0]
    assert pull["client_ttfts_ms"] == [10.0, 11.0, 30.0, 31.0] and pull["identical"] is True


def test_a_plain_row_list_gets_the_pooled_rows_only(monkeypatch):
    _fake_serving(monkeypatch, [])
    rows: list = [{"op": "ipc_p2d"}]
    ipc_served.run_serve(_args(), env_info("cpu"), rows)
    assert [r["op"] for r in rows] == ["ipc_p2d", "serve_ipc_gpu", "serve_ipc_gpu"]
