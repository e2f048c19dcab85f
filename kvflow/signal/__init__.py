"""Layer-completion signals from the prefill to the transfer worker.

A per-instance POSIX shared-memory segment (:mod:`.segment`, the byte layout) holds one slot per
layer: the latest prefill step whose layer KV is complete. P's layerwise hook writes it
(:class:`LayerSignaller` / :class:`SignalChannel`: a CPU store after the layer, or the
stream-ordered GPU kernel of :mod:`.triton_signal`); the transfer worker of
:mod:`kvflow.connector.layerwise` reads it (:class:`SignalReader`, in any process) with bounded
waits. This is kvflow's one signal channel: the native C++ signaller that once mirrored the
layout was removed (docs/xpu.md, "No native signaller"). Nothing is created or signalled inside
a profile / dummy run (:func:`kvflow.context.sends_allowed`).

>>> from kvflow.signal import SignalChannel, SignalReader
>>> ch = SignalChannel.create("p0", num_layers=4)
>>> ch.signal(0, step=7)
True
>>> SignalReader(ch.name).wait(0, 7, timeout_s=1.0)
7
>>> ch.close()
"""

from .channel import STATS, SignalChannel, SignalReader, SignalStats
from .signaller import LayerSignaller
from .segment import (COUNT_OFFSET, HEADER_BYTES, MAGIC, SLOT_BYTES, STEP_OFFSET, VERSION,
                      Segment, cleanup_stale, segment_bytes)

__all__ = ["SignalChannel", "SignalReader", "LayerSignaller", "SignalStats", "STATS", "Segment",
           "cleanup_stale", "segment_bytes", "MAGIC", "VERSION", "HEADER_BYTES", "SLOT_BYTES",
           "STEP_OFFSET", "COUNT_OFFSET"]
