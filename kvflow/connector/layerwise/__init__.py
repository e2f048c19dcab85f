"""Layerwise transfer for the connectors that send messages (ipc-pull, tcp): each layer's blocks
go as soon as the prefill signals it (P: :class:`LayerwiseSender`, driving a
:class:`LayerwiseScheduler` from a :class:`LayerwiseWorker` thread; D: :class:`LayerParts`)."""

from .parts import LayerParts
from .scheduler import LayerwiseScheduler, LayerwiseStats, SendFn
from .sender import LayerwiseSender
from .worker import LayerwiseWorker

__all__ = ["LayerParts", "LayerwiseScheduler", "LayerwiseSender", "LayerwiseStats",
           "LayerwiseWorker", "SendFn"]
