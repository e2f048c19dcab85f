"""Layerwise KV transfer: send each layer's blocks as soon as the prefill signals it.

:class:`LayerwiseScheduler` turns layer signals into ``send(request_id, layers, src_ids,
dst_ids)`` calls (transport-agnostic); :class:`LayerwiseWorker` is the thread that reads a
:mod:`kvflow.signal` segment and drives it.
"""

from .scheduler import (DEFAULT_LAYERWISE_MIN_TOKENS, MODES, LayerwiseScheduler, LayerwiseStats,
                        SendFn)
from .worker import LayerwiseWorker

__all__ = ["LayerwiseScheduler", "LayerwiseWorker", "LayerwiseStats", "SendFn", "MODES",
           "DEFAULT_LAYERWISE_MIN_TOKENS"]
