"""Which descriptors a ``nixl`` WRITE names: pure functions over block ids (no NIXL needed).
Descriptor ``t * num_blocks + b`` is block ``b`` of tensor ``t``
(:func:`~kvflow.connector.transport.nixl_agent.block_descs`); NIXL merges neighbours adjacent
on both sides, so a WRITE moves one descriptor per :func:`coalesce` run per tensor.
"""

from __future__ import annotations

from typing import Sequence

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

