"""The router's liveness rule (kvflow/serve/router/liveness.py, docs/reliability.md "Liveness"): a
silent instance whose process lives on this host is late up to --hung-after-s, one it cannot
see is dead after --dead-after-s, an exited one at once; a stall of the router's own loop is
not counted against the instances; heartbeats from an instance's heartbeat socket count as
its own, and older ones never overwrite newer block counts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from kvflow.serve.protocol import Heartbeat, Register
from kvflow.segments import ALIVE, DEAD, UNKNOWN, host_id
from kvflow.serve.router.control import Controller
from kvflow.serve.router.liveness import StallClock, judge
from kvflow.serve.router.placement import InstanceInfo

KW = dict(dead_after_s=10.0, hung_after_s=60.0)


@pytest.mark.parametrize("silent, process, want", [
    (0.5, UNKNOWN, ("ok", "")),
    (1.5, UNKNOWN, ("late", "")),
    (10.5, UNKNOWN, ("dead", "missed heartbeats for 10.0 s")),
    (0.0, DEAD, ("dead", "exited")),
    (0.5, ALIVE, ("ok", "")),
    (30.0, ALIVE, ("late", "")),
    (61.0, ALIVE, ("dead", "hung: its process lives but sent nothing for 60 s (--hung-after-s)")),
])
def test_judge(silent, process, want):
    assert judge(silent, process, **KW) == want


def test_judge_late_comes_before_a_short_dead_after():
    assert judge(0.6, UNKNOWN, dead_after_s=1.0, hung_after_s=60.0) == ("late", "")


def test_stall_clock_credits_only_the_excess_over_period_and_grace():
    c = StallClock(100.0, 0.1, grace_s=0.25)
    assert c.tick(100.3) == 0.0          # 0.2 s late: within the grace
    assert c.tick(103.4) == pytest.approx(3.0)
    assert c.stalled_s == pytest.approx(3.0)


def _reg(instance_id: str, pid: int, host: str) -> Register:
    return Register(instance_id=instance_id, role="decode", spec={}, num_blocks=8, free_blocks=8,
                    max_model_len=16, kv_connector="ipc-pull", pid=pid, host_id=host)


@pytest.fixture
def ctl():
    c = Controller(dead_after_s=10.0, hung_after_s=60.0)
    yield c
    c.sock.close(0)
    c.ctx.term()


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _add(ctl, reg, last_seen):
    info = InstanceInfo(reg, reg.instance_id.encode(), last_seen, reg.free_blocks)
    ctl.instances[reg.instance_id] = info
    return info


def test_a_live_process_of_this_host_is_late_not_dead_until_hung_after_s(ctl, sleeper):
    t = ctl.stalls.last
    _add(ctl, _reg("d-live", sleeper.pid, host_id()), t)
    _add(ctl, _reg("d-far", sleeper.pid, "another-host/1"), t)
    ctl.check_liveness(t + 0.1)
    # 30 s of silence, ticked every 0.1 s as the monitor does (no stall)
    for k in range(1, 301):
        ctl.check_liveness(t + 0.1 + 0.1 * k)
    assert ctl.instances["d-live"].liveness == "late"
    assert "d-far" not in ctl.instances
    assert ctl.errors == [f"decode instance d-far (pid {sleeper.pid}) missed heartbeats for 10.0 s"]
    assert ctl.health()["instances"][0]["liveness"] == "late"
    for k in range(301, 612):
        ctl.check_liveness(t + 0.1 + 0.1 * k)
    assert "d-live" not in ctl.instances
    assert ctl.errors[-1] == (f"decode instance d-live (pid {sleeper.pid}) hung: its process "
                              f"lives but sent nothing for 60 s (--hung-after-s)")


def test_an_exited_process_of_this_host_is_dead_at_once(ctl):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    t = ctl.stalls.last
    _add(ctl, _reg("d-gone", proc.pid, host_id()), t)
    ctl.check_liveness(t + 0.1)
    assert ctl.errors == [f"decode instance d-gone (pid {proc.pid}) exited"]
    assert "d-gone" in ctl.exited


def test_a_stall_of_the_router_is_not_counted_against_instances(ctl, sleeper):
    t = ctl.stalls.last
    _add(ctl, _reg("d-far", sleeper.pid, "another-host/1"), t)
    ctl.check_liveness(t + 15.0)  # the router's loop got no CPU for 15 s: heartbeats unread
    assert "d-far" in ctl.instances and ctl.health()["router_stalled_s"] == pytest.approx(14.9)
    ctl.check_liveness(t + 15.1)
    assert "d-far" in ctl.instances and not ctl.errors


def test_heartbeats_of_the_heartbeat_socket_count_and_old_counts_never_win(ctl):
    info = _add(ctl, _reg("d-1", os.getpid(), host_id()), 0.0)
    hb = b"d-1#hb"
    asyncio.run(ctl._handle(hb, Heartbeat(instance_id="d-1", free_blocks=5, seq=7)))
    assert (info.free_blocks, info.seq) == (5, 7) and info.last_seen > 0.0
    seen = info.last_seen
    asyncio.run(ctl._handle(b"d-1", Heartbeat(instance_id="d-1", free_blocks=3, seq=6)))
    assert info.free_blocks == 5 and info.last_seen >= seen  # late, older: alive, counts kept
    asyncio.run(ctl._handle(b"d-1", Heartbeat(instance_id="d-1", free_blocks=2, seq=8)))
    assert info.free_blocks == 2
    # a heartbeat socket speaks only for its own instance, and only heartbeats
    asyncio.run(ctl._handle(hb, Heartbeat(instance_id="d-2", free_blocks=0, seq=9)))
    assert info.free_blocks == 2 and info.seq == 8
