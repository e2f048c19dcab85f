"""The CPU-load harness of the load tests (tests/load.py): it loads the host, then leaves
nothing running."""

import time

import pytest

from tests.load import cpu_hogs
from kvflow.segments import process_exited


def test_hogs_burn_cpu_and_are_reaped():
    with cpu_hogs(2, max_s=30) as hogs:
        time.sleep(1.0)
        assert all(h.poll() is None for h in hogs)
        cpu = [open(f"/proc/{h.pid}/stat").read().split()[13] for h in hogs]
        assert all(int(c) > 0 for c in cpu)  # user ticks: each one spins
    assert all(h.returncode is not None for h in hogs)
    assert all(process_exited(h.pid) for h in hogs)


def test_a_hog_ends_by_itself_after_max_s():
    with cpu_hogs(1, max_s=0.5) as hogs:
        assert hogs[0].wait(timeout=20) == 0


@pytest.mark.parametrize("kw, msg", [({"n": 0}, "n must be >= 1, got 0"),
                                      ({"max_s": 0}, "max_s must be > 0, got 0")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        with cpu_hogs(**kw):
            pass
