"""Backend registry: one op signature, several implementations, chosen per device.

The contract a backend meets (its methods, what they take and guarantee, the optional
capabilities ``device_checks`` / ``digests`` / ``directions`` / ``reblock``) is
:mod:`kvflow.kernels.contract`.

Choice (``backend=`` of every op): ``"auto"`` takes ``KVFLOW_BACKEND`` if set, else the first
available backend of :data:`AUTO_ORDER` for the device; an explicitly named backend (argument or
environment) that is unavailable or cannot run on the device raises, never falls back.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from .contract import Backend

# Modules that define backends, imported on first lookup (so `import kvflow` compiles nothing).
_MODULES = {
    "torch": "kvflow.kernels.reference",
    "numba": "kvflow.kernels.numba",
    "numba_cuda": "kvflow.kernels.numba.gpu",
    "triton": "kvflow.kernels.triton",
    "copy_engine": "kvflow.kernels.copy_engine",  # driver memcpys, no SMs; never picked by auto
    "native": "kvflow.kernels.native",
    "xpu": "kvflow.kernels.native",  # Kunlun XPU variant of kvflow._native (SDK builds only)
}
AUTO_ORDER = {"cpu": ("numba", "native", "torch"), "cuda": ("triton", "numba_cuda", "torch")}
_BACKENDS: dict[str, Any] = {}


_AUTO: dict[tuple[str, str, str], Any] = {}  # resolved "auto" choices (cleared on register)


def register_backend(backend: Any) -> Any:
    """Register (or replace) a backend object; returns it (usable as a decorator on an instance)."""
    _BACKENDS[backend.name] = backend
    _AUTO.clear()
    return backend


_LOAD_ERRORS: dict[str, str] = {}


def _load(name: str) -> Any | None:
    if name not in _BACKENDS and name in _MODULES and name not in _LOAD_ERRORS:
        try:
            importlib.import_module(_MODULES[name])
        except Exception as exc:  # noqa: BLE001 - a broken backend must not break the others
            _LOAD_ERRORS[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return _BACKENDS.get(name)


def backend_names() -> list[str]:
    """Every backend kvflow knows of, available here or not."""
    return sorted(set(_MODULES) | set(_BACKENDS))


def available_backends() -> dict[str, str]:
    """Map each known backend to ``"available"`` or the reason it cannot run here."""
    out = {}
    for name in backend_names():
        b = _load(name)
        if b is None:
            out[name] = (f"not importable (module {_MODULES.get(name)}: "
                         f"{_LOAD_ERRORS.get(name, 'no backend registered')})")
        else:
            out[name] = b.unavailable_reason() or "available"
    return out


def get_backend(name: str, device: torch.device) -> Backend:
    """Resolve ``name`` ("auto" or a backend name) for a cache on ``device``.

    Raises
    ------
    ValueError
        Unknown backend name, or a backend that cannot run on ``device``.
    RuntimeError
        An explicitly requested backend that is unavailable here (with the reason).
    """
    if name == "auto":  # the default: resolved once per device type and environment
        key = (device.type, _env(b"KVFLOW_BACKEND"), _env(b"TRITON_INTERPRET"))
        hit = _AUTO.get(key)
        if hit is None:
            hit = _AUTO[key] = _resolve(name, device)
        return hit
    return _resolve(name, device)


_ENV = getattr(os.environ, "_data", None)  # CPython's bytes view of os.environ: a dict lookup


def _env(name: bytes) -> Any:
    """The raw value of an environment variable (or None), cheaper than ``os.environ.get``."""
    if _ENV is None:
        return os.environ.get(name.decode())
    return _ENV.get(name)


def _resolve(name: Any, device: torch.device) -> Any:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {name!r}")
    explicit, source = name != "auto", "backend"
    if not explicit:
        env = os.environ.get("KVFLOW_BACKEND", "").strip()
        if env and env != "auto":
            name, explicit, source = env, True, "KVFLOW_BACKEND"
    if explicit:
        if name not in backend_names():
            raise ValueError(f"{source}={name!r} is unknown; known backends: {backend_names()}")
        b = _load(name)
        reason = (f"not importable ({_LOAD_ERRORS.get(name, 'no backend registered')})"
                  if b is None else b.unavailable_reason())
        if reason:
            raise RuntimeError(f"{source}={name!r} is unavailable: {reason}")
        if device.type not in b.devices:
            raise ValueError(f"{source}={name!r} runs on {sorted(b.devices)}, not on {device}")
        return b
    for cand in AUTO_ORDER.get(device.type, ("torch",)):
        b = _load(cand)
        if b is not None and b.unavailable_reason() is None and device.type in b.devices:
            return b
    raise RuntimeError(f"no kvflow backend can run on {device}")
