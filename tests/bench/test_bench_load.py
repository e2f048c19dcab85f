"""Every result file records the host's load; a busy one is flagged and left out of the report's
headline, with the line saying why (issue 29)."""

import json
import os
import time

import pytest

from kvflow.bench import load
from kvflow.bench.schema import write_results
from tests.load import cpu_hogs




@pytest.fixture(autouse=True)
def _default_threshold(monkeypatch):
    """The rule as users get it (tests/conftest.py raises it for every other test)."""
    monkeypatch.delenv("KVFLOW_BUSY_LOAD_PER_CPU")


def test_threshold_from_the_environment(monkeypatch):
    assert load.threshold() == 1.0
    monkeypatch.setenv("KVFLOW_BUSY_LOAD_PER_CPU", "2.5")
    assert load.busy_reason(4.0, 4.0, 2) is None
    assert load.busy_reason(6.0, 4.0, 2) == "load average 6.00 per 2 CPUs at start (> 2.5 per CPU)"
    monkeypatch.setenv("KVFLOW_BUSY_LOAD_PER_CPU", "-1")
    with pytest.raises(ValueError, match=r"^KVFLOW_BUSY_LOAD_PER_CPU must be a positive number, got '-1'$"):
        load.threshold()

def test_busy_reason_rule():
    assert load.busy_reason(3.1, 2.0, 2) == "load average 3.10 per 2 CPUs at start (> 1 per CPU)"
    assert load.busy_reason(0.5, 2.5, 2) == "load average 2.50 per 2 CPUs at end (> 1 per CPU)"
    assert load.busy_reason(2.0, 2.0, 2) is None
    with pytest.raises(ValueError, match="cpus must be >= 1, got 0"):
        load.busy_reason(1.0, 1.0, 0)


def test_old_file_says_load_not_recorded():
    assert load.describe({"device": "cpu"}) == "load not recorded"


def _cpu_s():
    t = os.times()
    return t.user + t.system


def _write(tmp_path, monkeypatch, loads, name):
    it = iter(loads)
    monkeypatch.setattr(os, "getloadavg", lambda: (next(it), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    load.start()
    t = _cpu_s()
    while _cpu_s() - t < 0.2:  # 0.2 s of this process's CPU time, however loaded the host
        # (os.times counts 10 ms clock ticks: 5% of it)
        pass
    return write_results(tmp_path / name, {"device": "cpu", "command": "x"}, [{"op": "gather"}])


def test_idle_file_not_flagged(tmp_path, monkeypatch):
    data = json.loads(_write(tmp_path, monkeypatch, [0.2, 0.4], "idle.json").read_text())
    rec = data["env"]["load"]
    assert (rec["loadavg_1m_start"], rec["loadavg_1m_end"], rec["cpus"]) == (0.2, 0.4, 2)
    assert rec["busy"] is False and rec["busy_reason"] is None
    assert rec["cpu_s"] >= 0.2 and rec["wall_s"] >= 0.9 * rec["cpu_s"]
    assert rec["cpu_per_wall"] == pytest.approx(rec["cpu_s"] / rec["wall_s"], rel=0.01)


def test_busy_file_flagged_and_left_out(tmp_path, monkeypatch):
    data = json.loads(_write(tmp_path, monkeypatch, [4.0, 5.0], "busy.json").read_text())
    assert data["env"]["load"]["busy_reason"] == \
        "load average 4.00 per 2 CPUs at start (> 1 per CPU)"
    assert data["env"]["load"]["busy"] is True
    assert data["rows"] == [{"op": "gather"}]  # as measured: the file-level flag covers them
    keep, lines = load.left_out([(tmp_path / "busy.json", data)])
    assert keep == []
    assert lines == ["- left out of the headline: `busy.json` (all 1 rows): busy host: "
                     "load average 4.00 per 2 CPUs at start (> 1 per CPU)"]


def test_real_load_flags_file(tmp_path):
    """Busy-loop processes (3 per CPU) until the 1-minute load average passes 1 per CPU."""
    cpus = os.cpu_count() or 1
    with cpu_hogs(3 * cpus, max_s=150):
        deadline = time.monotonic() + 140
        while os.getloadavg()[0] / cpus <= 1.2 and time.monotonic() < deadline:
            time.sleep(1)
        load.start()
        path = write_results(tmp_path / "r.json", {"device": "cpu"}, [{"op": "gather"}])
    rec = json.loads(path.read_text())["env"]["load"]
    assert rec["busy"] is True, rec
    assert rec["busy_reason"].startswith("load average ")
