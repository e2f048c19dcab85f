"""Peak memory of one call: what the profile run measures (:meth:`kvflow.engine.Engine.profile_run`).

CUDA: ``torch.cuda.max_memory_allocated`` above the allocation before the call. CPU: there is
no allocator statistic, so a ``TorchDispatchMode`` sums the bytes of the storages the call's ops
create while they are alive (no allocator rounding). The KV cache sizing that uses the figure
is :mod:`kvflow.engine.profile`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    """Counts bytes of storages created by ops (not views or in-place results of inputs) while
    they are alive; ``peak`` is the maximum of that sum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._seen:
                continue
            self._seen.add(key)
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._release, key, st.nbytes())
        return out

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)


def measure_peak_bytes(fn: Callable[[], Any], device: Any) -> int:
    """Run ``fn()`` and return the peak bytes of memory it allocated (its result dropped).

    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the call. CPU:
    the peak sum of live storages created by the ops of ``fn`` (a ``TorchDispatchMode``),
    which is what the allocator would have to hold, without allocator rounding.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with _LiveBytes() as mode:
        fn()
    return mode.peak
