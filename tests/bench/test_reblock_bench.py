"""``python -m kvflow.bench reblock`` runs on a CPU and writes rows with both sides' bytes,
GB/s and the three ratios, consistent with each other."""

from __future__ import annotations

import json

import pytest

from kvflow.bench.__main__ import main


def test_reblock_study_rows(tmp_path):
    main(["reblock", "--quick", "--tokens", "32", "--num-layers", "2", "--num-kv-heads", "2",
          "--head-dim", "16", "--cases", "bs16->64,bf16->fp8", "--reps", "2", "--batches", "1",
          "--out-dir", str(tmp_path), "--no-progress"])
    (path,) = tmp_path.glob("reblock-cpu-*.json")
    rows = {r["case"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"bs16->64", "bf16->fp8"}
    per_token = 2 * 2 * 2 * 16                       # layers x (K, V) x heads x head_dim
    assert rows["bs16->64"]["src_bytes"] == rows["bs16->64"]["dst_bytes"] == 32 * per_token * 2
    assert rows["bf16->fp8"]["src_bytes"] == 32 * per_token * 2
    assert rows["bf16->fp8"]["dst_bytes"] == 32 * per_token       # one byte per element
    assert rows["bf16->fp8"]["dst_spec"]["dtype"] == "float8_e4m3fn"
    for r in rows.values():
        assert r["gbps"] == pytest.approx(r["dst_bytes"] / r["time_s"] / 1e9)
        assert r["gbps_read"] == pytest.approx(r["src_bytes"] / r["time_s"] / 1e9)
        ceiling_s = r["dst_bytes"] / r["ceiling_gbps"] / 1e9
        assert r["ratio"] == pytest.approx(ceiling_s / r["time_s"])
        assert r["ratio_traffic"] == pytest.approx(
            (r["src_bytes"] + r["dst_bytes"]) / (2 * r["dst_bytes"]) * r["ratio"])
