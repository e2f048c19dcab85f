"""What the interference study shares between its D side and its P side: the lane the KV copies
run on beside the model, and the copy configurations it sweeps.

A :class:`Lane` runs copies beside the model's own work: on a GPU, a second CUDA stream (each
copy waits for the work enqueued so far on the model's stream when asked to, so a layer's copy
starts after that layer's K/V are written); on a CPU, one worker thread (torch ops release the
GIL, so the copies share the cores with the model as a receiver thread would). The model's
stream is never synchronised with the lane except by :meth:`Lane.drain`.

A copy configuration (:class:`Config`) is a backend and its ``max_ctas`` (None: the full grid);
``none`` is no transfer, the baseline of each side.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

#: Backend name of the no-transfer baseline.
NONE = "none"


@dataclasses.dataclass(frozen=True)
class Config:
    """One copy configuration of the sweep.

    Attributes
    ----------
    backend : str
        A backend of :mod:`kvflow.kernels.registry`, or ``"none"`` (no transfer).
    max_ctas : int or None
        Grid cap of the copy kernels (programs); None fills the GPU.
    skipped : str or None
        Why this configuration cannot run here (its row carries the note, no figures).
    """

    backend: str
    max_ctas: int | None = None
    skipped: str | None = None

    @property
    def label(self) -> str:
        """``triton ctas=16``, ``triton full``, ``copy_engine``, ``none``."""
        if self.backend != "triton":
            return self.backend
        return f"triton {'full' if self.max_ctas is None else f'ctas={self.max_ctas}'}"


def sms_used_at_most(cfg: Config, sm_count: int) -> int:
    """An upper bound of the SMs a configuration's copies occupy: 0 for no transfer and for the
    copy engines (``copy_engine``: DMA engines, no kernel), ``min(max_ctas, SMs)`` for a capped
    grid (one CTA runs on one SM), else every SM."""
    if cfg.backend in (NONE, "copy_engine"):
        return 0
    if cfg.max_ctas is not None:
        return min(cfg.max_ctas, sm_count)
    return sm_count


def grid_ctas(cfg: Config, cache, device, op: str, pairs: int, layers: tuple[int, int]) -> int | None:
    """CTAs (programs) of the launch of ``op`` ("scatter" or "copy") of ``pairs`` blocks over
    ``layers`` into ``cache``: 0 without a kernel (``none``, ``copy_engine``); for ``triton``
    the grid of the launch plan the backend built for it (read from the plans it keeps on the
    destination cache, after a first call); None where unknown (other backends)."""
    if cfg.backend in (NONE, "copy_engine"):
        return 0
    if cfg.backend != "triton":
        return None
    info = cache.backend_state.get(("triton", device))
    for key, plan in (getattr(info, "plans", None) or {}).items():
        if key[:4] == (op, *layers, cfg.max_ctas):
            total = plan.per_pair * pairs
            return total if plan.limit is None or total < plan.limit else plan.limit
    return None


def configs(backends: list[str], max_ctas: list[int | None], device) -> list[Config]:
    """The sweep: ``triton`` once per ``max_ctas``, every other backend once (full grid); a
    backend that cannot run on ``device`` (``copy_engine`` before it is registered, triton on
    a CPU without its interpreter) becomes a skipped configuration naming why.

    Raises
    ------
    SystemExit
        A name in ``backends`` that is neither ``none``, ``copy_engine`` nor a backend of
        :func:`kvflow.kernels.backend_names` (naming ``--backends``, the value and the known).
    """
    from kvflow.kernels import backend_names, get_backend
    known = backend_names()
    out = []
    for name in backends:
        if name == NONE:
            continue  # the baseline is always measured, once per side
        if name not in known and name != "copy_engine":
            raise SystemExit(f"kvflow.bench interference: --backends {name!r} is unknown; "
                             f"known: {sorted(known + ['copy_engine', NONE])}")
        reason = None
        if name not in known:
            reason = ("copy_engine is not in kvflow.kernels.registry here (the copy-engine "
                      "backend is not installed in this checkout)")
        else:
            try:
                get_backend(name, device)
            except (ValueError, RuntimeError) as exc:
                reason = str(exc)
        caps = max_ctas if name == "triton" and reason is None else [None]
        out += [Config(name, cap, reason) for cap in caps]
    return out


class Lane:
    """Where copies run beside the model (module docstring).

    Parameters
    ----------
    device : torch.device
        ``cuda``: a side stream; ``cpu``: a worker thread.
    """

    def __init__(self, device) -> None:
        import torch
        self.device, self.cuda = device, device.type == "cuda"
        self.issued = 0
        self._events: list = []  # CUDA: one done event per copy not yet seen done
        self._done = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
        else:
            self._q: queue.Queue = queue.Queue()
            self._error: BaseException | None = None
            self._thread = threading.Thread(target=self._work, daemon=True,
                                            name="kvflow-interference-lane")
            self._thread.start()

    def _work(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the next call
                self._error = self._error or exc
            finally:
                self._done += 1

    def submit(self, fn, *, after_model: bool = False) -> None:
        """Run ``fn()`` (which enqueues or does one copy) on the lane; no wait. ``after_model``:
        on a GPU, the copy starts only after the work already enqueued on the model's stream
        (a layer's K/V written); on a CPU the call order gives it."""
        import torch
        self._raise()
        self.issued += 1
        if not self.cuda:
            self._q.put(fn)
            return
        if after_model:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._events.append(ev)

    def pending(self) -> int:
        """Copies submitted and not yet finished (polls; never waits)."""
        self._raise()
        if self.cuda:
            while self._events and self._events[0].query():
                self._events.pop(0)
                self._done += 1
        return self.issued - self._done

    def drain(self) -> None:
        """Wait until every submitted copy has finished."""
        import time
        if self.cuda:
            self.stream.synchronize()
            self._done, self._events = self.issued, []
        else:
            while self._done < self.issued and self._thread.is_alive():
                time.sleep(1e-4)
        self._raise()

    def close(self) -> None:
        """Stop the worker thread (CPU), after the copies already queued."""
        if not self.cuda and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=10)

    def _raise(self) -> None:
        if not self.cuda and self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"a copy on the lane failed: {type(exc).__name__}: {exc}") from exc
