"""kvflow.kernels: block-movement ops over paged KV caches, with pluggable backends.

>>> from kvflow.kernels import gather_blocks, scatter_blocks, copy_blocks, available_backends

Block pairs: :func:`gather_blocks` (cache to staging buffer), :func:`scatter_blocks` (the
inverse), :func:`copy_blocks` (cache to cache, one spec). A request's tokens between block
tables of caches of different specs (re-blocking): :func:`copy_sequence`.

Backends: ``torch`` (reference), ``numba`` (CPU), ``numba_cuda`` and ``triton`` (GPU),
``native`` (the C++ host extension in ``xpu/``). What a backend implements and guarantees:
:mod:`kvflow.kernels.contract`; how ``backend="auto"`` and ``KVFLOW_BACKEND`` choose:
:mod:`kvflow.kernels.registry`. Reading path: kernels/README.md.

Block ids on a GPU are checked by the kernel, on the device, and reported by the next call or
:func:`check_errors` (:mod:`kvflow.kernels.errors`): a default call never waits for the GPU.
:func:`block_digest` defines the per-block digest that ``digest=`` of the ops writes
(``--kv-verify``, :mod:`kvflow.kernels.digest`). :func:`capture` records fixed-shape calls into a CUDA graph (:mod:`kvflow.kernels.graphs`).
"""

from .digest import block_digest
from .errors import check_errors
from .graphs import capture
from .ops import copy_blocks, gather_blocks, payload_bytes, scatter_blocks
from .reblock_ops import copy_sequence
from .registry import available_backends, backend_names, get_backend, register_backend

__all__ = ["block_digest", "capture", "check_errors", "gather_blocks", "scatter_blocks", "copy_blocks",
           "copy_sequence", "payload_bytes", "available_backends", "backend_names", "get_backend",
           "register_backend"]
