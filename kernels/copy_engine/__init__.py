"""The ``copy_engine`` backend: gather, scatter and copy_blocks as batched driver memcpys.

No kernel runs: every op becomes a :class:`~.plan.Plan` (a source address, a destination
address and a byte count per run of consecutive block ids per per-layer tensor,
:mod:`.plan`) that :mod:`.launch` enqueues as one ``cuMemcpyBatchAsync`` (CUDA >= 12.8) or
one ``cuMemcpyAsync`` per copy, on the current torch stream, through ``cuda-bindings``
(``pip install cuda-bindings``). The copies run on the GPU's copy engines and use no SMs, so
they can run beside prefill or decode kernels without taking their SMs (``max_ctas`` is
accepted and ignored: there is no grid to cap).

**The block ids are read on the host.** A memcpy descriptor holds addresses, so the ids must
be on the host to build the plan: ids on the GPU (the ops move host ids there before the
backend runs) are copied back with one device-to-host copy per id tensor, which waits until
the current stream reaches the call (a host synchronisation per op). Calls inside a CUDA
graph capture are refused for that reason. A plan is kept for the next call when everything
it depends on is equal (op, layer range, the other side's addresses, the ids' bytes): a plan
is a pure function of those, and a cache's tensors never move, so reusing it is safe.

Capabilities (:mod:`kvflow.kernels.contract`): ``directions`` ("pull", "push"): between two
GPUs the memcpys are enqueued on the current stream of ``dst_cache``'s device ("pull") or of
``src_cache``'s ("push"), addresses of either GPU being valid under unified addressing (the
ipc-pull connector's CUDA receiver pushes by default); ``block_strides``: plans step
``spec.block_stride_bytes``, so a run of a block-major cache (``BM_NHD``) is one memcpy.
None of the other optional ones: the
ops check ids on the host (``device_checks`` False), compute ``digest=`` with the torch
reference after the copy (``digests`` False), move fp8 per-block scales themselves, and
refuse re-blocked moves (no ``reblock``: another spec or a partial block needs a kernel)
with the contract's error.
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry import register_backend
from . import launch
from .plan import Plan, copy_plan, gather_plan, scatter_plan

DIRECTIONS = ("pull", "push")
__all__ = ["CopyEngineBackend", "Plan", "copy_plan", "gather_plan", "scatter_plan"]


def _host(ids: torch.Tensor) -> np.ndarray:
    """``ids`` as a host numpy array (GPU ids: one device-to-host copy, a sync)."""
    if ids.device.type == "cpu":
        return ids.numpy()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("backend 'copy_engine' reads block ids on the host to build its "
                           "memcpys; it cannot run inside a CUDA graph capture (use 'triton')")
    return ids.cpu().numpy()


class CopyEngineBackend:
    """A backend of :mod:`kvflow.kernels.registry` (contract: :mod:`kvflow.kernels.contract`);
    see the module docstring."""

    name = "copy_engine"
    devices = {"cuda"}
    directions = DIRECTIONS
    block_strides = True  # plans step spec.block_stride_bytes (block-major caches)

    def unavailable_reason(self) -> str | None:
        if launch.bindings_error() is not None:
            return (f"cuda-bindings is not importable ({launch.bindings_error()}); "
                    f"pip install cuda-bindings")
        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            launch.path()
        except Exception as exc:  # noqa: BLE001 - a driver that cannot serve: say why
            return str(exc)
        return None

    def path(self) -> str:
        """The memcpy path in use: ``"batch"`` or ``"per_run"`` (:func:`.launch.path`)."""
        return launch.path()

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        ptr = out.data_ptr()
        h = _host(ids)
        plan = self._plan(cache, ("gather", start, stop, ptr), h,
                          lambda: gather_plan(cache, h, ptr, start, stop))
        self._execute(plan, cache.device)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        ptr = src.data_ptr()
        h = _host(ids)
        plan = self._plan(cache, ("scatter", start, stop, ptr), h,
                          lambda: scatter_plan(ptr, cache, h, start, stop))
        self._execute(plan, cache.device)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             direction="pull"):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        s, d = _host(src_ids), _host(dst_ids)
        other = (src_cache.memory_span()[2], src_cache.num_blocks, s.tobytes())
        plan = self._plan(dst_cache, ("copy", start, stop, other), d,
                          lambda: copy_plan(src_cache, dst_cache, s, d, start, stop))
        self._execute(plan, dst_cache.device if direction == "pull" else src_cache.device)

    @staticmethod
    def _plan(cache, key: tuple, ids: np.ndarray, build) -> Plan:
        """The plan for ``key`` and ``ids``: the last one of ``cache`` when both are equal,
        else a new one (kept as the last)."""
        key = key + (ids.dtype.str, ids.tobytes())
        last = cache.backend_state.get("copy_engine")
        if last is not None and last[0] == key:
            return last[1]
        plan = build()
        cache.backend_state["copy_engine"] = (key, plan)
        return plan

    @staticmethod
    def _execute(plan: Plan, device: torch.device) -> None:
        launch.execute(plan, device)


register_backend(CopyEngineBackend())
