"""``python -m kvflow.bench layerwise --quick`` runs end to end on the CPU (tiny shapes) and
writes schema rows."""

from __future__ import annotations

from kvflow.bench.__main__ import main
from kvflow.bench.schema import read_results


def test_layerwise_bench_smoke(tmp_path, capsys):
    assert main(["layerwise", "--quick", "--tokens", "40", "--reps", "1",
                 "--out-dir", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("layerwise-cpu-*.json")
    data = read_results(out)  # checks the schema's required fields
    assert data["env"]["command"].startswith("python -m kvflow.bench layerwise --quick")
    rows = data["rows"]
    ops = [r["op"] for r in rows]
    assert ops == ["layerwise_alone", "layerwise_request", "layerwise_signal", "layerwise_signal",
                   "signal_latency"]
    lw = rows[2]
    assert lw["tokens"] == 40 and lw["blocks"] == 3  # block 16: 40 tokens -> 3 blocks
    assert lw["payload_bytes"] == 3 * 2 * 2 * 16 * 2 * 16 * 4  # blocks x layers x K,V x block bytes
    assert [r["config"].get("max_ctas") for r in rows[:4]] == [None, None, None, 16]
    assert all(0.0 <= r["hidden_frac"] <= 1.0 for r in rows[:4])  # clipped; raw kept beside it
    assert all("hidden_frac_raw" in r for r in rows[:4])
    assert rows[4]["config"] == {"kind": "launch_to_seen"} and rows[4]["p50_s"] > 0
    assert "suggested --layerwise-min-tokens" in capsys.readouterr().out
