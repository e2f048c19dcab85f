"""A progress driver for a NIXL agent made without NIXL's busy progress thread (UCX moves data
only inside the agent's calls, on both ends): :class:`ProgressDriver` progresses it every
:data:`BUSY_S` while a transfer is held, every :data:`IDLE_S` otherwise. Why and the
measurements: docs/nixl.md, "Progress without a busy thread".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Hashable

log = logging.getLogger("kvflow.connector.nixl")

BUSY_S = 100e-6  # seconds between progress calls while a transfer is held
IDLE_S = 0.01  # ... while none is


class ProgressDriver:
    """Calls ``step`` (one progress of the agent; an exception is logged once) from daemon thread
    ``name``: every ``busy_s`` seconds while any key is held, else every ``idle_s`` (both > 0)."""

    def __init__(self, step: Callable[[], Any], name: str, *, busy_s: float = BUSY_S,
                 idle_s: float = IDLE_S) -> None:
        for key, value in (("busy_s", busy_s), ("idle_s", idle_s)):
            if not value > 0:
                raise ValueError(f"ProgressDriver {key} must be > 0 seconds; got {value!r}")
        self.step, self.busy_s, self.idle_s = step, float(busy_s), float(idle_s)
        self._held: dict[Hashable, int] = {}
        self._mu = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether any key is held (the thread then polls every ``busy_s``)."""
        return bool(self._held)

    def hold(self, key: Hashable) -> None:
        """Poll fast until ``key`` is released as often as it was held."""
        with self._mu:
            self._held[key] = self._held.get(key, 0) + 1
        self._wake.set()

    def release(self, key: Hashable) -> None:
        """Undo one :meth:`hold` of ``key`` (a key not held is ignored)."""
        with self._mu:
            n = self._held.pop(key, 0) - 1
            if n > 0:
                self._held[key] = n

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (waits at most ``timeout_s`` seconds for it)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a closed agent, a NIXL error: say it once, go on
                if not self._failed:
                    self._failed = True
                    log.warning("NIXL progress failed: %s: %s", type(exc).__name__, exc)
            if self._held:
                time.sleep(self.busy_s)
            else:
                self._wake.wait(self.idle_s)
                self._wake.clear()
