"""``python -m kvflow.bench interference`` on the CPU with kvflow-tiny at tiny sizes: the rows
and their figures, the baseline's exact ratios, the plot, bad flags, the triton max_ctas rows
(Triton's interpreter) and a SIGINT stop with the rows so far."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench.__main__ import main
from kvflow.bench.report import write_report
from kvflow.bench.schema import read_results

ROOT = Path(__file__).resolve().parents[2]
TINY = ["interference", "--device", "cpu", "--threads", "1", "--no-progress", "--batch", "2",
        "--context", "40", "--steps", "6", "--warmup", "1", "--prefill-tokens", "32"]
#: kvflow-tiny's KV: 4 layers x (K, V) x 16 tokens x 2 KV heads x head_dim 32 x 4 bytes (float32).
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4


def _result(tmp_path: Path) -> dict:
    (path,) = tmp_path.glob("interference-cpu-*.json")
    return read_results(path) | {"path": path}  # checks every row has the schema's fields


def test_cli_writes_decode_and_prefill_rows_with_real_figures(tmp_path):
    assert main(TINY + ["--kv-rate-gbs", "0,0.1", "--out-dir", str(tmp_path)]) == 0
    data = _result(tmp_path)
    env, rows = data["env"], data["rows"]
    assert data["complete"] is True and env["kind"] == "interference"
    assert env["command"].startswith("python -m kvflow.bench interference --device cpu")
    for r in rows:
        assert (r["device"], r["torch"], r["commit"], r["date"]) == \
            (env["device"], env["torch"], env["commit"], env["date"])
    dec = [r for r in rows if r["op"] == "interference_decode"]
    pre = [r for r in rows if r["op"] == "interference_prefill"]
    assert [r["label"] for r in dec if not r["skipped"]] == ["none", "torch", "none"]
    assert [r["config"]["phase"] for r in dec if not r["skipped"]] == ["first", "swept", "last"]
    # 6 steps over the cpu default of 2 rounds: each row pools 3 + 3 steps
    assert [(r["config"]["rounds"], r["steps"]) for r in dec if not r["skipped"]] == [(2, 6)] * 3

    base, torch_row, last = [r for r in dec if not r["skipped"]]
    assert base["tpot_p50_ratio"] == 1.0 and base["tpot_p99_ratio"] == 1.0  # exactly
    assert base["rate_gbps"] == 0.0 and base["payload_bytes"] == 0 and base["gbps"] == 0.0
    assert base["landed"] is None and base["sms_used_max"] == 0 and base["ctas"] == 0
    tpot = base["samples"]["tpot_s"]
    assert len(tpot) == 6 and min(tpot) > 0
    assert base["tpot_p50_s"] == sorted(tpot)[2] and base["tpot_p99_s"] == max(tpot)  # nearest rank

    r = torch_row
    assert r["rate_gbps"] == 0.1 and r["units"] > 0 and r["landed"] is True
    assert r["ctas"] is None and r["max_ctas"] is None  # torch's grid: not known here
    assert r["unit_bytes"] == 4 * BLOCK_BYTES  # 64-token arrivals of 16-token blocks
    assert r["payload_bytes"] == r["units"] * r["unit_bytes"] and r["blocks"] == 4 * r["units"]
    assert r["gbps"] > 0 and r["gbps"] == pytest.approx(r["payload_bytes"] / r["time_s"] / 1e9)
    assert r["ceiling_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["ceiling_gbps"])
    assert r["copy_alone_gbps"] > 0 and r["copy_alone_ratio"] > 0
    assert r["tpot_p50_ratio"] == pytest.approx(r["tpot_p50_s"] / base["tpot_p50_s"])
    assert r["tpot_p99_ratio"] == pytest.approx(r["tpot_p99_s"] / base["tpot_p99_s"])
    assert last["tpot_p99_ratio"] == pytest.approx(last["tpot_p99_s"] / base["tpot_p99_s"])

    (ce_dec,) = [r for r in dec if r["backend"] == "copy_engine"]
    from kvflow.kernels import backend_names
    if "copy_engine" not in backend_names():
        assert ce_dec["skipped"].startswith("copy_engine is not in kvflow.kernels.registry")
        assert ce_dec["gbps"] is None and ce_dec["time_s"] == 0.0 and ce_dec["samples"] == {}

    alone, moved = [r for r in pre if not r["skipped"] and r["backend"] in ("none", "torch")]
    assert alone["prefill_ratio"] == 1.0 and alone["total_ratio"] == 1.0  # exactly
    assert alone["tokens"] == 32 and alone["payload_bytes"] == 0
    assert moved["payload_bytes"] == 2 * BLOCK_BYTES and moved["landed"] is True
    assert moved["prefill_ratio"] == pytest.approx(moved["prefill_s"] / alone["prefill_s"])
    assert moved["gbps"] > 0 and moved["ceiling_gbps"] > 0 and moved["copy_alone_gbps"] > 0

    page = write_report([data["path"]], tmp_path / "b.md", tmp_path / "img").read_text()
    assert "**Interference, decode side**" in page and "**Interference, prefill side**" in page
    assert f"| {moved['label']} | " in page and f"| {moved['prefill_ratio']:.3f} |" in page
    assert page.count(".png)") == 1  # the study's own plot, once

    png = data["path"].with_suffix(".png")
    assert env["plot"] == png.name and png.stat().st_size > 0
    from PIL import Image
    title = Image.open(png).text["Title"]
    assert env["device"] in title and env["commit"] in title and env["date"] in title
    assert f"torch {env['torch']}" in title


@pytest.mark.parametrize("flag,value,message", [
    ("--kv-rate-gbs", "0,fast", "argument --kv-rate-gbs: 'fast' in '0,fast' is not a rate in GB/s >= 0"),
    ("--kv-rate-gbs", "-5", "argument --kv-rate-gbs: '-5' in '-5' is not a rate in GB/s >= 0"),
    ("--max-ctas", "16,0", "argument --max-ctas: '0' in '16,0' is not a CTA count >= 1 or 'full'"),
])
def test_bad_flag_value_is_refused_naming_flag_and_value(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["interference", "--device", "cpu", flag, value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_backend_and_bad_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--backends 'warp' is unknown; known: \["):
        main(TINY + ["--backends", "torch,warp", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"interference: --steps 0: must be an int >= 1"):
        main(TINY + ["--steps", "0", "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before any row


def test_triton_rows_per_max_ctas_in_the_interpreter(tmp_path):
    """The cuda sweep's shape (triton at a cap and at the full grid, copy arrivals, a full
    lane) on CPU tensors through Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "kvflow.bench", *TINY, "--side", "decode",
                          "--backends", "triton", "--max-ctas", "2,full", "--arrival-op", "copy",
                          "--kv-rate-gbs", "max", "--no-plot", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _result(tmp_path)["rows"]
    swept = [r for r in rows if r["config"]["phase"] == "swept"]
    assert [(r["backend"], r["max_ctas"]) for r in swept] == [("triton", 2), ("triton", None)]
    assert [r["label"] for r in swept] == ["triton ctas=2", "triton full"]
    # the capped launch runs 2 programs; the full grid one per work item (> 2: 8 tensors)
    assert swept[0]["ctas"] == 2 and swept[1]["ctas"] > 2
    for r in swept:
        assert r["rate_gbps"] is None and r["units"] > 0 and r["landed"] is True
        assert r["config"]["arrival_op"] == "copy" and r["gbps"] > 0
    assert not list(tmp_path.glob("*.png"))


def test_sigint_stops_with_the_rows_measured(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.bench", "interference", "--device",
                             "cpu", "--threads", "1", "--steps", "400", "--kv-rate-gbs", "0,0.1",
                             "--out-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if re.search(r"interference: row 2:", line):
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest[-2000:]
    m = re.search(r"interference: interrupted by SIGINT: (\d+) rows in (\S+) \(marked interrupted\)",
                  rest)
    assert m, rest[-2000:]
    data = read_results(m.group(2))
    assert data["complete"] is False and data["interrupted"] == "SIGINT"
    assert len(data["rows"]) == int(m.group(1)) >= 2
    assert data["rows"][0]["backend"] == "none" and data["rows"][0]["tpot_p99_ratio"] == 1.0


def test_prefill_side_copies_as_ipc_push_does_by_default():
    from kvflow.bench.interference import DEFAULTS
    from kvflow.connector.layer_copy import LAYERS_PER_COPY
    assert DEFAULTS["cuda"]["layers_per_copy"] == DEFAULTS["cpu"]["layers_per_copy"] == LAYERS_PER_COPY


def test_rounds_above_steps_is_refused():
    with pytest.raises(SystemExit, match=r"--rounds 7: must be <= --steps \(6\)"):
        main(TINY + ["--rounds", "7", "--out-dir", "/nonexistent"])
