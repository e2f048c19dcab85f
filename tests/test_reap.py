"""tests/reap.py (how the vLLM tests end their engines) on a dummy process tree: a child that
starts a grandchild, as a vLLM server starts its engine core. Each dummy ends by itself after
60 s, so a failing test leaves nothing running for long."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.reap import GROUPS, descendants, live, reap, spawn, survivors

#: the child: start a grandchild (argv[1] "ignore": it ignores SIGTERM; argv[2] "setsid": it
#: leaves the group), print its pid, then sleep
_CHILD = """
import subprocess, sys, time
gc = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "print('up', flush=True)\\n"
    "time.sleep(60)", sys.argv[1]],
    stdout=subprocess.PIPE, text=True, start_new_session=sys.argv[2] == "setsid")
assert gc.stdout.readline().strip() == "up"
print(gc.pid, flush=True)
time.sleep(60)
"""


def _tree(sigterm: str, group: str) -> tuple[subprocess.Popen, int]:
    child = spawn([sys.executable, "-c", _CHILD, sigterm, group], stdout=subprocess.PIPE,
                  text=True)
    grandchild = int(child.stdout.readline())
    return child, grandchild


def _gone_within(pid: int, s: float) -> bool:
    deadline = time.monotonic() + s
    while live(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_ending_the_leader_alone_leaves_the_grandchild_running():
    """The negative control: what the vLLM tests did (terminate the server's pid) orphans it."""
    child, gc = _tree("default", "group")
    try:
        child.terminate()
        child.wait(timeout=10)
        time.sleep(0.3)
        assert live(gc)  # re-parented, still running
        assert survivors({child.pid}) == {gc}
    finally:
        assert reap(child, grace_s=5.0) == set()  # the group SIGTERM ends it
        assert not live(gc)


def test_reap_ends_child_and_grandchild_with_sigterm():
    child, gc = _tree("default", "group")
    assert descendants(child.pid) == {gc}
    assert reap(child, grace_s=5.0) == set()
    assert child.returncode == -15
    assert not live(gc) and survivors({child.pid}) == set()


def test_reap_kills_a_grandchild_that_ignores_sigterm():
    child, gc = _tree("ignore", "group")
    t0 = time.monotonic()
    assert reap(child, grace_s=0.5) == {gc}
    assert time.monotonic() - t0 < 5.0  # bounded: grace, then SIGKILL
    assert _gone_within(gc, 2.0)


def test_reap_finds_a_grandchild_that_left_the_group():
    """setsid in the grandchild: the group signal misses it, the parent chain does not."""
    child, gc = _tree("ignore", "setsid")
    assert survivors({child.pid}) == {child.pid}  # gc is in a group of its own
    assert reap(child, grace_s=0.5) == {gc}
    assert _gone_within(gc, 2.0)


def test_every_spawned_group_is_recorded_for_the_session_check():
    child, gc = _tree("default", "group")
    assert GROUPS[child.pid] is child
    reap(child, grace_s=5.0)
    assert survivors() == set()  # what tests/conftest.py's _no_process_left asserts
