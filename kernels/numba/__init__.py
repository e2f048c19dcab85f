"""Numba backends: ``numba`` (CPU, this module) and ``numba_cuda`` (:mod:`.cuda`)."""

from .cpu import NumbaCPUBackend  # noqa: F401  (registers the backend)
