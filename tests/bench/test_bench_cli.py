"""``python -m kvflow.bench``: the tutorial's commands (docs/tutorials/benchmarking.md) run as
written, in a temporary folder, and their outputs hold the values the schema promises; the report
refuses mixed devices; bad flags fail before any work.

Commands run in-process (``kvflow.bench.__main__.main``) to save an interpreter start each, with
:data:`CI_FLAGS` added.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from kvflow.bench.__main__ import main
from kvflow.bench.report import check_one_device, write_report
from kvflow.bench.schema import ROW_FIELDS, env_info, make_row, write_results
from kvflow.kernels import registry
from kvflow.layout import KVCacheSpec

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "benchmarking.md"
LLAMA_BLOCK_BYTES = 32 * 2 * 64 * 8 * 128 * 2  # layers x (K, V) x block x heads x dim x bf16


def tutorial_commands(text: str) -> list[list[str]]:
    """argv (after ``python -m kvflow.bench``) of every ``$`` line in a console block."""
    cmds, in_console = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_console = line.strip() == "```console"
            continue
        if in_console and line.startswith("$ "):
            argv = shlex.split(line[2:])
            assert argv[:3] == ["python", "-m", "kvflow.bench"], line
            cmds.append(argv[3:])
    return cmds


def tutorial_files(text: str) -> dict[str, str]:
    """Code blocks announced by ``<!-- file: NAME -->``."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", text, re.S)}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)
    registry._BACKENDS.pop("toy", None)  # the tutorial's toy must not leak into other tests


# Added to each tutorial command here: no progress bar, and one CPU thread for torch and numba
# (CI's two cores are shared; OpenMP spin-waiting under oversubscription makes a 2-thread
# index_select hundreds of times slower).
CI_FLAGS = ["--no-progress", "--threads", "1"]


def test_tutorial_commands(workdir, capsys):
    text = TUTORIAL.read_text()
    for name, body in tutorial_files(text).items():
        (workdir / name).write_text(body)
    cmds = tutorial_commands(text)
    assert [c[0] for c in cmds] == ["kernels", "calls", "transfer", "report", "kernels", "report"]
    for argv in cmds:
        assert main(argv + (CI_FLAGS if argv[0] != "report" else [])) == 0, argv
    out = capsys.readouterr().out

    results = sorted((workdir / "bench" / "results").glob("*.json"))
    names = [p.name.split("-cpu-")[0] for p in results]
    assert sorted(names) == ["calls", "kernels", "kernels-toy", "transfer"]
    kern = json.loads(next(p for p in results if p.name.startswith("kernels-cpu")).read_text())
    # the command as measured: where the file goes and how it prints are left out
    assert kern["env"]["command"] == "python -m kvflow.bench kernels --quick --threads 1"
    assert "out_dir" not in kern["env"]["options"] and "no_progress" not in kern["env"]["options"]
    rows = kern["rows"]
    assert {(r["op"], r["layout"], r["tokens"]) for r in rows} == {
        (op, lay, tok) for op in ("gather", "scatter", "copy") for lay in ("NHD", "MLA")
        for tok in (64, 256)}
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        assert r["verified"] is True, r
        spec = KVCacheSpec(num_layers=32, num_kv_heads=8 if r["layout"] == "NHD" else 1,
                           head_dim=128 if r["layout"] == "NHD" else 576, block_size=64,
                           dtype="bfloat16", layout=r["layout"])
        assert r["blocks"] == r["tokens"] // 64
        assert r["payload_bytes"] == r["blocks"] * spec.bytes_per_block
        assert r["gbps"] == pytest.approx(r["payload_bytes"] / r["time_s"] / 1e9)
        assert r["ratio"] == pytest.approx(r["payload_bytes"] / r["ceiling_gbps"] / 1e9 / r["time_s"])
        if r["backend"] == "torch":
            assert r["baseline_ratio"] == 1.0
    assert rows[0]["payload_bytes"] == LLAMA_BLOCK_BYTES  # 64 tokens NHD: one 8 MiB block

    toy = json.loads(next(p for p in results if p.name.startswith("kernels-toy")).read_text())
    assert {r["backend"] for r in toy["rows"]} == {"torch", "numba", "toy"}
    assert all(r["verified"] for r in toy["rows"])

    transfer = json.loads(next(p for p in results if p.name.startswith("transfer")).read_text())
    moved = [r for r in transfer["rows"] if r["op"] == "transfer"]
    assert {(r["backend"], r["tokens"]) for r in moved} == {(c, t) for c in ("ipc-pull", "ipc-push", "tcp")
                                                           for t in (64, 256)}
    assert all(r["verified"] and r["latency_ms_p99"] >= r["latency_ms_p50"] > 0 for r in moved)

    page = (workdir / "docs" / "benchmarks.md").read_text()
    assert page.startswith("# kvflow benchmarks")
    assert f"## {env_info('cpu')['device']}" in page
    assert "Command: `python -m kvflow.bench kernels --quick --plugin toy_backend.py" in page
    assert "| tokens | MiB | ceiling GB/s | torch as called | torch device |" in page
    assert "**Host time per call**" in page
    pngs = sorted(p.name for p in (workdir / "docs" / "img").glob("*.png"))
    assert any(p.endswith("-NHD-bfloat16.png") for p in pngs) and any("transfer" in p for p in pngs)
    for p in pngs:
        assert f"](img/{p})" in page
        assert (workdir / "docs" / "img" / p).read_bytes()[:4] == b"\x89PNG"
    assert "gather   toy" in out


def _row(device: str) -> dict:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16")
    env = dict(env_info("cpu"), device=device)
    return make_row(env, op="gather", backend="torch", spec=spec, tokens=4, blocks=1,
                    payload_bytes=128, times_s=[1e-6, 2e-6, 3e-6], ceiling_s=1e-6)


def test_report_refuses_mixed_devices(tmp_path):
    path = write_results(tmp_path / "mixed.json", env_info("cpu"), [_row("GPU A"), _row("CPU B")])
    with pytest.raises(ValueError, match=r"mixed.json: refusing to mix devices in one table: "
                                         r"'GPU A' and 'CPU B'"):
        write_report([path], tmp_path / "b.md", tmp_path / "img")
    assert check_one_device([_row("X"), _row("X")], "here") == "X"


def test_report_one_section_per_device(tmp_path):
    a = write_results(tmp_path / "a.json", dict(env_info("cpu"), device="NVIDIA H200"), [_row("NVIDIA H200")])
    b = write_results(tmp_path / "b.json", env_info("cpu"), [_row("Some CPU (2 cores)")])
    page = write_report([b, a], tmp_path / "b.md", tmp_path / "img").read_text()
    heads = [line for line in page.splitlines() if line.startswith("## ")]
    assert heads == ["## NVIDIA H200", "## Some CPU (2 cores)"]
    # the 2 us median of 128 bytes: 0.064 GB/s; ceiling 1 us: ratio 0.5
    assert "| 4 | 0.00 | 0.13 | 0.1 (0.50, -x) |" in page


def test_bad_flags_fail_before_work(workdir, capsys):
    with pytest.raises(SystemExit):
        main(["kernels", "--tokens", "lots"])
    assert "argument --tokens: 'lots' is not a token count >= 1 (e.g. 16,1K,64K)" in capsys.readouterr().err
    for value in ("0", "-4"):
        with pytest.raises(SystemExit):
            main(["transfer", "--block-size", value])
        assert f"argument --block-size: '{value}' is not an int >= 1" in capsys.readouterr().err
    for flag, value, least in (("--reps", "0", 1), ("--warmup", "-1", 0), ("--num-blocks", "0", 1)):
        with pytest.raises(SystemExit, match=f"^transfer: {flag} must be >= {least}, got {value}$"):
            main(["transfer", flag, value, "--no-progress"])
    with pytest.raises(ValueError, match=r"backend='nosuch' is unknown"):
        main(["kernels", "--quick", "--backends", "nosuch", "--no-progress"])
    with pytest.raises(SystemExit, match="--plugin 'missing.py': no such file"):
        main(["kernels", "--plugin", "missing.py"])
    assert not (workdir / "bench").exists()


def test_contention_skips_on_cpu_with_a_message(workdir, capsys):
    from kvflow.bench.contention import skip_reason
    assert skip_reason("cpu") == "the SM-contention study needs a CUDA GPU; device is cpu"
    argv = ["kernels", "--quick", "--contention", "--ops", "gather", "--backends", "torch",
            "--layouts", "MLA", "--tokens", "64", *CI_FLAGS]
    assert main(argv) == 0
    assert "contention: skipped: the SM-contention study needs a CUDA GPU; device is cpu" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_pytest_benchmark_suite_rows_and_compare(tmp_path):
    """bench/test_kernels_bench.py: rows of the shared schema in extra_info; a saved run can be
    compared against (``--benchmark-compare``). About 30 s: marked slow."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    base = [sys.executable, "-m", "pytest", str(root / "bench" / "test_kernels_bench.py"), "-q",
            "-p", "no:cacheprovider", "-k", "NHD and 64 and gather",
            f"--benchmark-storage=file://{tmp_path / 'store'}"]
    first = subprocess.run(base + ["--benchmark-autosave"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:]
    second = subprocess.run(base + ["--benchmark-compare", "--benchmark-compare-fail=median:1000%",
                                    f"--benchmark-json={tmp_path / 'b.json'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stdout[-2000:]
    assert "Comparing against benchmarks from:" in second.stdout + second.stderr
    rows = [b["extra_info"] for b in json.loads((tmp_path / "b.json").read_text())["benchmarks"]]
    assert {r["backend"] for r in rows} >= {"torch", "numba"}
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        assert (r["op"], r["layout"], r["tokens"], r["payload_bytes"]) == ("gather", "NHD", 64, LLAMA_BLOCK_BYTES)
        assert r["gbps"] == pytest.approx(r["payload_bytes"] / r["time_s"] / 1e9)
