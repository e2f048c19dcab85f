"""An instance's memory budget (``--memory-budget-mb``, or on CUDA ``--gpu-memory-utilization``
of the free memory) and what to say when it is too small; testable without a GPU."""

from __future__ import annotations

import dataclasses
import math

from .startup import StartupError

CPU_DEFAULT_MB = 512
GPU_DEFAULT_UTILIZATION = 0.9
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Bytes an instance may use, the flag and value that set them, and the CUDA device's free
    and total bytes when taken (None on CPU)."""

    bytes: int
    flag: str
    value: float
    device: str = "cpu"
    free_bytes: int | None = None
    total_bytes: int | None = None

    def describe(self) -> str:
        """E.g. ``"60.0 GiB (--gpu-memory-utilization 0.9 of 66.7 GiB free on cuda, 139.8 GiB
        in all)"``."""
        if self.flag == "--gpu-memory-utilization":
            return (f"{_size(self.bytes)} ({self.flag} {self.value:g} of {_size(self.free_bytes)} "
                    f"free on {self.device}, {_size(self.total_bytes)} in all)")
        return f"{_size(self.bytes)} ({self.flag} {self.value:g})"


def _size(n: int | None) -> str:
    """Bytes for a message, one decimal: KiB below 1 MiB, GiB from 1 GiB, else MiB."""
    if n is None:
        return "?"
    if n < MIB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MIB:.1f} MiB"


def check_budget_flags(device: str, memory_budget_mb: int | None,
                       gpu_memory_utilization: float | None) -> None:
    """:class:`StartupError` for ``--gpu-memory-utilization`` outside (0, 1], without ``--device
    cuda``, or with ``--memory-budget-mb``."""
    util = gpu_memory_utilization
    if util is None:
        return
    if not 0 < util <= 1:
        raise StartupError(f"--gpu-memory-utilization must be in (0, 1], got {util:g}")
    if device != "cuda":
        raise StartupError(f"--gpu-memory-utilization {util:g} needs --device cuda; on {device} "
                           f"the budget is --memory-budget-mb")
    if memory_budget_mb is not None:
        raise StartupError(f"give --memory-budget-mb ({memory_budget_mb}) or "
                           f"--gpu-memory-utilization ({util:g}), not both")


def memory_budget(device: str, memory_budget_mb: int | None = None,
                  gpu_memory_utilization: float | None = None,
                  mem_info: tuple[int, int] | None = None) -> MemoryBudget:
    """The budget of an instance on ``device`` from the flags; ``mem_info``: the CUDA device's
    ``(free, total)`` bytes (default: torch's). :class:`StartupError`: more MiB than are free."""
    if not str(device).startswith("cuda"):
        mb = memory_budget_mb or CPU_DEFAULT_MB
        return MemoryBudget(mb * MIB, "--memory-budget-mb", mb)
    if mem_info is None:
        import torch
        mem_info = torch.cuda.mem_get_info(torch.device(device))
    free, total = mem_info
    if memory_budget_mb is not None:
        if memory_budget_mb * MIB > free:
            raise StartupError(f"--memory-budget-mb {memory_budget_mb} is more than the "
                               f"{free // MIB} MiB free on {device} ({total // MIB} MiB in all); "
                               f"lower it, or leave it out to take --gpu-memory-utilization "
                               f"(default {GPU_DEFAULT_UTILIZATION}) of the free memory")
        return MemoryBudget(memory_budget_mb * MIB, "--memory-budget-mb", memory_budget_mb,
                            str(device), free, total)
    util = GPU_DEFAULT_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    return MemoryBudget(int(util * free), "--gpu-memory-utilization", util, str(device), free, total)


def too_small_message(budget: MemoryBudget, err, model: str) -> str:
    """One line for a :class:`~kvflow.engine.MemoryBudgetError`: what the smallest budget
    needs, and the flag value that gives it."""
    parts = (f"weights {_size(err.weights)} + peak activations {_size(err.peak)} at "
             f"--max-num-batched-tokens {err.tokens} + one KV block {_size(err.block_bytes)} "
             f"= {_size(err.needed)}")
    if err.budget >= err.needed:  # the budget fits; the GPU's free memory after the run does not
        return (f"{budget.device} has {_size(err.free_after)} free after the weights and the "
                f"profile run of {model}, less than one KV block ({_size(err.block_bytes)}); "
                f"free GPU memory or lower --max-num-batched-tokens")
    if budget.flag == "--memory-budget-mb":
        need_mb = math.ceil(err.needed / MIB)
        fix = f"raise --memory-budget-mb to at least {need_mb}"
        if budget.free_bytes is not None and need_mb * MIB > budget.free_bytes:
            fix = (f"only {_size(budget.free_bytes)} is free on {budget.device}: free GPU memory "
                   f"or lower --max-num-batched-tokens")
        return f"--memory-budget-mb {budget.value:g} is too small for {model}: {parts}; {fix}"
    free = budget.free_bytes
    need_util = math.ceil(err.needed / free * 100) / 100 if free else math.inf
    if need_util > 1:
        fix = (f"only {_size(free)} of {_size(budget.total_bytes)} is free on {budget.device}: "
               f"free GPU memory or lower --max-num-batched-tokens")
    else:
        fix = f"raise --gpu-memory-utilization to at least {need_util:g}"
    return (f"--gpu-memory-utilization {budget.value:g} of the {_size(free)} free on "
            f"{budget.device} ({_size(budget.bytes)}) is too small for {model}: {parts}; {fix}")
