"""Issue 26: a clean stop of an instance is logged by the router as a stop (INFO), a crash as a
death (ERROR). An instance stopped by SIGINT/SIGTERM tells the router it is leaving
(:class:`~kvflow.serve.protocol.Leaving`) before it closes its sockets; before, a Ctrl-C of a P
started alone (``--role prefill``) was logged as ERROR "prefill instance ... exited"."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time

import pytest

from kvflow.serve.protocol import Heartbeat, Leaving, Unpair

from tests.serve.test_lease_thread import LoggedCluster
from tests.serve.test_reliability_kinds import _ctl_with

ROUTER_LOG = "kvflow.serve.router"


@pytest.fixture
def ctl():
    c = _ctl_with(("p-1", "prefill", "ipc-pull"), ("d-1", "decode", "ipc-pull"))
    for iid, peer in (("p-1", "d-1"), ("d-1", "p-1")):
        c.instances[iid].pair_ok.add(peer)
    yield c
    c.sock.close(0)
    c.ctx.term()


def _handle(ctl, ident: bytes, msg) -> None:
    async def run():
        await ctl._handle(ident, msg)
        await asyncio.sleep(0)  # the Unpair sends run
    asyncio.run(run())


def test_leaving_is_logged_at_info_as_a_stop_and_is_no_error(ctl, caplog):
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)
    _handle(ctl, b"p-1", Leaving(instance_id="p-1", reason="SIGINT"))
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == ROUTER_LOG]
    assert records == [("INFO", "prefill instance p-1 (pid 1) stopped by SIGINT")]
    assert ctl.errors == [] and "p-1" not in ctl.instances
    assert ctl.sent == [("d-1", Unpair(peer_id="p-1", reason="stopped by SIGINT", exited=False,
                                           stopped=True))]
    caplog.clear()   # a beat that overtook the Leaving: dropped without a word or a Reregister
    _handle(ctl, b"p-1#hb", Heartbeat(instance_id="p-1", free_blocks=40, seq=9))
    assert [r for r in caplog.records if r.name == ROUTER_LOG] == []
    assert len(ctl.sent) == 1


def test_a_process_that_exits_without_leaving_is_still_an_error(ctl, caplog):
    ctl.proc_alive = lambda pid: False            # the router saw it exit: a crash
    asyncio.run(_check(ctl))
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == ROUTER_LOG]
    assert ("ERROR", "prefill instance p-1 (pid 1) exited") in records
    assert "prefill instance p-1 (pid 1) exited" in ctl.errors


async def _check(ctl):
    ctl.check_liveness(time.monotonic())
    await asyncio.sleep(0)


def _router_lines(cl, inst_id: str) -> list[tuple[str, str]]:
    """``(level, message)`` of the router's log lines that name ``inst_id``."""
    out = []
    for line in cl.logs[0].read_text().splitlines():
        m = re.match(r"\S+ \S+ (\S+) (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)", line)
        if m and inst_id in m.group(3):
            out.append((m.group(2), m.group(3)))
    return out


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    c = LoggedCluster(tmp_path_factory.mktemp("leave"), dead_after_s=5, router_args=["--log-level", "info"])
    yield c
    c.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_split_p_stopped_by_a_signal_is_logged_as_a_stop_a_killed_d_as_a_death(split, sig):
    """A router started alone with ``--log-level info`` (cl.logs[0] is its stderr)."""
    cl = split
    p, d = cl.spawn("prefill"), cl.spawn("decode")
    d_log = cl.logs[-1]  # D's stderr (its default --log-level warning)
    h = cl.wait(lambda h: h["status"] == "ok" and {p.pid, d.pid} <= {i["pid"] for i in h["instances"]},
                150, "P and D paired")
    p_id, d_id = cl.inst(p.pid, h)["id"], cl.inst(d.pid, h)["id"]
    p.send_signal(sig)
    assert p.wait(30) == 0
    cl.wait(lambda h: cl.inst(p.pid, h) is None, 10, "P gone from /health")
    lines = _router_lines(cl, p_id)
    assert (("INFO", f"prefill instance {p_id} (pid {p.pid}) stopped by {sig.name}")
            in lines), lines
    assert [ln for ln in lines if ln[0] == "ERROR"] == []
    assert not any(p_id in e for e in cl.health()["errors"])
    cl.wait(lambda h: p_id not in (cl.inst(d.pid, h) or {}).get("paired_with", [p_id]), 10,
            "D unpaired from P")
    assert [ln for ln in d_log.read_text().splitlines() if p_id in ln] == []  # no WARNING on D
    d.kill()                                                     # a crash stays an ERROR
    d.wait(10)
    cl.wait(lambda h: cl.inst(d.pid, h) is None, 10, "D declared dead")
    assert ("ERROR", f"decode instance {d_id} (pid {d.pid}) exited") in _router_lines(cl, d_id)
