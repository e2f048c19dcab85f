"""The torch backend: the obviously-correct reference for every op.

Per layer and tensor: ``index_select`` of the valid source blocks, then ``index_copy_`` into
the valid destination slots, which is also what a user would write by hand (the baseline of the
benchmarks). Padding (-1) is removed with one boolean mask per call, which costs one host
synchronisation on a GPU; the reference is about being right, not fast.
"""

from __future__ import annotations

import torch

from .registry import register_backend


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as uint8 when its dtype is a one-byte float (same bytes, same shape)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _valid_pairs(src_ids: torch.Tensor, dst_ids: torch.Tensor, src_n: int, dst_n: int):
    keep = (src_ids >= 0) & (src_ids < src_n) & (dst_ids >= 0) & (dst_ids < dst_n)
    return src_ids[keep].long(), dst_ids[keep].long()


class TorchBackend:
    name = "torch"
    devices = {"cpu", "cuda"}
    block_strides = True  # block-major caches: per-layer strided views

    def unavailable_reason(self):
        return None

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        n = ids.numel()
        slots = torch.arange(n, device=ids.device)
        src, dst = _valid_pairs(ids, slots, cache.num_blocks, n)
        T = cache.spec.tensors_per_layer
        tensors, out = [_bytes_if_fp8(t) for t in cache.tensors()], _bytes_if_fp8(out)
        for j in range(T * (stop - start)):
            out[j // T, j % T].index_copy_(0, dst, tensors[start * T + j].index_select(0, src))

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        n = ids.numel()
        slots = torch.arange(n, device=ids.device)
        s, d = _valid_pairs(slots, ids, n, cache.num_blocks)
        T = cache.spec.tensors_per_layer
        tensors, src = [_bytes_if_fp8(t) for t in cache.tensors()], _bytes_if_fp8(src)
        for j in range(T * (stop - start)):
            tensors[start * T + j].index_copy_(0, d, src[j // T, j % T].index_select(0, s))

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None):
        s, d = _valid_pairs(src_ids.to(dst_ids.device), dst_ids,
                            src_cache.num_blocks, dst_cache.num_blocks)
        s = s.to(src_cache.device)
        T = src_cache.spec.tensors_per_layer
        src_t = [_bytes_if_fp8(t) for t in src_cache.tensors()]
        dst_t = [_bytes_if_fp8(t) for t in dst_cache.tensors()]
        for j in range(start * T, stop * T):
            blocks = src_t[j].index_select(0, s)
            dst_t[j].index_copy_(0, d, blocks.to(dst_t[j].device, non_blocking=True))

    def reblock(self, job, max_ctas=None, check=False):
        """Copy between different specs (:mod:`kvflow.kernels.reference_reblock`)."""
        from .reference_reblock import reblock
        reblock(job)


register_backend(TorchBackend())