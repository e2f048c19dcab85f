"""A thread that reads the signal segment and drives a :class:`LayerwiseScheduler` (its sends
run in this thread); with no request in flight it sleeps until :meth:`~LayerwiseWorker.wake`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from .scheduler import LayerwiseScheduler

log = logging.getLogger(__name__)


class LayerwiseWorker:
    """Signal-driven sender thread: reads ``reader`` (anything with ``num_layers``,
    ``wait_change(last, timeout_s)`` and ``name``) and hands each change to ``scheduler``, whose
    sends run here. ``poll_s``: longest wait (bounds :meth:`stop`); ``signal_timeout_s``: a request
    whose awaited layer stays unsignalled this long is aborted; ``on_error(request_id, exc)``:
    timeouts and send errors, kept in :attr:`errors` (logged without it); ``spin_s``,
    ``max_sleep_s``: of ``wait_change``. ValueError: a time not > 0, or layer counts differ."""

    def __init__(self, scheduler: LayerwiseScheduler, reader, *, poll_s: float = 0.05,
                 signal_timeout_s: float = 30.0,
                 on_error: Callable[[str, BaseException], None] | None = None,
                 spin_s: float = 50e-6, max_sleep_s: float = 1e-3) -> None:
        for name, v in (("poll_s", poll_s), ("signal_timeout_s", signal_timeout_s)):
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if reader.num_layers != scheduler.num_layers:
            raise ValueError(f"reader has {reader.num_layers} layers; scheduler has "
                             f"{scheduler.num_layers}")
        self.scheduler, self.reader = scheduler, reader
        self.poll_s, self.signal_timeout_s = float(poll_s), float(signal_timeout_s)
        self.on_error = on_error
        self._wait_kw = dict(spin_s=spin_s, max_sleep_s=max_sleep_s)
        self.errors: list[tuple[str, BaseException]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LayerwiseWorker":
        if self._thread is not None:
            raise RuntimeError("LayerwiseWorker already started")
        self._thread = threading.Thread(target=self._loop, name="kvflow-layerwise", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """A request was registered: start polling the segment now."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; True if it ended within ``timeout_s`` seconds."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _report(self, request_id: str, exc: BaseException) -> None:
        self.errors.append((request_id, exc))
        if self.on_error is not None:
            self.on_error(request_id, exc)
        else:
            log.error("layerwise request %s: %s", request_id, exc)

    def _loop(self) -> None:
        last = np.full(self.reader.num_layers, -1, dtype=np.int64)
        while not self._stop.is_set():
            if not self.scheduler.pending_requests():
                self._wake.wait(self.poll_s)
                self._wake.clear()
                if not self.scheduler.pending_requests():
                    continue
            now = self.reader.wait_change(last, self.poll_s, **self._wait_kw)
            if now is not None:
                for layer in np.flatnonzero(now != last).tolist():
                    try:
                        self.scheduler.on_layer_signal(layer, int(now[layer]))
                    except Exception as exc:  # noqa: BLE001 - a send failed without on_error
                        self._report("?", exc)
                last = now
            for rid, layer, step in self.scheduler.overdue(self.signal_timeout_s):
                if self.scheduler.abort(rid):
                    self._report(rid, TimeoutError(
                        f"request {rid!r}: no signal for layer {layer} of step {step} on segment "
                        f"{self.reader.name!r} within {self.signal_timeout_s:g} s; aborted"))
