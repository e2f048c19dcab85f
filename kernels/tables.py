"""Device-side base-address tables shared by the GPU backends (triton, numba_cuda).

A cache's table is the int64 tensor of its per-tensor base addresses (``PagedKVCache.ptr_table``
order) on the device that runs the kernel: built once per (cache, device) and kept in
``cache.backend_state["device_tables"]``, so a call never builds or copies it again
(docs/design.md, "Kernel rules"). On a peer GPU it is a copy of the cache's own table; the
addresses stay valid there under unified addressing.
"""

from __future__ import annotations

import torch


def alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (byte counts or addresses)."""
    x = 16
    for v in values:
        x |= v
    return x & -x


def device_table(cache, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(table, align)``: ``cache``'s base addresses as int64 on ``device`` and their common
    alignment in bytes (at most 16); built once per (cache, device)."""
    state = cache.backend_state.setdefault("device_tables", {})
    if device not in state:
        table = cache.ptr_table()
        state[device] = (table if table.device == device else table.to(device),
                         alignment(*(t.data_ptr() for t in cache.tensors())))
    return state[device]



class Stamps:
    """Per-block int32 stamps of one cache on one device, for the device-side repeat check.

    A call takes a new number (:meth:`next`); a destination block whose stamp already holds
    it was named twice in that call. Numbers run 1..2**31-1, then the array is cleared."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        self.array = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self.addr = self.array.data_ptr()
        self.call = 0

    def next(self) -> int:
        self.call += 1
        if self.call >= 2 ** 31:
            self.array.zero_()
            self.call = 1
        return self.call


def stamps(cache, device: torch.device) -> Stamps:
    """The :class:`Stamps` of ``cache`` on ``device``, made on first use."""
    state = cache.backend_state.setdefault("stamps", {})
    if device not in state:
        state[device] = Stamps(cache.num_blocks, device)
    return state[device]
