"""Numba backends: ``numba`` (CPU, this module) and ``numba_cuda`` (:mod:`.gpu`; not named `cuda`: numba-cuda's import redirector hijacks module names ending in `numba.cuda`)."""

from .cpu import NumbaCPUBackend  # noqa: F401  (registers the backend)
