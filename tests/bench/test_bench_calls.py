"""As called and host time per call, on a CPU (docs/design.md, "Measuring").

- ``timing.time_as_called``: batches of back-to-back calls, rotation kept across batches;
- ``kernels``: every row carries the as-called figures beside device time, with the schema's
  definitions; the report shows both (as called first) and a headline, and marks older rows
  "device time only"; the README's headline block is rewritten between its markers;
- ``calls``: ``--help``; a tiny run gives host microseconds per call for every CPU case, with the
  CUDA-only cases skipped by name; the report renders them.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvflow.bench import kernel_report
from kvflow.bench.__main__ import main
from kvflow.bench.report import write_report
from kvflow.bench.schema import ROW_FIELDS, env_info, make_row, write_results
from kvflow.bench.timing import calls_per_batch, time_as_called
from kvflow.layout import KVCacheSpec

from tests.bench.test_bench_cli import workdir  # noqa: E402,F401 (the shared fixture)

FLAGS = ["--device", "cpu", "--no-progress", "--threads", "1"]
TINY_BLOCK = 32 * 2 * 16 * 1 * 16 * 2  # calls' geometry: layers x (K, V) x block x heads x dim x bf16


def test_time_as_called_batches_and_rotation():
    seen = []
    fns = [lambda k=k: (seen.append(k), time.sleep(1e-3)) for k in range(3)]
    out = time_as_called(fns, calls=4, batches=2, warmup=1)
    assert len(out) == 2 and all(t >= 1e-3 for t in out)  # seconds per call, each sleeps 1 ms
    assert seen == [0] + [k % 3 for k in range(8)]  # warm-up, then the rotation across batches
    assert calls_per_batch(70e-6) == 143  # a 1K-token H200 gather: ~10 ms per batch
    assert (calls_per_batch(1.0), calls_per_batch(0.0)) == (1, 1000)


def test_kernels_rows_carry_as_called_and_device_time(workdir, capsys):
    argv = ["kernels", "--quick", "--ops", "gather,copy", "--backends", "torch,numba",
            "--layouts", "NHD", "--tokens", "64", "--reps", "3", *FLAGS]
    assert main(argv) == 0
    assert "called GB/s  ratio  xtorch device GB/s  ratio" in capsys.readouterr().out
    (path,) = (workdir / "bench" / "results").glob("kernels-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {(o, b) for o in ("gather", "copy")
                                                       for b in ("torch", "numba")}
    for r in rows:
        assert set(ROW_FIELDS) <= set(r) and r["verified"] is True
        assert r["as_called_p10_s"] <= r["as_called_s"] <= r["as_called_p90_s"]
        assert r["as_called_gbps"] == pytest.approx(r["payload_bytes"] / r["as_called_s"] / 1e9)
        ceiling_s = r["payload_bytes"] / r["ceiling_gbps"] / 1e9
        assert r["as_called_ratio"] == pytest.approx(ceiling_s / r["as_called_s"])
        assert r["ratio"] == pytest.approx(ceiling_s / r["time_s"])  # device time, as before
        assert r["as_called_calls"] >= 1
        if r["backend"] == "torch":
            assert r["as_called_baseline_ratio"] == 1.0
    assert main(["report"]) == 0
    page = (workdir / "docs" / "benchmarks.md").read_text()
    assert "| tokens | MiB | ceiling GB/s | torch as called | torch device | numba as called | numba device |" in page
    head = page.split("## Headline")[1].split("\n## ")[0]
    assert "| op | tokens | numba as called | numba device | torch as called | torch device |" in head
    torch_gather = next(r for r in rows if (r["op"], r["backend"]) == ("gather", "torch"))
    assert f"| gather | 64 | " in head and f"{torch_gather['as_called_ratio']:.2f} (" in head


def _old_row(tokens: int, device: str = "NVIDIA H200") -> dict:
    """A kernels row as files made before the as-called figure hold it."""
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64, dtype="bfloat16")
    env = dict(env_info("cpu"), device=device)
    n = tokens // 64
    return make_row(env, op="gather", backend="triton", spec=spec, tokens=tokens, blocks=n,
                    payload_bytes=n * spec.bytes_per_block, times_s=[1e-4], ceiling_s=5e-5,
                    config={"num_blocks": 4096})


def test_report_marks_old_rows_and_writes_the_readme_block(tmp_path):
    env = dict(env_info("cpu"), device="NVIDIA H200", device_type="cuda", kind="kernels",
               commit="abc", date="2026-11-30T00:00:00+00:00")
    path = write_results(tmp_path / "kernels-old.json", env, [_old_row(1024), _old_row(2048)])
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{kernel_report.README_BEGIN}\nstale\n{kernel_report.README_END}\n\ntail\n")
    page = write_report([path], tmp_path / "b.md", tmp_path / "img", readme).read_text()
    assert kernel_report.OLD_NOTE in page  # the table says it is device time only
    assert "| 1024 | 128.00 | 2684.35 | 1342.2 (0.50, -x) |" in page  # 128 MiB in 100 us, ceiling 50 us
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{kernel_report.README_END}\n\ntail\n")
    assert "| gather | 1024 | - | 0.50 (1342) |" in text  # 1K is a headline size; 2K is not
    assert "| gather | 2048 |" not in text
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert kernel_report.update_readme(plain, []) is False and plain.read_text() == "no markers\n"


def test_calls_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calls", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m kvflow.bench calls" in out and "--calls CALLS" in out
    assert "--repeats REPEATS" in out


def test_calls_tiny_cpu_run_and_report(workdir, capsys):
    argv = ["calls", "--quick", "--calls", "20", "--repeats", "3", "--warmup", "2", *FLAGS]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "skipped: case=bare triton launch, reason=needs a CUDA device; device is cpu" in err
    assert "skipped: case=cuda graph replay, reason=needs a CUDA device; device is cpu" in err
    (path,) = (workdir / "bench" / "results").glob("calls-cpu-*.json")
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert data["env"]["kind"] == "calls"
    got = {(r["op"], r["backend"], r["call"], r["ids"]) for r in rows}
    want = {(op, "numba", call, ids) for op in ("gather", "scatter", "copy")
            for call, ids in (("defaults", "device tensor"), ("defaults, validate=False", "device tensor"),
                              ("defaults", "Python list"))}
    want |= {(op, "torch", "backend='torch'", "device tensor") for op in ("gather", "scatter", "copy")}
    want.add(("copy_", "torch", "dst.copy_(src), payload bytes", "-"))
    want.add(("copy", "numba", "defaults, one cache", "device tensor"))  # the stamping case
    assert got == want
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        assert r["payload_bytes"] == 2 * TINY_BLOCK and r["geometry"] == "L32xH1xD16xB16"
        assert 0 < r["host_us_p10"] <= r["host_us"] <= r["host_us_p90"]
        assert r["host_us"] == pytest.approx(r["time_s"] * 1e6)
        assert (r["calls"], r["repeats"], r["gbps"], r["queue_bound"]) == (20, 3, None, False)
    us = {(r["op"], r["backend"], r["call"], r["ids"]): r["host_us"] for r in rows}
    # 64 per-layer torch ops cost the caller more than one copy_ of the same bytes
    assert us[("gather", "torch", "backend='torch'", "device tensor")] > \
        us[("copy_", "torch", "dst.copy_(src), payload bytes", "-")]
    assert main(["report"]) == 0
    page = (workdir / "docs" / "benchmarks.md").read_text()
    assert "**Host time per call**" in page and "Payload 64 KiB (L32xH1xD16xB16, bfloat16)" in page
    line = next(x for x in page.splitlines() if x.startswith("| gather | numba | `defaults` | device tensor |"))
    assert line.endswith("| 20 x 3 | no |")
    assert f"{us[('gather', 'numba', 'defaults', 'device tensor')]:.2f} (" in line


def test_calls_refuses_an_unknown_op(workdir):
    with pytest.raises(SystemExit, match="--ops: unknown nope; known: gather,scatter,copy"):
        main(["calls", "--ops", "nope", *FLAGS])
    assert not (workdir / "bench").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calls_cuda_rows(workdir, capsys):
    """On a GPU: triton's cases with host ids as a CPU tensor, the bare launch, and the CUDA
    graph replay (or its skip with the capture's error)."""
    assert main(["calls", "--quick", "--device", "cuda", "--calls", "50", "--repeats", "2",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    (path,) = (workdir / "bench" / "results").glob("calls-*.json")
    rows = json.loads(path.read_text())["rows"]
    keys = {(r["op"], r["backend"], r["call"], r["ids"]) for r in rows}
    assert ("gather", "triton", "defaults", "host tensor") in keys
    assert ("launch", "triton", "trivial kernel, grid (1,)", "-") in keys
    assert any(r.get("graph") for r in rows) or "skipped: case=cuda graph replay, reason=" in err
    assert all(r["host_us"] > 0 and r["drain_us"] >= 0 for r in rows)
