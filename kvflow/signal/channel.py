"""Writer and reader of the signal segment, with profile-run gating and bounded waits.

Writer: :class:`SignalChannel` (owns the segment; CPU stores or the GPU ``signal_layer``
kernel), usually held by a :class:`LayerSignaller`, which creates it lazily and never during a
profile / dummy / warm-up / graph-capture run (:func:`kvflow.context.sends_allowed`).
Reader: :class:`SignalReader` (attaches by name; any process), whose waits always end: a
missing writer is a :class:`TimeoutError` naming the layer, the step and the segment.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from kvflow.context import sends_allowed

from .segment import Segment, check_num_layers, cleanup_stale

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | Mapped


@dataclasses.dataclass
class SignalStats:
    """Counters: ``written`` signals stored; ``suppressed`` signal calls refused (profile or
    dummy run, or no channel yet); ``creates_suppressed`` channel set-ups refused."""

    written: int = 0
    suppressed: int = 0
    creates_suppressed: int = 0


#: Process-wide counters (every channel and signaller adds to them).
STATS = SignalStats()
_STATS_LOCK = threading.Lock()


def _count(field: str, *local: SignalStats) -> None:
    with _STATS_LOCK:
        for s in (STATS, *local):
            setattr(s, field, getattr(s, field) + 1)


class _Slots:
    """Read side shared by writer and reader: loads of the slots and bounded waits."""

    segment: Segment

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def num_layers(self) -> int:
        return self.segment.num_layers

    def _check_layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def step(self, layer: int) -> int:
        """Latest completed step of ``layer`` (-1 if never signalled)."""
        return int(self.segment.slots[self._check_layer(layer), 0])

    def count(self, layer: int) -> int:
        """Signals written to ``layer`` so far."""
        return int(self.segment.slots[self._check_layer(layer), 1])

    def steps(self) -> np.ndarray:
        """int64 copy of every layer's latest step, shape [num_layers]."""
        return self.segment.slots[:, 0].copy()

    def wait(self, layer: int, step: int, timeout_s: float, *, spin_s: float = 50e-6,
             max_sleep_s: float = 1e-3) -> int:
        """Wait until ``layer``'s slot holds a step ``>= step``; return the step seen.

        Spins (re-reading the slot) for ``spin_s`` seconds, then sleeps between reads, doubling
        from 10 us up to ``max_sleep_s`` (the sleep releases the GIL).

        Raises
        ------
        TimeoutError
            After ``timeout_s`` seconds, naming the layer, the step and the segment.
        ValueError
            Bad ``layer``, ``step`` or ``timeout_s``.
        """
        layer = self._check_layer(layer)
        if not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a non-negative number of seconds, got {timeout_s!r}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        slots = self.segment.slots
        t0 = time.perf_counter()
        deadline, spin_until = t0 + timeout_s, t0 + spin_s
        sleep = 10e-6
        while True:
            seen = int(slots[layer, 0])
            if seen >= step:
                return seen
            now = time.perf_counter()
            if now >= deadline:
                raise TimeoutError(
                    f"no signal for layer {layer} of step {step} on segment {self.name!r} within "
                    f"{timeout_s:g} s (layer {layer} last completed step {seen}, "
                    f"{int(slots[layer, 1])} signals so far)")
            if now >= spin_until:
                time.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, max_sleep_s)

    def wait_change(self, last: np.ndarray, timeout_s: float, *, spin_s: float = 50e-6,
                    max_sleep_s: float = 1e-3) -> np.ndarray | None:
        """Wait until any layer's step differs from ``last`` (shape [num_layers]); return the
        new steps, or None after ``timeout_s`` seconds (no exception: the caller decides)."""
        slots = self.segment.slots
        t0 = time.perf_counter()
        deadline, spin_until = t0 + timeout_s, t0 + spin_s
        sleep = 10e-6
        while True:
            now_steps = slots[:, 0].copy()
            if not np.array_equal(now_steps, last):
                return now_steps
            now = time.perf_counter()
            if now >= deadline:
                return None
            if now >= spin_until:
                time.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, max_sleep_s)


def _release(segment: Segment, cuda_address: int | None) -> None:
    if cuda_address is not None:
        torch.cuda.synchronize()  # no signal kernel may still be writing into the mapping
        torch.cuda.cudart().cudaHostUnregister(cuda_address)
    segment.close()


class SignalChannel(_Slots):
    """The writer's end: owns the segment, removes it on :meth:`close`, at exit, or when
    garbage-collected. Make one with :meth:`create`.

    Attributes
    ----------
    segment : Segment
    device : torch.device
        ``cpu``: :meth:`signal` stores from the host. ``cuda``: the segment is host-registered
        and :meth:`signal` enqueues the ``signal_layer`` kernel on the current stream.
    stats : SignalStats
        This channel's counters.
    """

    def __init__(self, segment: Segment, device: torch.device, store: str) -> None:
        self.segment, self.device, self.store = segment, device, store
        self.stats = SignalStats()
        self._lock = threading.Lock()
        cuda_address = None
        if device.type == "cuda":
            cuda_address = segment.address
            err = torch.cuda.cudart().cudaHostRegister(cuda_address, segment.nbytes,
                                                       _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
            if int(err) != 0:
                segment.close()
                raise RuntimeError(f"cudaHostRegister of signal segment {segment.name!r} failed "
                                   f"with CUDA error {int(err)}")
        self._words = torch.from_numpy(segment.words)  # int64 view of the whole mapping
        self._finalizer = weakref.finalize(self, _release, segment, cuda_address)

    @classmethod
    def create(cls, instance_id: str, num_layers: int, *, device: Any = "cpu",
               store: str = "atomic", cleanup: bool = True) -> "SignalChannel | None":
        """Create the instance's segment, or return None inside a profile/dummy run.

        Parameters
        ----------
        instance_id : str
            1-64 characters of ``[A-Za-z0-9_]``; part of the segment name.
        num_layers : int
            Layers (slots).
        device : str or torch.device
            Where :meth:`signal` runs (``"cpu"`` or a CUDA device).
        store : {"atomic", "asm"}
            GPU store kind (see :mod:`kvflow.signal.triton_signal`).
        cleanup : bool
            First remove stale segments of dead owners (:func:`cleanup_stale`).

        Raises
        ------
        ValueError
            Bad ``instance_id``, ``num_layers``, ``device`` or ``store``, naming the value.
        """
        check_num_layers(num_layers)
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {device!r}")
        if store not in ("atomic", "asm"):
            raise ValueError(f"store must be 'atomic' or 'asm', got {store!r}")
        if not sends_allowed():
            _count("creates_suppressed")
            return None
        if cleanup:
            cleanup_stale()
        return cls(Segment.create(instance_id, num_layers), dev, store)

    def signal(self, layer: int, step: int) -> bool:
        """Mark ``layer`` complete through prefill ``step``; False (a counted no-op) inside a
        profile/dummy run.

        CPU: stores ``count + 1`` then ``step``; ``step`` must not be older than the layer's
        current step. CUDA: enqueues ``signal_layer`` on the current stream (call it after the
        layer's KV writes, on their stream).

        Raises
        ------
        ValueError
            Bad ``layer`` or ``step`` (a negative step, or on CPU one older than the slot's).
        RuntimeError
            The channel is closed.
        """
        if not sends_allowed():
            _count("suppressed", self.stats)
            return False
        layer = self._check_layer(layer)
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self.segment.closed:
            raise RuntimeError(f"signal channel {self.name!r} is closed")
        if self.device.type == "cuda":
            from .triton_signal import signal_layer
            signal_layer(self._words, layer, int(step), num_layers=self.num_layers, store=self.store)
        else:
            with self._lock:
                slot = self.segment.slots[layer]
                if step < slot[0]:
                    raise ValueError(f"step={step} is older than layer {layer}'s last signalled "
                                     f"step {int(slot[0])}; steps must not decrease")
                slot[1] = slot[1] + 1
                slot[0] = step  # after count: TSO keeps the order (segment.py)
        _count("written", self.stats)
        return True

    def close(self) -> None:
        """Unregister (CUDA), unmap and remove the segment. Idempotent."""
        self._words = None
        self._finalizer()

    def __enter__(self) -> "SignalChannel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SignalChannel({self.name!r}, num_layers={self.num_layers}, device={self.device})"


class SignalReader(_Slots):
    """The reader's end: attaches to a writer's segment by name (read-only), in any process.

    Raises
    ------
    ValueError, FileNotFoundError
        As :meth:`Segment.attach`.
    """

    def __init__(self, name: str, *, num_layers: int | None = None) -> None:
        self.segment = Segment.attach(name, num_layers=num_layers)
        self._finalizer = weakref.finalize(self, self.segment.close)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "SignalReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
