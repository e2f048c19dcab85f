"""Post transfers off the compute thread once the GPU work they read is done.

A layerwise NIXL WRITE may start only when the layers it reads are computed, and NIXL reads
memory outside CUDA's stream order, so the compute thread would synchronize its stream before
each post: one host sync per layer group, during which it launches nothing. An
:class:`EventPoster` instead takes a CUDA event recorded after the group and the post to run;
its thread waits for the event (``torch.cuda.Event.synchronize`` releases the GIL) and posts,
in submission order, while the compute thread goes on launching the next layers.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class EventPoster:
    """One daemon thread running ``post()`` callables after their ``event.synchronize()``, in
    submission order. :meth:`drain` returns what they returned and the first error raised."""

    def __init__(self, name: str = "kvflow-poster") -> None:
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._done: list[Any] = []
        self._error: BaseException | None = None
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, event: Any, post: Callable[[], Any]) -> None:
        """Run ``post()`` in the thread once ``event`` (anything with ``synchronize()``, or
        None) is done; a post after an earlier one failed is skipped."""
        with self._lock:
            self._pending += 1
        self._q.put((event, post))

    def drain(self) -> tuple[list[Any], BaseException | None]:
        """Wait until every submitted post ran; returns their results (in order; None results
        left out) and the first error (then cleared, as are the results)."""
        with self._idle:
            while self._pending:
                self._idle.wait()
            done, error = self._done, self._error
            self._done, self._error = [], None
        return done, error

    def close(self) -> None:
        """Stop the thread after the posts already submitted."""
        self._q.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            event, post = item
            result, error = None, None
            try:
                with self._lock:
                    failed = self._error is not None
                if not failed:
                    if event is not None:
                        event.synchronize()
                    result = post()
            except BaseException as exc:  # noqa: BLE001 - handed to drain()
                error = exc
            with self._idle:
                if result is not None:
                    self._done.append(result)
                if error is not None and self._error is None:
                    self._error = error
                self._pending -= 1
                self._idle.notify_all()
