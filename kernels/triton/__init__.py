"""The ``triton`` backend: gather, scatter and copy_blocks as one launch over all layers.

Runs on CUDA tensors; under ``TRITON_INTERPRET=1`` it runs on CPU tensors instead (the CI
path; CUDA tensors are then refused, since the interpreter would dereference device addresses
on the host). The kernel and its launch settings live in :mod:`.copy_runs`.

``copy`` takes ``direction``: ``"pull"`` (default) runs the kernel on ``dst_cache``'s GPU,
reading ``src_cache`` over the peer link; ``"push"`` runs it on ``src_cache``'s GPU, writing
into ``dst_cache``. Both need peer access between the two GPUs
(``torch.cuda.can_device_access_peer``) and the caller must order the source's writes before
the copy (e.g. an event recorded on the producer's stream). The kernel is enqueued on the
executing device's current stream; the call returns without waiting.

Host work per call is a dict lookup of a launch plan (:mod:`.launch`) and one launch of the
kernel compiled for it; with ``check=True`` ids are checked by the kernel (the device's error
record, :mod:`kvflow.kernels.errors`), so nothing waits for the device.
"""

from __future__ import annotations

import os

import torch

from ..errors import OP_CODES, record_for
from ..graphs import no_repeat_check
from ..registry import register_backend
from ..tables import alignment, stamps, table_addr

try:
    from . import launch as _launch
    _IMPORT_ERROR = None
except ImportError as exc:  # triton missing or broken
    _launch = None
    _IMPORT_ERROR = str(exc)

DIRECTIONS = ("pull", "push")


class TritonBackend:
    """Backend object for :mod:`kvflow.kernels.registry` (see its contract)."""

    name = "triton"
    directions = DIRECTIONS
    device_checks = True  # check=True: ids are checked by the kernel, on the device

    @property
    def devices(self) -> set[str]:
        return {"cpu"} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"cuda"}

    def unavailable_reason(self) -> str | None:
        if _launch is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if "cpu" in self.devices or torch.cuda.is_available():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run on CPU tensors)"

    def gather(self, cache, ids, out, start, stop, max_ctas=None, check=False):
        dev, n, ptr = cache.device, ids.shape[0], out.data_ptr()
        table, align = table_addr(cache, dev)
        T, bb = cache.spec.tensors_per_layer, cache.spec.block_bytes
        a = alignment(align, bb, ptr)
        i64 = ids.dtype == torch.int64
        key = ("gather", start, stop, max_ctas, i64, check, a)
        plan = _plans(cache).get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = _plan(cache, key, dev, bb, a, (stop - start) * T, True, False, i64, False,
                         check, False, max_ctas)
        rec = record_for(dev)
        plan.launch(table + start * T * 8, 0, 0, ptr, ids.data_ptr(), 0, n, cache.num_blocks, n,
                    rec.record_addr, rec.ready_addr, 0, 0, _GATHER)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None, check=False):
        dev, n, ptr = cache.device, ids.shape[0], src.data_ptr()
        table, align = table_addr(cache, dev)
        T, bb = cache.spec.tensors_per_layer, cache.spec.block_bytes
        a = alignment(align, bb, ptr)
        i64 = ids.dtype == torch.int64
        dup = check and not _capturing(dev)
        key = ("scatter", start, stop, max_ctas, i64, check, dup, a)
        plan = _plans(cache).get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = _plan(cache, key, dev, bb, a, (stop - start) * T, False, True, False, i64,
                         check, dup, max_ctas)
        rec = record_for(dev)
        st = stamps(cache, dev) if dup else None
        plan.launch(0, table + start * T * 8, ptr, 0, 0, ids.data_ptr(), n, n, cache.num_blocks,
                    rec.record_addr, rec.ready_addr, st.addr if st else 0,
                    st.next() if st else 0, _SCATTER)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             direction="pull", check=False, same=False):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        dev = dst_cache.device if direction == "pull" else src_cache.device
        if src_cache.device != dst_cache.device and dev.type == "cuda":
            _check_peer(src_cache.device, dst_cache.device, direction)
        if src_ids.device != dev:
            src_ids = src_ids.to(dev, non_blocking=True)
        if dst_ids.device != dev:
            dst_ids = dst_ids.to(dev, non_blocking=True)
        T, bb = src_cache.spec.tensors_per_layer, src_cache.spec.block_bytes
        s_table, s_align = table_addr(src_cache, dev)
        d_table, d_align = table_addr(dst_cache, dev)
        a = alignment(s_align, d_align, bb)
        s64, d64 = src_ids.dtype == torch.int64, dst_ids.dtype == torch.int64
        dup = check and not _capturing(dev)
        shared = same and dup  # one cache: stamp the destinations first, in their own launch
        plan = _plan(dst_cache, ("copy", dev, start, stop, max_ctas, s64, d64, check, dup,
                                 shared, a),
                     dev, bb, a, (stop - start) * T, True, True, s64, d64, check,
                     dup and not shared, max_ctas, shared=shared)
        rec = record_for(dev)
        st = stamps(dst_cache, dev) if dup else None
        args = (s_table + start * T * 8, d_table + start * T * 8, 0, 0, src_ids.data_ptr(),
                dst_ids.data_ptr(), src_ids.shape[0], src_cache.num_blocks,
                dst_cache.num_blocks, rec.record_addr, rec.ready_addr, st.addr if st else 0,
                st.next() if st else 0, _COPY)
        if shared:
            _plan(dst_cache, ("stamp", dev, s64, d64), dev, bb, a, 1, True, True, s64, d64,
                  True, True, None, stamp_only=True).launch(*args)
        plan.launch(*args)


_GATHER, _SCATTER, _COPY = (OP_CODES[k] for k in ("gather_blocks", "scatter_blocks",
                                                  "copy_blocks"))


def _plans(cache) -> dict:
    """The plans of ``cache`` (made on first use)."""
    plans = cache.backend_state.get("triton_plans")
    if plans is None:
        plans = cache.backend_state["triton_plans"] = {}
    return plans


def _plan(cache, key, device, run_bytes, align, num_tensors, src_cache, dst_cache, src_i64,
          dst_i64, check, dup, max_ctas, shared=False, stamp_only=False):
    """The launch plan for ``key``, kept in ``cache.backend_state``. A plan holds no address:
    the cache tables, ids and buffers are passed per call, so a peer cache never lives in it."""
    plans = _plans(cache)
    plan = plans.get(key)
    if plan is not None and plan.config is _launch.current_config():
        return plan
    plan = plans[key] = _launch.Plan(device=device, run_bytes=run_bytes, align=align,
                                     num_tensors=num_tensors, src_cache=src_cache,
                                     dst_cache=dst_cache, src_i64=src_i64, dst_i64=dst_i64,
                                     check=check, dup=dup, max_ctas=max_ctas,
                                     shared=shared, stamp_only=stamp_only)
    return plan


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is captured (or warmed up for it, :mod:`kvflow.kernels.graphs`):
    the repeat check is left out (a captured call number would repeat at every replay)."""
    return device.type == "cuda" and no_repeat_check()


_PEER: dict[tuple[int, int], bool] = {}


def _check_peer(src: torch.device, dst: torch.device, direction: str) -> None:
    a, b = src.index, dst.index
    pair = (b, a) if direction == "pull" else (a, b)
    if pair not in _PEER:
        _PEER[pair] = torch.cuda.can_device_access_peer(*pair)
    if not _PEER[pair]:
        raise RuntimeError(f"copy_blocks direction={direction!r} needs peer access "
                           f"between {src} and {dst}")


register_backend(TritonBackend())
