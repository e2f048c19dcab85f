"""Stops that end a study at once (:mod:`kvflow.bench.record`): the watchdog, or a second signal,
leaves by ``os._exit`` and first runs the :func:`kvflow.bench.record.on_exit` clean-ups:

- a server that ignores SIGINT (a stand-in: a parent and a child in a session of its own, as the
  router's P and D, holding a ``kvflow-*`` segment) is SIGKILLed, tree and all, and the segment
  its killed child left is unlinked (:meth:`kvflow.bench.server.Server.stop`);
- a second signal during a study's slow clean stop gives one stop line, and the clean-ups run
  to their end before the process ends.

No server, no torch: a few seconds each. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvflow import segments
from kvflow.bench.schema import read_results

from tests import reap

ROOT = Path(__file__).resolve().parents[2]


#: a stand-in for a server that ignores SIGINT and SIGTERM: a child in a session of its own
#: (as the router's P and D) holding a kvflow segment
_TREE = """
import signal, subprocess, sys, time
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
CODE = sys.argv[1]
if sys.argv[2:] == ["child"]:
    from kvflow import segments
    name, fd = segments.create("prefill", 4096)
    print(name, flush=True)
else:
    child = subprocess.Popen([sys.executable, "-c", CODE, CODE, "child"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    print("tree", child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""

_STUCK_WITH_SERVER = """
import signal, subprocess, sys, time
from types import SimpleNamespace
from kvflow.bench import cli, record
from kvflow.bench.schema import make_row
from kvflow.bench.server import Server
record.GRACE_S = 1.0
env = {"device": "Test CPU", "device_type": "cpu", "torch": None, "triton": None, "numba": None,
       "commit": "abc", "date": "2026-12-02T03:00:00+00:00"}

def study(args):
    rows = cli.rows(env, {"x": 1})
    proc = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[2]], text=True,
                            stdout=subprocess.PIPE, start_new_session=True)
    print(proc.pid, proc.stdout.readline().strip(), flush=True)
    server = Server(proc, "http://127.0.0.1:9")
    with record.on_exit(lambda: server.stop(1.0)):
        rows.append(make_row(env, op="serve", backend="disagg", spec=None, tokens=16, blocks=0,
                             payload_bytes=0, times_s=[0.1], ceiling_s=None))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print("stuck", flush=True)
        time.sleep(60)  # only the watchdog takes the signal: the finally clauses never run
    return 0

args = SimpleNamespace(study="serve", out_dir=sys.argv[1], name=None, no_progress=True,
                       _argv=["serve"])
sys.exit(record.run_study(args, study))
"""


def test_watchdog_stops_the_server_and_unlinks_what_its_killed_tree_left(tmp_path):
    proc = reap.spawn([sys.executable, "-c", _STUCK_WITH_SERVER, str(tmp_path), _TREE], cwd=ROOT,
                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parent = child = 0
    segment = ""
    try:
        first = proc.stdout.readline().split()
        if len(first) != 4:  # the stand-in did not start: say why
            proc.kill()
            raise AssertionError(f"{first}: {proc.communicate(timeout=10)[1][-2000:]}")
        parent, word, child, segment = first
        parent, child = int(parent), int(child)
        assert word == "tree" and segment in os.listdir(segments.SHM_DIR)
        assert proc.stdout.readline().strip() == "stuck"
        assert reap.live(parent) and reap.live(child)
        time.sleep(1.0)  # let its main thread enter the sleep
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - t0
        left = {p for p in (parent, child) if reap.live(p)}
    finally:
        reap.reap(proc, grace_s=5)
        for pid in (parent, child):
            if pid and reap.live(pid):
                os.kill(pid, signal.SIGKILL)
        if segment:
            segments.unlink(segment)
    path = tmp_path / "serve-cpu-20261202-030000.json"
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-2:] == [
        f"serve: interrupted by SIGINT: 1 rows in {path} (marked interrupted)",
        f"kvflow.bench: the server (pid {parent}) did not stop within 1 s: killed pids "
        f"{sorted([parent, child])}, unlinked segments {[segment]}"]
    data = read_results(path)
    assert (data["complete"], data["interrupted"], len(data["rows"])) == (False, "SIGINT", 1)
    assert left == set() and segment not in os.listdir(segments.SHM_DIR)
    assert 2.0 <= took < 25, took  # the watchdog's grace, the server's 1 s, then at once


_SLOW_STOP = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from kvflow.bench import cli, record
from kvflow.bench.schema import make_row
env = {"device": "Test CPU", "device_type": "cpu", "torch": None, "triton": None, "numba": None,
       "commit": "abc", "date": "2026-12-02T03:00:00+00:00"}

def stopped():  # a server's stop that takes its time (as Server.stop)
    time.sleep(1.0)
    Path(sys.argv[1], "stopped").write_text("yes")

def study(args):
    rows = cli.rows(env, {"x": 1})
    with record.on_exit(stopped):
        try:
            rows.append(make_row(env, op="serve", backend="disagg", spec=None, tokens=16,
                                 blocks=0, payload_bytes=0, times_s=[0.1], ceiling_s=None))
            print("row", flush=True)
            time.sleep(60)
        finally:
            time.sleep(5)  # a slow clean stop: the second signal comes in here
    return 0

args = SimpleNamespace(study="serve", out_dir=sys.argv[1], name=None, no_progress=True,
                       _argv=["serve"])
sys.exit(record.run_study(args, study))
"""


def test_second_signal_runs_the_clean_ups_before_the_process_ends(tmp_path):
    proc = reap.spawn([sys.executable, "-c", _SLOW_STOP, str(tmp_path)], cwd=ROOT, text=True,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "row"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # the main thread is in the study's finally by now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        reap.reap(proc, grace_s=5)
    path = tmp_path / "serve-cpu-20261202-030000.json"
    assert proc.returncode == 130, err
    # one line (whichever thread took the second signal), then the clean-up ran to its end
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        f"serve: interrupted by SIGINT: 1 rows in {path} (marked interrupted)"], err
    assert (tmp_path / "stopped").exists(), err
    assert (tmp_path / "stopped").read_text() == "yes"
    assert read_results(path)["interrupted"] == "SIGINT"
    assert 1.3 <= took < 5, took  # the clean-up's 1 s, not the study's 5 s finally
