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

from .. import digest as fallback
from ..errors import OP_CODES, record_for
from ..graphs import no_repeat_check
from ..registry import register_backend
from ..tables import alignment, device_table, stamps

try:
    from . import launch as _launch
    _IMPORT_ERROR = None
except ImportError as exc:  # triton missing or broken
    _launch = None
    _IMPORT_ERROR = str(exc)

DIRECTIONS = ("pull", "push")


class TritonBackend:
    """A backend of :mod:`kvflow.kernels.registry` (contract: :mod:`kvflow.kernels.contract`)."""

    name = "triton"
    directions = DIRECTIONS
    device_checks = True  # check=True: ids are checked by the kernel, on the device
    digests = True  # digest=: in the copy's launch (runs not 4-byte aligned: the reference)
    block_strides = True  # block-major caches (BM_NHD): blocks block_stride_bytes apart

    @property
    def devices(self) -> set[str]:
        return {"cpu"} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"cuda"}

    def unavailable_reason(self) -> str | None:
        if _launch is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if "cpu" in self.devices or torch.cuda.is_available():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run on CPU tensors)"

    def gather(self, cache, ids, out, start, stop, max_ctas=None, check=False, digest=None):
        dev, n, ptr = cache.device, ids.shape[0], out.data_ptr()
        info = _info(cache, dev)
        a = alignment(info.align, ptr)
        i64 = ids.dtype == torch.int64
        dg = digest is not None and a >= 4  # else the reference digest, after the copy
        key = ("gather", start, stop, max_ctas, i64, check, a, dg)
        plan = info.plans.get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = info.plans[key] = _new_plan(cache, dev, a, stop - start, True, False, i64,
                                               False, check, False, max_ctas, digest=dg)
        plan.launch(info.table + start * info.layer_bytes, 0, 0, ptr, ids.data_ptr(), 0, n,
                    cache.num_blocks, n, info.errors, info.ready, 0, 0, _GATHER,
                    digest.data_ptr() if dg else 0, start * cache.spec.tensors_per_layer)
        if digest is not None and not dg:
            fallback.gathered(cache, ids, out, start, digest)

    def digest(self, cache, ids, start, stop, digest):
        """Digest-only launch: ``digest[i]`` (int32 ``[n]``, zeroed) += the digest of block
        ``ids[i]`` over layers ``[start, stop)``, reading the blocks once and writing nothing
        (:func:`kvflow.kernels.digest.digest_blocks`); ids outside ``[0, num_blocks)`` are
        skipped (their digest stays 0). Returns False, launching nothing, for runs that are
        not 4-byte aligned."""
        dev, n = cache.device, ids.shape[0]
        info = _info(cache, dev)
        if info.align < 4:
            return False
        i64 = ids.dtype == torch.int64
        key = ("digest", start, stop, i64, info.align)
        plan = info.plans.get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = info.plans[key] = _new_plan(cache, dev, info.align, stop - start, True, False,
                                               i64, False, False, False, None, digest=True,
                                               store=False)
        plan.launch(info.table + start * info.layer_bytes, 0, 0, 0, ids.data_ptr(), 0, n,
                    cache.num_blocks, n, info.errors, info.ready, 0, 0, _GATHER,
                    digest.data_ptr(), start * cache.spec.tensors_per_layer)
        return True

    def scatter(self, src, cache, ids, start, stop, max_ctas=None, check=False, digest=None):
        dev, n, ptr = cache.device, ids.shape[0], src.data_ptr()
        info = _info(cache, dev)
        a = alignment(info.align, ptr)
        i64 = ids.dtype == torch.int64
        dup = check and not _capturing(dev)
        dg = digest is not None and a >= 4
        key = ("scatter", start, stop, max_ctas, i64, check, dup, a, dg)
        plan = info.plans.get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = info.plans[key] = _new_plan(cache, dev, a, stop - start, False, True, False,
                                               i64, check, dup, max_ctas, digest=dg)
        st = stamps(cache, dev) if dup else None
        plan.launch(0, info.table + start * info.layer_bytes, ptr, 0, 0, ids.data_ptr(), n, n,
                    cache.num_blocks, info.errors, info.ready, st.addr if st else 0,
                    st.next() if st else 0, _SCATTER, digest.data_ptr() if dg else 0,
                    start * cache.spec.tensors_per_layer)
        if digest is not None and not dg:
            fallback.scattered(src, cache, ids, start, digest)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             direction="pull", check=False, same=False, digest=None):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        dev = dst_cache.device if direction == "pull" else src_cache.device
        if src_cache.device != dst_cache.device and dev.type == "cuda":
            _check_peer(src_cache.device, dst_cache.device, direction)
        if src_ids.device != dev:
            src_ids = src_ids.to(dev, non_blocking=True)
        if dst_ids.device != dev:
            dst_ids = dst_ids.to(dev, non_blocking=True)
        si, di = _info(src_cache, dev), _info(dst_cache, dev)
        a = alignment(si.align, di.align)
        s64, d64 = src_ids.dtype == torch.int64, dst_ids.dtype == torch.int64
        dup = check and not _capturing(dev)
        shared = same and dup  # one cache: stamp the destinations first, in their own launch
        plans = di.plans
        dg = digest is not None and a >= 4
        key = ("copy", start, stop, max_ctas, s64, d64, check, dup, shared, a, dg)
        plan = plans.get(key)
        if plan is None or plan.config is not _launch.current_config():
            plan = plans[key] = _new_plan(dst_cache, dev, a, stop - start, True, True, s64, d64,
                                          check, dup and not shared, max_ctas, shared=shared,
                                          digest=dg)
        st = stamps(dst_cache, dev) if dup else None
        args = (si.table + start * si.layer_bytes, di.table + start * di.layer_bytes, 0, 0,
                src_ids.data_ptr(), dst_ids.data_ptr(), src_ids.shape[0], src_cache.num_blocks,
                dst_cache.num_blocks, di.errors, di.ready, st.addr if st else 0,
                st.next() if st else 0, _COPY)
        if shared:
            key = ("stamp", s64, d64, a)
            stamp = plans.get(key)
            if stamp is None or stamp.config is not _launch.current_config():
                stamp = plans[key] = _new_plan(dst_cache, dev, a, 1, True, True, s64, d64, True,
                                               True, None, stamp_only=True)
            stamp.launch(*args)
        plan.launch(*args, digest.data_ptr() if dg else 0, start * dst_cache.spec.tensors_per_layer)
        if digest is not None and not dg:
            fallback.copied(src_cache, src_ids, dst_ids, dst_cache.num_blocks, start, stop,
                            digest)


    def reblock(self, job, max_ctas=None, check=False):
        """Copy between different specs in one launch (:mod:`.reblock`); runs on the
        destination's device (``job.dst``), reading the source over the peer link if needed."""
        from . import reblock_launch
        for side in (job.src, job.dst):
            if side.cache is not None and side.cache.spec.block_major:
                raise ValueError(f"backend 'triton' does not re-block block-major caches "
                                 f"(layout={side.cache.spec.layout!r}); use backend='torch' "
                                 f"or 'numba'")
        op = job.dst.cache if job.dst.cache is not None else job.src.cache
        dev = op.device if job.dst.cache is not None else job.dst.stage.device
        for side in (job.src, job.dst):
            if side.ids is not None and side.ids.device != dev:
                side.ids = side.ids.to(dev, non_blocking=True)
        if job.src.cache is not None and job.src.cache.device != dev and dev.type == "cuda":
            _check_peer(job.src.cache.device, dev, "pull")
        reblock_launch.launch(job, dev, max_ctas, check, _info, _capturing(dev))


_GATHER, _SCATTER, _COPY = (OP_CODES[k] for k in ("gather_blocks", "scatter_blocks",
                                                  "copy_blocks"))


class _Info:
    """What every gather / scatter launch of one cache on one device reads: its table's address,
    the bytes of one layer's table entries, the alignment of its bases and block bytes, its
    plans and the device's error record."""

    __slots__ = ("table", "layer_bytes", "align", "plans", "errors", "ready")

    def __init__(self, cache, device: torch.device) -> None:
        table, base_align = device_table(cache, device)
        self.table = table.data_ptr()
        self.layer_bytes = cache.spec.tensors_per_layer * 8
        self.align = alignment(base_align, cache.spec.block_bytes, cache.spec.block_stride_bytes)
        self.plans: dict = {}
        rec = record_for(device)
        self.errors, self.ready = rec.record_addr, rec.ready_addr


def _info(cache, device: torch.device) -> _Info:
    info = cache.backend_state.get(("triton", device))
    if info is None:
        info = cache.backend_state[("triton", device)] = _Info(cache, device)
    return info


def _new_plan(cache, device, align, layers, src_cache, dst_cache, src_i64, dst_i64, check, dup,
              max_ctas, **modes) -> "_launch.Plan":
    """A launch plan over ``layers`` layers of ``cache`` (see :class:`.launch.Plan`). Plans are
    kept in the destination's (gather: the source's) :class:`_Info`; they hold no address, so a
    peer cache never lives in one."""
    stride = cache.spec.block_stride_bytes  # copy_blocks: one spec on both sides
    return _launch.Plan(device=device, run_bytes=cache.spec.block_bytes, align=align,
                        num_tensors=layers * cache.spec.tensors_per_layer, src_cache=src_cache,
                        dst_cache=dst_cache, src_i64=src_i64, dst_i64=dst_i64, check=check,
                        dup=dup, max_ctas=max_ctas, src_stride=stride if src_cache else None,
                        dst_stride=stride if dst_cache else None, **modes)


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
