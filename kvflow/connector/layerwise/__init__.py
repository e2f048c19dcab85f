"""Layerwise transfer for the connectors that send messages (ipc-pull, tcp): each layer's
blocks go as soon as the prefill signals it.

:class:`LayerwiseScheduler` turns layer signals into ``send(request_id, layers, src_ids,
dst_ids)`` calls (transport-agnostic); :class:`LayerwiseWorker` is the thread that reads a
:mod:`kvflow.signal` segment and drives it; :class:`LayerwiseSender` is P's side (segment,
scheduler, worker, a socket per D); :class:`LayerParts` is D's bookkeeping of arrived parts.
"""

from .parts import LayerParts
from .scheduler import LayerwiseScheduler, LayerwiseStats, SendFn
from .sender import LayerwiseSender
from .worker import LayerwiseWorker

__all__ = ["LayerParts", "LayerwiseScheduler", "LayerwiseSender", "LayerwiseStats",
           "LayerwiseWorker", "SendFn"]
