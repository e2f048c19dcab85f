"""An instance the router declared dead while it was only late (here: P stopped with SIGSTOP
for longer than ``--dead-after-s``, as a load spike would) comes back: its next heartbeat gets a
``Reregister``, it registers again, is paired anew and serves the same tokens; its shared-memory
segment was kept because its process never died (found by the new-user test, where a loaded
2-core machine left a live P out for good)."""

from __future__ import annotations

import os
import signal
import time

from kvflow.segments import SHM_DIR

from .test_reliability_peers import Cluster


def test_p_declared_dead_while_stopped_registers_again_and_serves():
    cl = Cluster()
    try:
        p = cl.spawn("prefill")
        d = cl.spawn("decode")
        cl.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 2, 150, "P and D paired")
        body = dict(prompt="The same answer before and after.", max_tokens=6, ignore_eos=True)
        before = cl.complete(**body)
        assert before.status_code == 200
        shm = cl.inst(p.pid)["shm_name"]
        os.kill(p.pid, signal.SIGSTOP)
        try:
            cl.wait(lambda h: cl.inst(p.pid) is None, 10, "P declared dead")
            assert any(f"(pid {p.pid}) missed heartbeats" in e for e in cl.health()["errors"])
            assert os.path.exists(os.path.join(SHM_DIR, shm))  # its process lives: kept
        finally:
            os.kill(p.pid, signal.SIGCONT)
        t0 = time.monotonic()
        h = cl.wait(lambda h: h["status"] == "ok" and cl.inst(p.pid) is not None
                    and cl.inst(p.pid)["paired_with"] == [cl.inst(d.pid)["id"]], 15, "P back")
        assert time.monotonic() - t0 < 15 and len(h["instances"]) == 2
        after = cl.complete(**body)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
        assert after.json()["kvflow"]["prefill_instance"] == cl.inst(p.pid)["id"]
    finally:
        cl.close()
