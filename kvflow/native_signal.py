"""The native signal path: the C++ segment writer and kv signal sender of ``kvflow._native``,
usable wherever kvflow's Python signal channel is (:mod:`kvflow.signal`).

The segment is the same file as :class:`kvflow.signal.Segment` (layout in
``kvflow/signal/segment.py``; created here by C++ ``shm_open`` with the same name scheme, mode
0600 and size), so a :class:`kvflow.signal.SignalReader` in the transfer worker reads what
these writers store, and the reverse.

- :class:`NativeSignalChannel` -- the writer's end; :meth:`~NativeSignalChannel.signal` stores
  from the calling thread (count, then a release store of step).
- :class:`NativeLayerSignaller` -- drop-in for :class:`kvflow.signal.LayerSignaller`: its
  :meth:`~NativeLayerSignaller.signal` enqueues ``(layer, step, completion)`` to a native worker
  thread, which waits for the completion (a :class:`CompletionFlag` the caller sets, a callable
  such as ``torch.cuda.Event.synchronize``, or, in XPU builds, an XPU event) and then writes
  the flag. :meth:`~NativeLayerSignaller.close` drains the queue and joins the worker.

Gating (the seed's two fixes): nothing is created, enqueued or written while
:func:`kvflow.context.sends_allowed` is False (profile / dummy / warm-up / graph-capture run)
or the native switch :func:`set_profile_run` is on; :func:`send_signal` before
:func:`init_signal_layerwise` is a counted no-op.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

from kvflow.context import sends_allowed
from kvflow.signal.segment import check_instance_id, check_num_layers, cleanup_stale
from kvflow.signal.segment import new_segment_name as _new_name

try:
    from kvflow import _native
    _IMPORT_ERROR = None
except ImportError as exc:
    _native = None
    _IMPORT_ERROR = f"kvflow._native is not built or failed to import ({exc})"


def _lib():
    if _native is None:
        raise RuntimeError(_IMPORT_ERROR)
    return _native


def available() -> bool:
    """True when ``kvflow._native`` imported (the native signal path can run)."""
    return _native is not None


def CompletionFlag():  # noqa: N802 - a factory that reads as the native class
    """A completion handle for :meth:`NativeLayerSignaller.signal`: call ``.set()`` once the
    layer's cache write is done (``.is_set()``, ``.wait(timeout_s)`` too)."""
    return _lib().CompletionFlag()


def new_segment_name(instance_id: str) -> str:
    """``kvflow-sig-<instance_id>-<owner>-<16 random hex>``, the name scheme of every kvflow
    segment (:mod:`kvflow.segments`)."""
    return _new_name(instance_id)


# ---- the seed's process-wide channel ---------------------------------------------------------
def set_profile_run(on: bool) -> None:
    """Native switch: while on, :func:`send_signal`, :func:`init_signal_layerwise` and every
    sender enqueue are counted no-ops (besides :func:`kvflow.context.sends_allowed`)."""
    _lib().set_profile_run(bool(on))


def init_signal_layerwise(channel: "NativeSignalChannel") -> bool:
    """Make ``channel`` the process-wide target of :func:`send_signal`; False (nothing done)
    during a profile run."""
    return _lib().init_signal_layerwise(channel.segment, sends_allowed())


def reset_signal_layerwise() -> None:
    """Forget the process-wide channel (later sends are no-ops again)."""
    _lib().reset_signal_layerwise()


def send_signal(layer: int, step: int) -> bool:
    """Write ``step`` into ``layer``'s slot of the process-wide channel. A counted no-op (False)
    before :func:`init_signal_layerwise` and during a profile run.

    Raises
    ------
    IndexError
        ``layer`` outside the segment; ValueError for a negative or decreasing ``step``.
    """
    return _lib().send_signal(layer, step, sends_allowed())


def signal_stats() -> dict[str, int]:
    """Process-wide native counters: ``written``, ``suppressed_uninit`` (send before init),
    ``suppressed_profile`` (send or init during a profile run)."""
    return dict(_lib().signal_stats())


# ---- writer's end ----------------------------------------------------------------------------
class NativeSignalChannel:
    """The writer's end of a signal segment created by the native extension.

    Attributes
    ----------
    segment : kvflow._native.SignalSegment
    name : str
        ``kvflow-sig-<instance_id>-<owner>-<16 hex>`` (attach with :class:`kvflow.signal.SignalReader`).
    num_layers : int
    """

    def __init__(self, segment: Any) -> None:
        self.segment = segment
        self._finalizer = weakref.finalize(self, _close_segment, segment)

    @classmethod
    def create(cls, instance_id: str, num_layers: int, *,
               cleanup: bool = True) -> "NativeSignalChannel | None":
        """Create this instance's segment (``open_shm_and_get_meta_signal(name, n, True)``), or
        return None inside a profile/dummy run (nothing is created).

        Raises
        ------
        ValueError
            Bad ``instance_id`` or ``num_layers``, naming the value.
        RuntimeError
            ``kvflow._native`` missing, or ``shm_open`` failed (with the OS error).
        """
        check_instance_id(instance_id)
        check_num_layers(num_layers)
        lib = _lib()
        if not sends_allowed() or lib.is_profile_run():
            lib.init_signal_layerwise(None, False)  # counts the refused set-up
            return None
        if cleanup:
            cleanup_stale()
        return cls(lib.open_shm_and_get_meta_signal(new_segment_name(instance_id), num_layers, True))

    @classmethod
    def attach(cls, name: str, *, num_layers: int = 0) -> "NativeSignalChannel":
        """Attach an existing segment by name (e.g. one a Python channel created)."""
        return cls(_lib().open_shm_and_get_meta_signal(name, num_layers, False))

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def num_layers(self) -> int:
        return self.segment.num_layers

    def signal(self, layer: int, step: int) -> bool:
        """Store ``step`` into ``layer``'s slot now; False (a no-op) during a profile run."""
        if not sends_allowed() or _lib().is_profile_run():
            return False
        self.segment.write(layer, step)
        return True

    def step(self, layer: int) -> int:
        return self.segment.step(layer)

    def count(self, layer: int) -> int:
        return self.segment.count(layer)

    def wait(self, layer: int, step: int, timeout_s: float) -> int:
        """Wait (GIL released) until ``layer``'s step is ``>= step``; TimeoutError naming the
        layer, the step and the segment after ``timeout_s`` seconds."""
        return self.segment.wait(layer, step, float(timeout_s))

    def close(self) -> None:
        """Unmap; the creator also removes the file. Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"NativeSignalChannel({self.name!r}, num_layers={self.num_layers})"


def _close_segment(segment: Any) -> None:
    owner = segment.owner
    segment.close()
    if owner:
        segment.unlink()


# ---- the layerwise signaller with the native sender thread -------------------------------------
class NativeLayerSignaller:
    """Drop-in for :class:`kvflow.signal.LayerSignaller` whose signals go through the native
    kv signal sender (``create_kv_signal_sender`` / ``destroy_kv_signal_sender``).

    Parameters
    ----------
    instance_id : str
        Part of the segment name.
    num_layers : int
        Layers (slots).
    completion_timeout_s : float
        Longest the worker waits for one completion; past it the signal is dropped and counted
        in :attr:`failed` (never a hang).

    Attributes
    ----------
    channel : NativeSignalChannel or None
        None before :meth:`init` and after a refused one.
    stats : dict
        ``enqueued``, ``suppressed`` (before init or during a profile run), ``creates_suppressed``.
    """

    def __init__(self, instance_id: str, num_layers: int, *,
                 completion_timeout_s: float = 60.0) -> None:
        self.instance_id = check_instance_id(instance_id)
        self.num_layers = check_num_layers(num_layers)
        if not isinstance(completion_timeout_s, (int, float)) or not completion_timeout_s > 0:
            raise ValueError(f"completion_timeout_s must be a positive number of seconds, "
                             f"got {completion_timeout_s!r}")
        self.completion_timeout_s = float(completion_timeout_s)
        self.channel: NativeSignalChannel | None = None
        self._sender: Any = None
        self.stats = {"enqueued": 0, "suppressed": 0, "creates_suppressed": 0}

    @property
    def name(self) -> str | None:
        return None if self.channel is None else self.channel.name

    def init(self) -> NativeSignalChannel | None:
        """Create the segment and start the sender thread, unless in a profile/dummy run."""
        if self.channel is None:
            self.channel = NativeSignalChannel.create(self.instance_id, self.num_layers)
            if self.channel is None:
                self.stats["creates_suppressed"] += 1
                return None
            self._sender = _lib().create_kv_signal_sender(self.channel.segment,
                                                          self.completion_timeout_s)
            # drain + join at garbage collection or interpreter exit if close() was not called
            self._finalizer = weakref.finalize(self, _lib().destroy_kv_signal_sender, self._sender)
        return self.channel

    def signal(self, layer: int, step: int, completion: Any = None) -> bool:
        """Enqueue ``(layer, step, completion)``; the worker writes the flag once ``completion``
        is done (None: at once). A counted no-op (False) before :meth:`init` or during a
        profile run.

        Raises
        ------
        IndexError
            ``layer`` outside the segment; TypeError for an unsupported ``completion``.
        """
        if self._sender is None or not sends_allowed() or _lib().is_profile_run():
            self.stats["suppressed"] += 1
            return False
        self._sender.enqueue(layer, step, completion)
        self.stats["enqueued"] += 1
        return True

    def layer_hook(self, step: int) -> Callable[[int], None]:
        """``on_layer_done(layer)`` callback for one prefill step."""
        return lambda layer: self.signal(layer, step)

    @property
    def written(self) -> int:
        return 0 if self._sender is None else self._sender.written

    @property
    def failed(self) -> int:
        """Signals dropped (completion timed out or raised); see :attr:`last_error`."""
        return 0 if self._sender is None else self._sender.failed

    @property
    def last_error(self) -> str:
        return "" if self._sender is None else self._sender.last_error

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every enqueued signal is written or dropped.

        Raises
        ------
        TimeoutError
            Items still pending after ``timeout_s`` seconds (naming how many).
        """
        if self._sender is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._sender.pending:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._sender.pending} signals still pending in the native "
                                   f"sender of {self.name!r} after {timeout_s:g} s")
            time.sleep(20e-6)

    def close(self) -> int:
        """Drain and join the sender (``destroy_kv_signal_sender``), then remove the segment.
        Returns the signals written. Idempotent."""
        written = 0
        if self._sender is not None:
            self._finalizer.detach()
            written = _lib().destroy_kv_signal_sender(self._sender)
            self._sender = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        return written

    def __enter__(self) -> "NativeLayerSignaller":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
