"""KV transfer between a prefill instance (P) and a decode instance (D).

``ipc``: one host; pull (P's cache in shared memory or exported by CUDA IPC, D copies with
``copy_blocks``) or push (D's cache exported, P writes each layer group into it during the
prefill: :mod:`kvflow.transfer.push`).
``tcp``: P gathers into a staging buffer and sends zero-copy ZMQ frames, D scatters.
See :mod:`kvflow.transfer.base` for the interface.
"""

from __future__ import annotations

import importlib
from typing import Any

TRANSFERS = ("ipc", "tcp")

__all__ = ["KVReceiver", "KVSender", "TransferError", "TransferStats", "TRANSFERS",
           "make_receiver"]


def __getattr__(name: str) -> Any:  # the interface loads torch: import it on first use
    if name in ("KVReceiver", "KVSender", "TransferError", "TransferStats"):
        return getattr(importlib.import_module("kvflow.transfer.base"), name)
    raise AttributeError(f"module 'kvflow.transfer' has no attribute {name!r}")


def make_receiver(name: str, backend: str = "auto") -> Any:
    """D's receiver for transfer ``name`` ("ipc" or "tcp").

    Raises
    ------
    ValueError
        For another name.
    """
    if name == "ipc":
        from .ipc import IpcReceiver
        return IpcReceiver(backend)
    if name == "tcp":
        from .tcp import TcpReceiver
        return TcpReceiver(backend)
    raise ValueError(f"transfer must be one of {TRANSFERS}, got {name!r}")
