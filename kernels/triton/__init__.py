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
"""

from __future__ import annotations

import os

import torch

from ..registry import register_backend

try:
    from . import copy_runs as _cr
    _IMPORT_ERROR = None
except ImportError as exc:  # triton missing or broken
    _cr = None
    _IMPORT_ERROR = str(exc)

DIRECTIONS = ("pull", "push")


class TritonBackend:
    """Backend object for :mod:`kvflow.kernels.registry` (see its contract)."""

    name = "triton"
    directions = DIRECTIONS

    @property
    def devices(self) -> set[str]:
        return {"cpu"} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"cuda"}

    def unavailable_reason(self) -> str | None:
        if _cr is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if "cpu" in self.devices or torch.cuda.is_available():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run on CPU tensors)"

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        T, bb = cache.spec.tensors_per_layer, cache.spec.block_bytes
        table, align = _cr.cache_table(cache, cache.device)
        _cr.launch(src_table=table[start * T:stop * T], dst_stage=out, src_ids=ids,
                   n=ids.numel(), num_tensors=(stop - start) * T, src_n=cache.num_blocks,
                   dst_n=ids.numel(), run_bytes=bb,
                   align=_cr.alignment(align, bb, out.data_ptr()),
                   device=cache.device, max_ctas=max_ctas)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        T, bb = cache.spec.tensors_per_layer, cache.spec.block_bytes
        table, align = _cr.cache_table(cache, cache.device)
        _cr.launch(src_stage=src, dst_table=table[start * T:stop * T], dst_ids=ids,
                   n=ids.numel(), num_tensors=(stop - start) * T, src_n=ids.numel(),
                   dst_n=cache.num_blocks, run_bytes=bb,
                   align=_cr.alignment(align, bb, src.data_ptr()),
                   device=cache.device, max_ctas=max_ctas)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             direction="pull"):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        dev = dst_cache.device if direction == "pull" else src_cache.device
        if src_cache.device != dst_cache.device and dev.type == "cuda":
            a, b = src_cache.device.index, dst_cache.device.index
            if not torch.cuda.can_device_access_peer(b if direction == "pull" else a,
                                                     a if direction == "pull" else b):
                raise RuntimeError(f"copy_blocks direction={direction!r} needs peer access "
                                   f"between {src_cache.device} and {dst_cache.device}")
        T, bb = src_cache.spec.tensors_per_layer, src_cache.spec.block_bytes
        s_table, s_align = _cr.cache_table(src_cache, dev)
        d_table, d_align = _cr.cache_table(dst_cache, dev)
        _cr.launch(src_table=s_table[start * T:stop * T], dst_table=d_table[start * T:stop * T],
                   src_ids=src_ids.to(dev, non_blocking=True),
                   dst_ids=dst_ids.to(dev, non_blocking=True), n=src_ids.numel(),
                   num_tensors=(stop - start) * T, src_n=src_cache.num_blocks,
                   dst_n=dst_cache.num_blocks, run_bytes=bb,
                   align=_cr.alignment(s_align, d_align, bb), device=dev, max_ctas=max_ctas)


register_backend(TritonBackend())
