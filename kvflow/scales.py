"""Dequantization scales of an fp8 paged KV cache, held by the cache beside its blocks.

An fp8 element ``q`` of a cache stands for the real value ``q * scale`` (float32), the
convention of vLLM's ``k_scale`` / ``v_scale``. ``KVCacheSpec.scales`` says how many scales
the cache holds; ``PagedKVCache.scales`` is one float32 tensor on the cache's device:

==============  ===========================================  ==============================
``scales``      ``PagedKVCache.scales`` shape                element ``q`` of tensor ``j``,
                                                             block ``b``, head ``h`` scaled by
==============  ===========================================  ==============================
``"tensor"``    ``[num_tensors]``                            ``scales[j]``
``"block_head"`` ``[num_tensors, num_blocks, num_kv_heads]``   ``scales[j, b, h]``
==============  ===========================================  ==============================

``j`` is the index in ``PagedKVCache.tensors()`` order (layer ``j // tensors_per_layer``, K/V
``j % tensors_per_layer``). A new cache's scales are all 1.0. Per-tensor scales are set by
their owner (calibration, a checkpoint's ``k_scale``) and only read by the ops; per-block
per-head scales are written by the ops that write the block (:mod:`kvflow.kernels.reblock`).
Caches of other dtypes hold no scales (``None``).

A cache that another process maps (ipc-pull's P, ipc-push's D:
:mod:`kvflow.connector.transport.shm`, :mod:`kvflow.connector.transport.cuda_ipc`) keeps its
scales in the same memory as its blocks, right after them at :func:`scales_offset` (16-byte
aligned), :func:`shared_nbytes` bytes in all (``PagedKVCache(..., scales_in_buffer=True)``): the
exporter and every mapping read and write one scales tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .layout import KVCacheSpec


def scales_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...] | None:
    """Shape of the float32 scales of a cache (see the module docstring); None when
    ``spec.dtype`` is not fp8."""
    if not spec.is_fp8:
        return None
    if spec.scales == "tensor":
        return (spec.num_tensors,)
    return (spec.num_tensors, num_blocks, spec.num_kv_heads)


#: Alignment in bytes of the scales that follow the blocks in a shared cache's memory.
SCALES_ALIGN = 16


def scales_offset(spec: KVCacheSpec, num_blocks: int) -> int:
    """Byte offset of the scales in a shared cache's memory: the blocks' bytes
    (``num_blocks * spec.bytes_per_block``) rounded up to :data:`SCALES_ALIGN`."""
    return -(-num_blocks * spec.bytes_per_block // SCALES_ALIGN) * SCALES_ALIGN


def shared_nbytes(spec: KVCacheSpec, num_blocks: int) -> int:
    """Bytes of a shared cache's memory: the blocks, then (fp8 only) the float32 scales at
    :func:`scales_offset`; ``num_blocks * spec.bytes_per_block`` for other dtypes."""
    shape = scales_shape(spec, num_blocks)
    if shape is None:
        return num_blocks * spec.bytes_per_block
    return scales_offset(spec, num_blocks) + 4 * math.prod(shape)


def shared_parts(spec: KVCacheSpec, num_blocks: int) -> str:
    """What :func:`shared_nbytes` counts, for error messages: ``""`` without scales, else
    ``" (B bytes of blocks, then S bytes of float32 scales at byte O)"``."""
    if not spec.is_fp8:
        return ""
    off = scales_offset(spec, num_blocks)
    return (f" ({num_blocks * spec.bytes_per_block} bytes of blocks, then "
            f"{shared_nbytes(spec, num_blocks) - off} bytes of float32 scales at byte {off})")


def new_scales(spec: KVCacheSpec, num_blocks: int, device: Any) -> torch.Tensor | None:
    """All-ones float32 scales of :func:`scales_shape` on ``device`` (None: no fp8)."""
    shape = scales_shape(spec, num_blocks)
    return None if shape is None else torch.ones(shape, dtype=torch.float32, device=device)


def check_scales(name: str, scales: Any, spec: KVCacheSpec, num_blocks: int,
                 device: torch.device) -> torch.Tensor | None:
    """``scales`` if it fits a cache of ``spec`` and ``num_blocks`` on ``device`` (contiguous
    float32 of :func:`scales_shape`; None for a dtype that is not fp8), else new ones when
    ``scales`` is None.

    Raises
    ------
    TypeError, ValueError
        Naming ``name`` and what was expected.
    """
    shape = scales_shape(spec, num_blocks)
    if scales is None:
        return new_scales(spec, num_blocks, device)
    if shape is None:
        raise ValueError(f"{name} given for a cache of dtype {spec.dtype}, which holds no "
                         f"scales (only fp8 caches do)")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 torch.Tensor, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    if tuple(scales.shape) != shape:
        raise ValueError(f"{name}.shape is {tuple(scales.shape)}; expected {shape} "
                         f"(scales={spec.scales!r})")
    if scales.device != device or not scales.is_contiguous():
        raise ValueError(f"{name} must be contiguous on {device}, got {scales.device} with "
                         f"strides {scales.stride()}")
    return scales
