"""kvflow: kernel-first KV-cache movement between prefill (P) and decode (D) instances.

``import kvflow`` is cheap: submodules (and torch, numba, triton) load on first use of a name
(PEP 562), so nothing is compiled at import.

Public names: :class:`KVCacheSpec`, :class:`PagedKVCache`, :func:`staging_buffer`,
:func:`staging_shape`, and the ops in :mod:`kvflow.kernels` (``gather_blocks``,
``scatter_blocks``, ``copy_blocks``, ``copy_sequence``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KVCacheSpec": "kvflow.layout",
    "LAYOUTS": "kvflow.layout",
    "PagedKVCache": "kvflow.cache",
    "staging_buffer": "kvflow.cache",
    "staging_shape": "kvflow.cache",
    "gather_blocks": "kvflow.kernels",
    "scatter_blocks": "kvflow.kernels",
    "copy_blocks": "kvflow.kernels",
    "copy_sequence": "kvflow.kernels",
    "available_backends": "kvflow.kernels",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
