"""bench/layerwise_gpu.py runs end to end on the CPU (tiny shapes) and writes schema rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvflow.bench.schema import read_results


def test_layerwise_bench_smoke(tmp_path, capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "layerwise_gpu.py"
    spec = importlib.util.spec_from_file_location("layerwise_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "lw.json"
    assert mod.main(["--smoke", "--tokens", "40", "--reps", "1", "--out", str(out)]) == 0
    rows = read_results(out)["rows"]  # checks the schema's required fields
    ops = [r["op"] for r in rows]
    assert ops == ["layerwise_alone", "layerwise_request", "layerwise_signal", "layerwise_signal",
                   "signal_latency"]
    lw = rows[2]
    assert lw["tokens"] == 40 and lw["blocks"] == 3  # block 16: 40 tokens -> 3 blocks
    assert lw["payload_bytes"] == 3 * 2 * 2 * 16 * 2 * 16 * 4  # blocks x layers x K,V x block bytes
    assert [r["config"].get("max_ctas") for r in rows[:4]] == [None, None, None, 16]
    assert rows[4]["config"] == {"kind": "launch_to_seen"} and rows[4]["p50_s"] > 0
    assert "suggested --layerwise-min-tokens" in capsys.readouterr().out
