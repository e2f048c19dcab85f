"""The study commands and the report's figures.

- ``python -m kvflow.bench <study> --help`` works for every study with Triton absent (its import
  poisoned), and a missing extra is one line naming it;
- ``report`` on a tiny result file writes PNGs titled with the file's device, commit and date
  (also in the PNG's ``Title`` text chunk), and every series has its own style.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench import plots
from kvflow.bench.__main__ import STUDIES
from kvflow.bench.cases import tiny_spec
from kvflow.bench.report import current_command, write_report
from kvflow.bench.schema import make_row, write_results

ROOT = Path(__file__).resolve().parents[2]

# One interpreter for every study: --help exits, so each call is caught and marked.
_HELP_ALL = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
from kvflow.bench.__main__ import STUDIES, main
for study in STUDIES:
    print("=== " + study, flush=True)
    try:
        main([study, "--help"])
    except SystemExit as exc:
        print("=== exit", exc.code, flush=True)
print("=== triton imported:", "triton" in sys.modules and sys.modules["triton"] is not None)
"""


def test_every_study_help_works_without_triton():
    run = subprocess.run([sys.executable, "-c", _HELP_ALL], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    parts = run.stdout.split("=== ")[1:]
    for study in STUDIES:
        i = next(k for k, p in enumerate(parts) if p.startswith(study + "\n"))
        assert f"usage: python -m kvflow.bench {study}" in parts[i], parts[i][:300]
        assert parts[i + 1].strip() == "exit 0", (study, parts[i + 1])
    assert parts[-1].strip() == "triton imported: False"


def _tiny_result(tmp_path: Path) -> Path:
    spec = tiny_spec()
    env = {"device": "Tiny GPU 9000", "device_type": "cuda", "torch": "x", "triton": None,
           "numba": None, "commit": "abc123def456", "date": "2026-12-01T08:00:00+00:00",
           "command": "python -m kvflow.bench kernels --quick"}
    rows = []
    for op in ("gather", "copy"):
        for k, backend in enumerate(("torch", "triton")):
            for tokens in (16, 64):
                payload = spec.num_blocks_for(tokens) * spec.bytes_per_block
                rows.append(make_row(env, op=op, backend=backend, spec=spec, tokens=tokens,
                                     blocks=spec.num_blocks_for(tokens), payload_bytes=payload,
                                     times_s=[1e-5 * (k + 1)], ceiling_s=1e-5, baseline_s=2e-5))
    for mode, hidden in (("event", 1.03), ("signal", -0.2)):  # outside [0, 1]: clipped
        rows.append(make_row(env, op=f"layerwise_{mode}", backend="triton", spec=spec, tokens=64,
                             blocks=4, payload_bytes=4 * spec.bytes_per_block, times_s=[1e-3],
                             ceiling_s=1e-5, hidden_frac=hidden))
    return write_results(tmp_path / "tiny-gpu.json", env, rows)


def test_report_png_carries_device_commit_date(tmp_path):
    from PIL import Image
    path = _tiny_result(tmp_path)
    page = write_report([path], tmp_path / "b.md", tmp_path / "img").read_text()
    pngs = sorted((tmp_path / "img").glob("*.png"))
    assert [p.name for p in pngs] == ["tiny-gpu-NHD-float32.png", "tiny-gpu-overlap.png"]
    for png in pngs:
        assert f"](img/{png.name})" in page
        title = Image.open(png).text["Title"]
        assert title == "Tiny GPU 9000 · commit abc123def456 · 2026-12-01T08:00:00+00:00"
    assert "drawn at the bound" in Image.open(pngs[1]).text["Description"]


def test_series_styles_are_distinct():
    styles = [plots.series_style(i) for i in range(len(plots.COLORS) * len(plots.MARKERS) * 2)]
    keys = {(s["color"], s["marker"], s["linestyle"]) for s in styles}
    assert len(keys) == len(styles)
    ceilings = {(c["color"], str(c["linestyle"])) for c in map(plots.ceiling_style, range(4))}
    assert len(ceilings) == 4 and all(c == "black" for c, _ in ceilings)


def test_recorded_script_commands_map_to_studies():
    assert current_command("python bench/ipc_gpu.py --no-serve --out /x/y.json") == \
        "python -m kvflow.bench ipc --full --no-serve"
    assert current_command("python bench/layerwise_gpu.py --smoke") == \
        "python -m kvflow.bench layerwise --quick"
    assert current_command("python -m kvflow.bench kernels --quick") == \
        "python -m kvflow.bench kernels --quick"


def test_missing_extra_is_one_line(tmp_path):
    path = _tiny_result(tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from kvflow.bench.__main__ import main\n"
            f"main(['report', {str(path)!r}, '--out', {str(tmp_path / 'b.md')!r}])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 1
    assert run.stderr.strip() == "kvflow.bench report: needs matplotlib: pip install 'kvflow[bench]'"


def test_committed_results_are_cited_and_pngs_regenerated():
    """Every committed result file (git's, in a checkout: a user's own runs land beside them)
    has a line in bench/results/README.md, and every PNG of docs/img is one the report draws
    from them."""
    import subprocess
    readme = (ROOT / "bench" / "results" / "README.md").read_text()
    results = ROOT / "bench" / "results"
    tracked = subprocess.run(["git", "ls-files", "*.json"], cwd=results, capture_output=True,
                             text=True)
    files = (sorted(tracked.stdout.split()) if tracked.returncode == 0 and tracked.stdout else
             sorted(p.relative_to(results).as_posix() for p in results.rglob("*.json")))
    assert files and all(f"`{f}`" in readme for f in files)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for png in (ROOT / "docs" / "img").glob("*.png"):
        stem = png.name.split("-")[0]
        if any(stem in f for f in files):
            assert f"](img/{png.name})" in page, png.name


@pytest.mark.parametrize("study", ["transfer"])
def test_unknown_connector_is_refused(study, tmp_path):
    from kvflow.bench.__main__ import main
    with pytest.raises(SystemExit, match="--connectors: unknown rdma; known: ipc-pull, ipc-push, "
                                         "tcp, nixl, nixl-staged"):
        main([study, "--quick", "--connectors", "rdma", "--out-dir", str(tmp_path), "--no-progress"])
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == "[]"


def test_transfer_quick_moves_every_connector_byte_exact(tmp_path, capsys):
    """The quick transfer study builds both halves of ipc-pull, ipc-push and tcp through the
    connector factory; every request size is moved byte-exact (checked against P)."""
    from kvflow.bench.__main__ import main
    from kvflow.bench.cases import LLAMA3_8B, make_spec
    assert main(["transfer", "--quick", "--device", "cpu", "--out-dir", str(tmp_path),
                 "--no-progress", "--threads", "1"]) == 0
    assert "skipped" not in capsys.readouterr().err
    (result,) = tmp_path.glob("transfer-cpu-*.json")
    rows = json.loads(result.read_text())["rows"]
    moved = [r for r in rows if r["op"] == "transfer"]
    assert sorted((r["backend"], r["tokens"]) for r in moved) == [
        (c, t) for c in ("ipc-pull", "ipc-push", "tcp") for t in (64, 256)]
    spec = make_spec(LLAMA3_8B, "NHD", "bfloat16")
    for r in moved:
        assert r["verified"] is True, r
        assert r["payload_bytes"] == r["blocks"] * spec.bytes_per_block
        assert r["gbps"] > 0 and r["ratio"] > 0 and r["d_copy_ms"] > 0
    ceilings = {(r["backend"], r["tokens"]) for r in rows if r["op"] == "ceiling"}
    assert ceilings == {(c, t) for c in ("copy_", "zmq-loopback") for t in (64, 256)}


def test_transfer_with_d_in_its_own_process_is_byte_exact(tmp_path):
    """--peer-process runs D in a child (the default on CUDA): ipc-push maps D's exported
    cache across processes, tcp sends frames; every size is verified, D's receive is timed."""
    from kvflow.bench.__main__ import main
    assert main(["transfer", "--quick", "--device", "cpu", "--peer-process", "--connectors",
                 "ipc-push,tcp", "--tokens", "64", "--out-dir", str(tmp_path),
                 "--no-progress", "--threads", "1"]) == 0
    (result,) = tmp_path.glob("transfer-cpu-*.json")
    moved = [r for r in json.loads(result.read_text())["rows"] if r["op"] == "transfer"]
    assert [(r["backend"], r["verified"], r["peer_process"], r["d_device"]) for r in moved] == [
        ("ipc-push", True, True, "cpu"), ("tcp", True, True, "cpu")]
    assert all(r["d_receive_ms"] > 0 for r in moved)


@pytest.mark.parametrize("connector", ["ipc-pull", "ipc-push", "tcp"])
def test_transfer_pair_writes_only_d_blocks(connector):
    """One request of the study's pair writes P's blocks into exactly D's ids."""
    import torch

    from kvflow.bench.cases import blocks_equal
    from kvflow.bench.transfer import _Pair
    pair = _Pair(connector, tiny_spec(), 8, "cpu")
    try:
        pair.d_cache.buffer.zero_()
        stats = pair.request([5, 1, 6], [0, 7, 3])
        assert stats.blocks == 3 and stats.payload_bytes == 3 * tiny_spec().bytes_per_block
        assert blocks_equal(pair.p_cache, [5, 1, 6], pair.d_cache, [0, 7, 3])
        for t in pair.d_cache.tensors():
            assert not t[[1, 2, 4, 5, 6]].view(torch.uint8).any()
    finally:
        pair.close()


def test_transfer_nixl_rows_carry_descriptors_and_post_time(tmp_path, capsys, monkeypatch):
    """nixl rows report the descriptors P posts per request and its ms in NIXL's post calls
    (staged: one WRITE per layer group of 4 of 32 layers, 2 tensors, 1 block: 64), direct the
    ratio of NIXL's own WRITE of its descriptor list; other connectors leave the columns out.
    On a block-major cache (--layout BM_NHD) of 16-token blocks with contiguous ids, direct
    posts one descriptor per block of the 64 tokens: 4."""
    from kvflow.bench.__main__ import main
    from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
    if not nixl_available():
        pytest.skip("NIXL is not installed")
    monkeypatch.setenv("UCX_TLS", tcp_tls())
    assert main(["transfer", "--quick", "--device", "cpu", "--connectors", "tcp,nixl,nixl-staged",
                 "--tokens", "64", "--out-dir", str(tmp_path), "--no-progress", "--threads",
                 "1"]) == 0
    (head,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("connector ")]
    assert head.split()[-4:] == ["descs", "post", "ms", "/descs"]
    (result,) = tmp_path.glob("transfer-cpu-*.json")
    moved = {r["backend"]: r for r in json.loads(result.read_text())["rows"]
             if r["op"] == "transfer"}
    assert moved["nixl-staged"]["descs_per_request"] == moved["nixl"]["descs_per_request"] == 64
    assert all(moved[c]["post_ms"] > 0 and moved[c]["verified"] for c in ("nixl", "nixl-staged"))
    assert "post_ms" not in moved["tcp"]
    assert moved["nixl"]["descs_ceiling_descs"] == 64 and moved["nixl"]["ratio_to_descs"] > 0
    assert "ratio_to_descs" not in moved["nixl-staged"]
    bm = tmp_path / "bm"
    assert main(["transfer", "--quick", "--device", "cpu", "--connectors", "nixl", "--layout",
                 "BM_NHD", "--block-size", "16", "--ids", "contiguous", "--tokens", "64",
                 "--out-dir", str(bm), "--no-progress", "--threads", "1"]) == 0
    (result,) = bm.glob("transfer-cpu-*.json")
    (row,) = [r for r in json.loads(result.read_text())["rows"] if r["op"] == "transfer"]
    assert (row["layout"], row["descs_per_request"], row["descs_ceiling_descs"]) == ("BM_NHD", 4, 4)
    assert row["geometry"].endswith("B16") and row["config"]["ids"] == "contiguous"
    assert row["verified"]
