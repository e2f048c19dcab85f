"""Which descriptors a ``nixl`` WRITE names: pure functions over block ids (no NIXL needed).

Layer-major caches (NHD, HND, ...): descriptor ``t * num_blocks + b`` is block ``b`` of tensor
``t`` (:func:`block_descs`), so a WRITE of ``n`` blocks
of ``k`` tensors names ``n * k`` descriptors; NIXL merges neighbours adjacent on both sides
(one per :func:`coalesce` run per tensor). Block-major caches (``BM_NHD``): one descriptor per
(layer group, block) covering the group's layers of that block (:class:`DescPlan`), so a WRITE
of every layer names one descriptor per block (vLLM's cross-layer blocks: the same idea).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive pairs of ``src_ids`` and ``dst_ids`` (paired block ids), in input
    order: ``(src_start, dst_start, length)`` such that pairs ``(src_start + k, dst_start + k)``
    for ``k < length`` are consecutive entries. ValueError when the lengths differ.

    Examples
    --------
    >>> coalesce([4, 5, 6, 9], [0, 1, 7, 8])
    [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"src_ids has {len(src_ids)} ids and dst_ids {len(dst_ids)}; they "
                         f"must pair one to one")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        s, d = int(s), int(d)
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def desc_indices(ids: Sequence[int], tensors: range, num_blocks: int) -> np.ndarray:
    """Descriptor indices of blocks ``ids`` of every tensor in ``tensors`` (tensor-major:
    ``[t0's ids..., t1's ids..., ...]``), int32, for a cache of ``num_blocks`` blocks.

    Examples
    --------
    >>> desc_indices([3, 4], range(2, 4), 10).tolist()
    [23, 24, 33, 34]
    """
    ids = np.asarray(ids, dtype=np.int64)
    t = np.arange(tensors.start, tensors.stop, dtype=np.int64)[:, None]
    return (t * num_blocks + ids[None, :]).reshape(-1).astype(np.int32)


def block_descs(base: int, num_tensors: int, num_blocks: int, block_bytes: int,
                device_id: int = 0) -> np.ndarray:
    """Descriptors ``(address, bytes, device_id)``, uint64 ``[num_tensors * num_blocks, 3]``,
    of a :class:`~kvflow.cache.PagedKVCache` laid out from ``base``: row ``t * num_blocks + b``
    is block ``b`` of tensor ``t`` (``device_id``: 0 on the host, else the CUDA ordinal)."""
    offs = np.arange(num_tensors * num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    out = np.zeros((offs.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + offs
    out[:, 1] = block_bytes
    out[:, 2] = device_id
    return out


def layer_groups(num_layers: int, layers_per_copy: int) -> tuple[tuple[int, int], ...]:
    """The layer ranges ``[lo, hi)`` a WRITE may cover: each group of ``layers_per_copy`` layers
    (the last one shorter), then every layer ``(0, num_layers)`` (unless that is one group).

    Examples
    --------
    >>> layer_groups(6, 4)
    ((0, 4), (4, 6), (0, 6))
    """
    groups = tuple((lo, min(lo + layers_per_copy, num_layers))
                   for lo in range(0, num_layers, layers_per_copy))
    return groups if groups[-1] == (0, num_layers) else groups + ((0, num_layers),)


class DescPlan:
    """The descriptor list of one cache (``spec``, ``num_blocks``) and the indices a WRITE of
    some blocks and layers names in it. ``layers_per_copy``: the layer groups of layerwise
    WRITEs (block-major caches only; :func:`layer_groups`).

    Layer-major: rows ``t * num_blocks + b``, ``block_bytes`` each. Block-major: rows
    ``g * num_blocks + b``, group ``g``'s layers of block ``b`` (``(hi - lo) *
    tensors_per_layer * block_bytes`` contiguous bytes at ``b * bytes_per_block + lo *
    tensors_per_layer * block_bytes``).
    """

    def __init__(self, spec: Any, num_blocks: int, layers_per_copy: int) -> None:
        self.spec, self.num_blocks = spec, num_blocks
        self.groups = (layer_groups(spec.num_layers, layers_per_copy) if spec.block_major
                       else ())

    def rows(self, base: int, device_id: int = 0) -> np.ndarray:
        """Descriptors ``(address, bytes, device_id)``, uint64, of the cache at ``base``."""
        spec, n = self.spec, self.num_blocks
        if not spec.block_major:
            return block_descs(base, spec.num_tensors, n, spec.block_bytes, device_id)
        per_layer = spec.tensors_per_layer * spec.block_bytes
        blocks = np.arange(n, dtype=np.uint64) * np.uint64(spec.bytes_per_block)
        offs = np.concatenate([blocks + np.uint64(lo * per_layer) for lo, _ in self.groups])
        sizes = np.concatenate([np.full(n, (hi - lo) * per_layer, dtype=np.uint64)
                                for lo, hi in self.groups])
        out = np.zeros((offs.size, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(base) + offs
        out[:, 1] = sizes
        out[:, 2] = device_id
        return out

    def indices(self, ids: Sequence[int], layers: range) -> np.ndarray:
        """int32 indices of blocks ``ids``, layers ``layers``, into :meth:`rows` (layer-major:
        tensor-major, :func:`desc_indices`). ValueError for a block-major ``layers`` that is
        not one of ``groups``."""
        spec = self.spec
        if not spec.block_major:
            tpl = spec.tensors_per_layer
            return desc_indices(ids, range(layers.start * tpl, layers.stop * tpl),
                                self.num_blocks)
        key = (layers.start, layers.stop)
        if key not in self.groups:
            raise ValueError(f"layers [{layers.start}, {layers.stop}) are not a layer group of "
                             f"this block-major descriptor list (groups {list(self.groups)})")
        g = self.groups.index(key)
        return (g * self.num_blocks + np.asarray(ids, dtype=np.int64)).astype(np.int32)
