"""Interrupts of the served studies (``serve``, ``soak``; :mod:`kvflow.bench.record`).

Each study starts its own ``python -m kvflow.serve`` (router, P and D) in a subprocess on the
CPU; after its first row line the test freezes it (SIGSTOP), reads the ``.partial.jsonl``, sends
SIGINT or SIGTERM and lets it go on (SIGCONT). It must exit 130 / 143 with one line naming the
result file; the file holds exactly the rows the partial file held, marked interrupted; the
server stopped cleanly (its own "stopped" line, no SIGKILL); no process of the study's tree and
no ``kvflow-*`` segment of it is left. Then a complete ``serve`` file, where load steps of one
rate are pooled (against ``test_bench_loadgen``'s fake server). The stops that end a study at
once are in ``tests/bench/test_bench_interrupt_exit.py``.

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
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvflow import segments
from kvflow.bench import loadgen
from kvflow.bench.record import partial_path
from kvflow.bench.schema import read_results
from tests import reap
from tests.bench.test_bench_interrupt import _lines, _wait_for
from tests.bench.test_bench_loadgen import fake_url  # noqa: F401 - the fake server fixture

pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
SERVE_RATES = [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0]
#: one server start, a load step of 3 short prompts per rate (~1 s each on an idle 2-core box)
SERVE = ["serve", "--starts", "1", "--rate", ",".join(map(str, SERVE_RATES)),
         "--num-requests", "3", "--prompt-len", "16:32", "--output-len", "2:4"]
#: 2 clients of prompts <= 32 tokens, a row per 1 s window, 2 minutes if not stopped
SOAK = ["soak", "--minutes", "2", "--window-s", "1", "--clients", "2", "--max-prompt", "32",
        "--max-tokens", "4", "--abort-frac", "0"]


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped (state T): SIGSTOP takes effect a moment after
    ``kill`` returns."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} not stopped within {timeout_s} s")


def _owned_segments(pids: set[int]) -> list[str]:
    return sorted(e for e in os.listdir(segments.SHM_DIR)
                  if (p := segments.parse_name(e)) is not None and p.owner.pid in pids)


def _interrupt(study: list[str], tmp_path: Path, sig: signal.Signals) -> dict:
    """Run ``study``, stop it with ``sig`` after its first row; what the test checks."""
    cmd = [sys.executable, "-m", "kvflow.bench", *study, "--out-dir", str(tmp_path)]
    proc = reap.spawn(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    q: queue.Queue = queue.Queue()  # the study's lines and its server's (which inherits both)
    threading.Thread(target=_lines, args=(proc.stdout, q), daemon=True).start()
    seen: list[str] = []
    name = study[0]
    tree: set[int] = set()
    try:
        _wait_for(q, rf"^{name}: row 1: ", 150, seen)
        os.kill(proc.pid, signal.SIGSTOP)  # no row lands between the read and the signal
        _wait_stopped(proc.pid)
        tree = reap.descendants(proc.pid) | {proc.pid}
        owned = _owned_segments(tree)
        (partial,) = tmp_path.glob("*.partial.jsonl")
        header, *saved = [json.loads(x) for x in partial.read_text().splitlines()]
        os.kill(proc.pid, sig)
        t_sig = time.monotonic()
        os.kill(proc.pid, signal.SIGCONT)
        stop = _wait_for(q, r"interrupted by", 60, seen)
        code = proc.wait(timeout=30)
        stop_s = time.monotonic() - t_sig
        left = {p for p in tree if reap.live(p)}  # at once: the study waits for its server
        left_segments = _owned_segments(tree)
    finally:
        reap.reap(proc, grace_s=5)
        for pid in tree - {proc.pid}:  # a server left behind (the test fails): end it here
            if reap.live(pid):
                os.kill(pid, signal.SIGKILL)
        for seg in _owned_segments(tree):
            segments.unlink(seg)
    log = Path(tempfile.gettempdir()) / f"kvflow-soak-server-{proc.pid}.log"  # soak's server log
    server_lines = seen
    if log.exists():
        server_lines = log.read_text().splitlines()
        log.unlink()
    return {"server_lines": server_lines, "header": header, "saved": saved, "stop": stop,
            "code": code, "stop_s": stop_s, "tree": tree, "owned": owned, "left": left,
            "left_segments": left_segments, "seen": seen}


def _check_common(got: dict, name: str, sig: signal.Signals, code: int, tmp_path: Path) -> dict:
    assert got["code"] == code, got["seen"][-10:]
    m = re.fullmatch(rf"{name}: interrupted by (SIG\w+): (\d+) rows in (\S+) \(marked interrupted\)",
                     got["stop"])
    assert m is not None, got["stop"]
    path = Path(m.group(3))
    assert m.group(1) == sig.name and int(m.group(2)) == len(got["saved"]) >= 1
    data = read_results(path)  # schema version and every row field checked
    assert (data["complete"], data["interrupted"]) == (False, sig.name)
    assert data["rows"] == got["saved"]  # what the .partial.jsonl held when the signal came
    assert got["header"]["kind"] == name and got["header"]["complete"] is False
    assert data["env"]["command"] == got["header"]["command"]
    assert not partial_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    # the study's server: router, P and D, and their shared-memory segments, all gone
    assert len(got["tree"]) >= 4, got["tree"]  # the study, the router, P and D
    assert got["owned"], "the served P/D had no kvflow-* segment: nothing was checked"
    assert got["left"] == set() and got["left_segments"] == []
    # the router's own clean stop: it stopped P and D itself, none needed SIGKILL
    assert "kvflow.serve: stopped" in got["server_lines"], got["server_lines"][-5:]
    assert not any("killing it" in line for line in got["server_lines"])
    assert got["stop_s"] < 30, got["stop_s"]
    return data


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_serve_study_stops_with_its_load_steps(tmp_path, sig, code):
    got = _interrupt(SERVE, tmp_path, sig)
    data = _check_common(got, "serve", sig, code, tmp_path)
    rows = data["rows"]
    n = len(rows)
    assert n < len(SERVE_RATES)
    assert [(r["op"], r["backend"], r["rate"], r["start"], r["starts"]) for r in rows] == \
        [("serve", "disagg", rate, 1, 1) for rate in SERVE_RATES[:n]]
    for r in rows:
        assert r["requests"] == 3 and r["completed"] == 3 and len(r["ttft_ms"]) == 3
        assert len(r["kvflow"]) == 3 and r["payload_bytes"] > 0


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_soak_study_stops_with_its_windows(tmp_path, sig, code):
    got = _interrupt(SOAK, tmp_path, sig)
    rows = _check_common(got, "soak", sig, code, tmp_path)["rows"]
    assert [(r["op"], r["window"], r["t0_s"], r["t1_s"]) for r in rows] == \
        [("soak_window", k, float(k), float(k + 1)) for k in range(len(rows))]
    for r in rows:
        assert r["requests"] >= 1 and r["ok"] >= 1 and r["errors"] == r["hung"] == 0
        assert r["aborted"] == 0 and r["server_restarts"] == 0 and 0 <= r["in_flight"] <= 2
        assert r["ttft_p50_ms"] > 0 and r["config"]["window_s"] == 1.0
    assert not any(r["op"] == "soak" for r in rows)  # the summary comes only after the drain


def test_serve_steps_of_one_rate_are_pooled_in_the_complete_file(fake_url, tmp_path, capsys):
    from kvflow.bench.__main__ import main
    assert main(["serve", "--quick", "--url", fake_url, "--rate", "20,20,inf", "--out-dir",
                 str(tmp_path), "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"]) == 0
    err = capsys.readouterr().err
    steps = [re.sub(r" \([\d.]+ s\)$", "", line) for line in err.splitlines()
             if line.startswith("serve: row ")]
    tokens = round(sum(w.prompt_tokens for w in loadgen.build_workload(8, "16:48", "4:8")) / 8)
    assert steps == [f"serve: row {k}: serve disagg {tokens} tokens {rate} req/s 8/8 done"
                     for k, rate in ((1, 20), (2, 20), (3, "inf"))]  # each step saved as measured
    (path,) = tmp_path.glob("serve-*.json")
    data = read_results(path)
    assert data["complete"] is True and not partial_path(path).exists()
    assert [(r["rate"], r["requests"], r["completed"], r["starts"], r["start"])
            for r in data["rows"]] == [(20.0, 16, 16, 1, None), (None, 8, 8, 1, None)]
    assert len(data["rows"][0]["ttft_ms"]) == 16
