"""kvflow.connector.transport.nixl_progress.ProgressDriver: progress every ``idle_s`` while
nothing is held, every ``busy_s`` while a transfer is (no NIXL needed: the step is a counter)."""

from __future__ import annotations

import threading
import time

import pytest

from kvflow.connector.transport.nixl_progress import ProgressDriver


def _calls_over(driver: ProgressDriver, calls: list, seconds: float) -> int:
    n = len(calls)
    time.sleep(seconds)
    return len(calls) - n


def test_polls_slowly_idle_and_fast_while_held():
    calls: list[float] = []
    d = ProgressDriver(lambda: calls.append(0.0), "test-progress", busy_s=1e-4, idle_s=0.05)
    try:
        assert not d.busy
        assert _calls_over(d, calls, 0.5) <= 0.5 / 0.05 + 2  # load only makes it fewer
        d.hold("req-1")
        d.hold("req-1")
        assert d.busy
        assert _calls_over(d, calls, 0.5) >= 100
        d.release("req-1")
        assert d.busy  # held twice
        d.release("req-1")
        d.release("never-held")
        assert not d.busy
        time.sleep(0.06)
        assert _calls_over(d, calls, 0.5) <= 0.5 / 0.05 + 2
    finally:
        d.close()
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) == n and not any(t.name == "test-progress" for t in threading.enumerate())


def test_a_failing_step_does_not_stop_it():
    calls = []

    def step():
        calls.append(1)
        raise RuntimeError("agent closed")
    d = ProgressDriver(step, "test-progress-fail", idle_s=0.01)
    try:
        time.sleep(0.2)
        assert len(calls) >= 3
    finally:
        d.close()


@pytest.mark.parametrize("key", ["busy_s", "idle_s"])
def test_periods_must_be_positive(key):
    with pytest.raises(ValueError, match=rf"^ProgressDriver {key} must be > 0 seconds; got 0$"):
        ProgressDriver(lambda: None, "x", **{key: 0})
