"""The paged KV cache of one instance, and the staging buffer that gathered blocks land in.

Order of ``PagedKVCache.tensors()`` (fixed, relied on by every backend; where each lies in
memory is the spec's ``tensor_offset`` / ``block_stride_bytes``, see :mod:`kvflow.layout`):
``[layer 0 K, layer 0 V, layer 1 K, layer 1 V, ...]`` for NHD/HND and
``[layer 0 latent, layer 1 latent, ...]`` for MLA, i.e. tensor ``i`` is layer
``i // spec.tensors_per_layer``, quantity ``i % spec.tensors_per_layer``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .dlpack import to_torch
from .layout import KVCacheSpec, _positive_int, normalize_layers
from .scales import (SCALES_ALIGN, check_scales, scales_offset, scales_shape, shared_nbytes,
                     shared_parts)


class PagedKVCache:
    """Every per-layer tensor of one instance's paged KV cache.

    Parameters
    ----------
    spec : KVCacheSpec
        Geometry, dtype and layout.
    num_blocks : int
        Physical blocks per tensor.
    device : str or torch.device, default "cpu"
        Where to allocate (ignored when ``buffer`` is given).
    buffer : torch.Tensor, optional
        A flat ``uint8`` tensor of at least ``spec.num_tensors * num_blocks * spec.block_bytes``
        bytes to lay the cache over (e.g. a shared-memory mapping); by default one zeroed
        allocation is made. The tensors are consecutive views of it, in ``tensors()`` order.
    scales_in_buffer : bool, default False
        fp8 only (ignored otherwise): the scales are a float32 view of ``buffer`` at byte
        :func:`~kvflow.scales.scales_offset` (after the blocks, 16-byte aligned), so every
        process that maps the buffer shares them; ``buffer`` must then hold
        :func:`~kvflow.scales.shared_nbytes` bytes and start at a 16-byte aligned address.
        Scales in a given ``buffer`` are taken as they are (its creator sets them to 1.0);
        a new allocation gets 1.0. By default the scales are a separate allocation.

    Attributes
    ----------
    spec, num_blocks, device, buffer (the flat uint8 allocation, or None for
    :meth:`from_tensors`), scales (fp8 caches: float32 dequantization scales, all 1.0 at
    first, see :mod:`kvflow.scales`; None for other dtypes; part of ``buffer`` only with
    ``scales_in_buffer``),
    backend_state (per-backend data built once per cache, e.g. a device-side table of
    per-layer base addresses).

    Raises
    ------
    TypeError, ValueError
        If ``num_blocks`` is not a positive int, or ``buffer`` is not a large enough flat
        contiguous uint8 tensor starting at an address aligned to ``spec.dtype`` (to 16 bytes
        for fp8 scales in it); the size message names both sizes.

    Examples
    --------
    >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=16,
    ...                    dtype=torch.float16, layout="NHD")
    >>> cache = PagedKVCache(spec, num_blocks=8)
    >>> [tuple(t.shape) for t in cache.tensors()][:2]
    [(8, 16, 2, 4), (8, 16, 2, 4)]
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: Any = "cpu", *,
                 buffer: torch.Tensor | None = None, scales_in_buffer: bool = False) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        _positive_int("num_blocks", num_blocks)  # TypeError for a non-int, ValueError if <= 0
        self.spec = spec
        self.num_blocks = num_blocks
        per_tensor = num_blocks * spec.block_bytes
        inline = scales_in_buffer and spec.is_fp8
        need = shared_nbytes(spec, num_blocks) if inline else per_tensor * spec.num_tensors
        new = buffer is None
        if need >= 2 ** 63:
            raise ValueError(f"num_blocks={num_blocks} makes a cache of {need} bytes, more than "
                             f"a tensor can hold (2**63 - 1)")
        if buffer is None:
            try:
                buffer = torch.zeros(need, dtype=torch.uint8, device=device)
            except (AssertionError, RuntimeError) as exc:  # e.g. device="cuda" without CUDA
                raise RuntimeError(f"cannot allocate {need} bytes on device={device!r}: {exc}") from exc
        elif not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 \
                or buffer.dim() != 1 or not buffer.is_contiguous():
            raise TypeError(f"buffer must be a flat contiguous uint8 tensor, got "
                            f"{getattr(buffer, 'dtype', type(buffer))} of shape "
                            f"{tuple(getattr(buffer, 'shape', ()))}")
        elif buffer.numel() < need:
            raise ValueError(f"buffer holds {buffer.numel()} bytes; the cache needs {need}"
                             + (shared_parts(spec, num_blocks) if inline else ""))
        align = SCALES_ALIGN if inline else spec.itemsize
        if buffer.data_ptr() % align:
            raise ValueError(f"buffer starts at address {buffer.data_ptr():#x}, not a multiple of "
                             f"{align} bytes ("
                             + ("fp8 scales in the buffer" if inline else str(spec.dtype))
                             + "); lay the cache over an aligned slice")
        self.buffer = buffer
        self._tensors = tensor_views(buffer[:per_tensor * spec.num_tensors], spec, num_blocks)
        self.device = buffer.device
        if inline:
            off = scales_offset(spec, num_blocks)
            self.scales = buffer[off:need].view(torch.float32).view(scales_shape(spec, num_blocks))
            if new:
                self.scales.fill_(1.0)
        else:
            self.scales = check_scales("scales", None, spec, num_blocks, self.device)
        self.backend_state: dict[str, Any] = {}

    @classmethod
    def from_tensors(cls, spec: KVCacheSpec, tensors: Sequence[torch.Tensor], *,
                     scales: torch.Tensor | None = None) -> "PagedKVCache":
        """Wrap existing per-layer tensors (e.g. an engine's own cache) without copying.

        ``tensors`` must be in :meth:`tensors` order, each contiguous, of ``spec.dtype`` and
        shape ``spec.tensor_shape(num_blocks)``, all on one device. Paddle (or any DLPack)
        tensors are taken zero-copy through DLPack.

        Raises
        ------
        ValueError, TypeError
            Naming the offending ``tensors[i]`` and what was expected (also for a tensor
            that requires grad), or no blocks at all.
        """
        tensors = [to_torch(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        if len(tensors) != spec.num_tensors:
            raise ValueError(f"tensors has {len(tensors)} entries; spec needs {spec.num_tensors} "
                             f"({spec.num_layers} layers x {spec.tensors_per_layer})")
        num_blocks = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
        expect = spec.tensor_shape(num_blocks)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != spec.dtype:
                raise TypeError(f"tensors[{i}].dtype is {t.dtype}; spec.dtype is {spec.dtype}")
            if tuple(t.shape) != expect:
                raise ValueError(f"tensors[{i}].shape is {tuple(t.shape)}; expected {expect}")
            if spec.block_major:
                want = tensors[0].data_ptr() + spec.tensor_offset(i, num_blocks)
                if t.stride() != spec.tensor_strides() or t.data_ptr() != want:
                    raise ValueError(f"tensors[{i}] must be view {i} of one block-major memory "
                                     f"(tensor_views): strides {spec.tensor_strides()} at "
                                     f"address {want:#x}, got strides {t.stride()} at "
                                     f"{t.data_ptr():#x}")
            elif not t.is_contiguous():
                raise ValueError(f"tensors[{i}] must be contiguous, got strides {t.stride()}")
            if t.device != tensors[0].device:
                raise ValueError(f"tensors[{i}] is on {t.device}; tensors[0] is on {tensors[0].device}")
            if t.requires_grad:
                raise ValueError(f"tensors[{i}] requires grad; a KV cache is written in place "
                                 f"outside autograd (pass tensors[{i}].detach())")
        if num_blocks == 0:
            raise ValueError(f"tensors hold 0 blocks (tensors[0].shape is "
                             f"{tuple(tensors[0].shape)}); num_blocks must be positive")
        self = cls.__new__(cls)
        self.spec, self.num_blocks, self.buffer = spec, num_blocks, None
        self._tensors = tensors
        self.device = tensors[0].device
        self.scales = check_scales("scales", scales, spec, num_blocks, self.device)
        self.backend_state = {}
        return self

    def memory_span(self) -> tuple[int, int, tuple[int, ...], Any, Any]:
        """The cache's memory, computed once (the tensors of a cache never move):
        ``(lowest address, highest end, every tensor's base address in tensors() order,
        interval starts sorted, running maximum of their ends)`` (the last two numpy int64
        arrays, for :func:`memory_relation`)."""
        span = self.backend_state.get("memory_span")
        if span is None:
            ptrs = tuple(t.data_ptr() for t in self._tensors)
            ends = [p + span_bytes(t) for p, t in zip(ptrs, self._tensors)]
            order = sorted(range(len(ptrs)), key=ptrs.__getitem__)
            starts = np.array([ptrs[i] for i in order], dtype=np.uint64)
            reach = np.maximum.accumulate(np.array([ends[i] for i in order], dtype=np.uint64))
            span = self.backend_state["memory_span"] = (min(ptrs), max(ends), ptrs, starts, reach)
        return span

    def tensors(self) -> list[torch.Tensor]:
        """Every per-layer tensor, in the order of the module docstring."""
        return list(self._tensors)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The tensors of one layer: ``(K, V)`` or ``(latent,)``."""
        t = self.spec.tensors_per_layer
        return tuple(self._tensors[layer * t:(layer + 1) * t])

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return self.num_blocks * self.spec.bytes_per_block

    def ptr_table(self) -> torch.Tensor:
        """int64 tensor (on the cache's device) of each tensor's base address, in
        ``tensors()`` order; built once and kept in ``backend_state``."""
        table = self.backend_state.get("ptr_table")
        if table is None:
            table = torch.tensor([t.data_ptr() for t in self._tensors], dtype=torch.int64)
            table = table.to(self.device)
            self.backend_state["ptr_table"] = table
        return table

    def __repr__(self) -> str:
        return f"PagedKVCache({self.spec}, num_blocks={self.num_blocks}, device={self.device})"


def tensor_views(buffer: torch.Tensor, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
    """The per-layer tensors of a cache laid over the flat uint8 ``buffer`` (``nbytes``
    of the cache exactly), in ``tensors()`` order: tensor ``i`` of
    ``spec.tensor_shape(num_blocks)`` at byte ``spec.tensor_offset(i, num_blocks)`` with
    ``spec.tensor_strides()`` (contiguous for layer-major layouts, strided views of one
    block-major memory for ``BM_NHD``)."""
    flat = buffer.view(spec.dtype)
    shape, strides, base = spec.tensor_shape(num_blocks), spec.tensor_strides(), flat.storage_offset()
    return [flat.as_strided(shape, strides, base + spec.tensor_offset(i, num_blocks) // spec.itemsize)
            for i in range(spec.num_tensors)]


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (its memory span; ``nbytes``
    for a contiguous tensor, more for a strided view)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def memory_relation(a: PagedKVCache, b: PagedKVCache) -> str:
    """``"same"`` (one cache, or two objects over the same tensors at the same addresses),
    ``"overlapping"`` (any byte of one lies in the other otherwise) or ``"disjoint"``.

    Exact for caches of separately allocated tensors (``from_tensors``) whose address ranges
    interleave. Addresses are compared within this process (CUDA's unified addressing makes
    GPU addresses unique across devices); two mappings of one shared-memory segment at
    different addresses look disjoint."""
    if a is b:
        return "same"
    lo_a, hi_a, ptrs_a, _, _ = a.memory_span()
    lo_b, hi_b, ptrs_b, _, _ = b.memory_span()
    if hi_a <= lo_b or hi_b <= lo_a:
        return "disjoint"
    if ptrs_a == ptrs_b and a.num_blocks == b.num_blocks and a.spec == b.spec:
        return "same"
    return "overlapping" if any(overlaps(a, t) for t in b.tensors()) else "disjoint"


def overlaps(cache: PagedKVCache, t: torch.Tensor) -> bool:
    """True when any byte of ``t``'s span (``data_ptr`` .. + ``numel * element_size``) lies in
    ``cache``'s memory."""
    lo, hi, _, starts, reach = cache.memory_span()
    p = t.data_ptr()
    end = p + span_bytes(t)
    if end <= lo or hi <= p or end == p:
        return False
    # the last tensor of the cache starting before t's end; overlap if any up to it reaches t
    i = int(np.searchsorted(starts, np.uint64(end))) - 1
    return i >= 0 and int(reach[i]) > p


def staging_shape(spec: KVCacheSpec, num_blocks: int, layers: Any = None) -> tuple[int, ...]:
    """Shape of the staging buffer for ``num_blocks`` blocks of a layer range:
    ``[num_layers_in_range, spec.tensors_per_layer, num_blocks, *spec.block_shape]``.

    Element ``[l, t, i]`` is block ``block_ids[i]`` of tensor ``t`` (K=0, V=1, or the MLA latent)
    of layer ``layers.start + l``; each ``[l]`` (one layer) is contiguous.
    """
    start, stop = normalize_layers(layers, spec.num_layers)
    return (stop - start, spec.tensors_per_layer, num_blocks, *spec.block_shape)


def staging_buffer(spec: KVCacheSpec, num_blocks: int, layers: Any = None,
                   device: Any = "cpu", *, pin_memory: bool = False) -> torch.Tensor:
    """Allocate an (uninitialised) staging buffer of :func:`staging_shape` and ``spec.dtype``.

    Parameters
    ----------
    spec, num_blocks, layers
        As :func:`staging_shape`.
    device : str or torch.device
        Where to allocate.
    pin_memory : bool
        Page-locked host memory (for asynchronous host<->device copies); CPU only.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
    shape = staging_shape(spec, num_blocks, layers)
    return torch.empty(shape, dtype=spec.dtype, device=device, pin_memory=pin_memory)
