"""Interrupts in ``python -m kvflow.bench`` (:mod:`kvflow.bench.record`):

- a study in a subprocess, sent SIGINT or SIGTERM after its first row line, exits 130 / 143 with
  one line naming the result file and its row count; the file holds exactly those rows (valid
  per the schema), marked interrupted; while it ran, the rows were already on disk;
- a study whose main thread is stuck where no signal reaches it is ended by the watchdog;
- ``--help`` and bad flags are refused before torch, numba or triton is imported;
- the report labels a partial result file and keeps it out of the headline.

Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvflow.bench.record import describe, partial_path
from kvflow.bench.schema import ROW_FIELDS, make_row, read_results, write_results

ROOT = Path(__file__).resolve().parents[2]
#: 12 small torch cases on one CPU thread: about 1 s a row on an idle 2-core box.
STUDY = ["kernels", "--quick", "--threads", "1", "--backends", "torch", "--layouts", "MLA,NHD",
         "--ops", "gather,scatter,copy", "--tokens", "64,128"]
STOP_LINE = re.compile(r"kernels: interrupted by (SIG\w+): (\d+) rows in (\S+) \(marked interrupted\)")


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line.rstrip("\n"))
    q.put(None)


def _wait_for(q: queue.Queue, pattern: str, timeout_s: float, seen: list[str]) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            line = q.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; got {seen[-20:]}")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_a_study_with_its_rows(tmp_path, sig, code):
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.bench", *STUDY, "--out-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, q), daemon=True).start()
    seen: list[str] = []
    try:
        _wait_for(q, r"^kernels: row 1: ", 240, seen)
        on_disk = list(tmp_path.glob("*.partial.jsonl"))
        assert len(on_disk) == 1, on_disk  # the row is saved before its line is printed
        header, *saved = [json.loads(x) for x in on_disk[0].read_text().splitlines()]
        assert header["complete"] is False and header["kind"] == "kernels" and len(saved) >= 1
        proc.send_signal(sig)
        t_sig = time.monotonic()
        stop = STOP_LINE.fullmatch(_wait_for(q, r"interrupted by", 60, seen))
        assert proc.wait(timeout=30) == code
        stop_s = time.monotonic() - t_sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert stop is not None, seen[-5:]
    assert stop.group(1) == sig.name
    n, path = int(stop.group(2)), Path(stop.group(3))
    assert 1 <= n < 12 and path.parent == tmp_path and path.suffix == ".json"
    data = read_results(path)  # schema version and every row field checked
    assert data["complete"] is False and data["interrupted"] == sig.name
    assert len(data["rows"]) == n
    assert data["env"]["command"] == "python -m kvflow.bench " + " ".join(STUDY)  # less --out-dir
    for r in data["rows"]:
        assert set(ROW_FIELDS) <= set(r) and r["verified"] is True and r["backend"] == "torch"
    printed = [line for line in seen if line.startswith("kernels: row ")]
    assert 1 <= len(printed) <= n  # a row saved just before the signal may miss its line
    for k, line in enumerate(printed):
        assert line.startswith(f"kernels: row {k + 1}: {describe(data['rows'][k])} ("), line
    assert not partial_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert stop_s < 30, stop_s


_STUCK = """
import signal, sys, time
from types import SimpleNamespace
from kvflow.bench import cli, record
from kvflow.bench.schema import make_row
record.GRACE_S = 1.0
env = {"device": "Test CPU", "device_type": "cpu", "torch": None, "triton": None, "numba": None,
       "commit": "abc", "date": "2026-12-01T22:00:00+00:00"}

def study(args):
    rows = cli.rows(env, {"x": 1})
    rows.append(make_row(env, op="gather", backend="torch", spec=None, tokens=16, blocks=1,
                         payload_bytes=4096, times_s=[1e-6], ceiling_s=1e-6))
    # From here no signal reaches the main thread (as in a long native call): only the watchdog
    # thread (started earlier, so not blocked) takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    print("stuck", flush=True)
    time.sleep(60)
    return 0

args = SimpleNamespace(study="kernels", out_dir=sys.argv[1], name=None, no_progress=True,
                       _argv=["kernels"])
sys.exit(record.run_study(args, study))
"""


def test_watchdog_ends_a_study_whose_main_thread_never_takes_the_signal(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _STUCK, str(tmp_path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "stuck"
        time.sleep(1.0)  # let its main thread enter the sleep (else it takes the signal itself)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    path = tmp_path / "kernels-cpu-20261201-220000.json"
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"kernels: interrupted by SIGINT: 1 rows in {path} (marked interrupted)"
    data = read_results(path)
    assert (data["complete"], data["interrupted"], len(data["rows"])) == (False, "SIGINT", 1)
    assert data["env"]["options"] == {"x": 1} and data["rows"][0]["payload_bytes"] == 4096
    assert 1.0 <= took < 20, took  # the grace, then at once
    assert not partial_path(path).exists()


_EARLY = """
import sys, time
t0 = time.perf_counter()
from kvflow.bench.__main__ import main
for argv in (["--help"], ["kernels", "--help"], ["kernels", "--tokens", "lots"],
             ["calls", "--bogus"], ["nosuch"], ["kernels", "--device", "tpu"],
             ["reblock", "--device", "gpu"]):
    try:
        main(argv)
    except SystemExit as exc:
        print("exit", exc.code, file=sys.stderr, flush=True)
print("heavy", sorted(m for m in ("torch", "numba", "triton") if m in sys.modules),
      f"{time.perf_counter() - t0:.1f}", file=sys.stderr)
"""


def test_help_and_bad_flags_come_before_torch():
    run = subprocess.run([sys.executable, "-c", _EARLY], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    err = run.stderr
    assert run.returncode == 0, err[-2000:]
    assert "usage: python -m kvflow.bench [-h] STUDY" in run.stdout
    assert "usage: python -m kvflow.bench kernels" in run.stdout
    assert "argument --tokens: 'lots' is not a token count >= 1 (e.g. 16,1K,64K)" in err
    assert "python -m kvflow.bench: error: unrecognized arguments: --bogus" in err
    assert "argument STUDY: invalid choice: 'nosuch'" in err
    assert "exit kvflow.bench kernels: --device 'tpu': use cpu, cuda or cuda:N" in err
    assert "exit kvflow.bench reblock: --device 'gpu': use cpu, cuda or cuda:N" in err
    assert [line.split()[1] for line in err.splitlines() if line.startswith("exit ")][:5] == \
        ["0", "0", "2", "2", "2"]
    heavy = err.strip().splitlines()[-1].split(" ", 1)[1]
    assert heavy.startswith("[] "), heavy  # none of torch, numba, triton was imported
    assert float(heavy.split()[-1]) < 30  # seconds, at any load (torch alone takes longer there)


def _kernel_file(path: Path, date: str, interrupted: str | None) -> Path:
    from kvflow.layout import KVCacheSpec
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="bfloat16")
    env = {"device": "Some CPU (2 cores)", "device_type": "cpu", "torch": "x", "triton": None,
           "numba": None, "commit": "abc", "date": date, "kind": "kernels",
           "command": "python -m kvflow.bench kernels --quick",
           "load": {"loadavg_1m_start": 0.1, "loadavg_1m_end": 0.1, "cpus": 2, "wall_s": 1.0,
                    "cpu_s": 1.0, "cpu_per_wall": 1.0, "busy": False, "busy_reason": None}}
    rows = [make_row(env, op=op, backend="torch", spec=spec, tokens=4, blocks=1, payload_bytes=128,
                     times_s=[2e-6], ceiling_s=1e-6, baseline_s=2e-6) for op in ("gather", "copy")]
    return write_results(path, env, rows, interrupted=interrupted)


def test_report_labels_a_partial_file_and_keeps_it_out_of_the_headline(tmp_path):
    from kvflow.bench.report import write_report
    done = _kernel_file(tmp_path / "done.json", "2026-12-01T08:00:00+00:00", None)
    cut = _kernel_file(tmp_path / "cut.json", "2026-12-01T09:00:00+00:00", "SIGTERM")
    assert json.loads(done.read_text())["complete"] is True
    page = write_report([done, cut], tmp_path / "b.md", tmp_path / "img").read_text()
    assert page.count("**Partial**:") == 1  # (the page's opening paragraph names it too)
    cut_at, done_at = page.index("### `cut.json`"), page.index("### `done.json`")
    label = page.index("**Partial**: stopped by SIGTERM after 2 rows; the tables below hold only "
                       "those rows.")
    assert cut_at < label < done_at  # in cut.json's section (sections sorted by file name)
    assert "from `done.json`" in page and "from `cut.json`" not in page  # the headline
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
