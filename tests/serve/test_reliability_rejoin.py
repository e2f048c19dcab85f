"""A silent instance of the router's host whose process lives (here: P stopped with SIGSTOP, as
a load spike would) is only *late* in ``/health`` up to ``--hung-after-s``, and serves on when
it runs again; declared dead after that (hung), it comes back: its next heartbeat gets a
``Reregister``, it registers again, is paired anew and serves the same tokens; its shared-memory
segment was kept because its process never died (found by the new-user test, where a loaded
2-core machine left a live P out for good)."""

from __future__ import annotations

import os
import signal
import time

from kvflow.segments import SHM_DIR

from tests.serve.test_reliability_peers import Cluster


def test_p_stopped_is_late_then_hung_and_registers_again_and_serves():
    cl = Cluster(dead_after_s=1, hung_after_s=4)
    try:
        p = cl.spawn("prefill")
        d = cl.spawn("decode")
        cl.wait(lambda h: h["status"] == "ok" and len(h["instances"]) == 2, 150, "P and D paired")
        body = dict(prompt="The same answer before and after.", max_tokens=6, ignore_eos=True)
        before = cl.complete(**body)
        assert before.status_code == 200
        shm = cl.inst(p.pid)["shm_name"]
        os.kill(p.pid, signal.SIGSTOP)  # silent for longer than --dead-after-s: late, not dead
        try:
            cl.wait(lambda h: cl.inst(p.pid, h) and cl.inst(p.pid, h)["liveness"] == "late", 10,
                    "P late")
            time.sleep(1.5)
            assert cl.inst(p.pid) is not None and cl.inst(p.pid)["heartbeat_age_s"] > 1.5
        finally:
            os.kill(p.pid, signal.SIGCONT)
        cl.wait(lambda h: cl.inst(p.pid, h)["liveness"] == "ok", 10, "P ok again")
        again = cl.complete(**body)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
        assert not cl.health()["errors"]
        os.kill(p.pid, signal.SIGSTOP)  # silent for longer than --hung-after-s: dead
        try:
            cl.wait(lambda h: cl.inst(p.pid, h) is None, 15, "P declared dead")
            assert any(f"(pid {p.pid}) hung: its process lives but sent nothing for 4 s" in e
                       for e in cl.health()["errors"])
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
