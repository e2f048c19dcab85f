"""Profile run: size the KV cache from a memory budget and the peak activation memory of one
forward (measured by :mod:`kvflow.engine.memory`).

Formula (vLLM's, ``determine_num_available_blocks``, in bytes)::

    num_blocks = (memory_budget - weight_bytes - peak_activation_bytes) // spec.bytes_per_block

On CUDA the KV bytes are also capped by ``torch.cuda.mem_get_info()`` free bytes after the
profile run (memory other processes hold is not ours to take). On CPU there is no device
"free memory": the budget given is the memory the instance may use. The server's budget
(``--memory-budget-mb``, or on CUDA ``--gpu-memory-utilization`` x the GPU's free memory at
start) comes from :mod:`kvflow.serve.budget`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache

from .engine import Engine


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class MemoryBudgetError(ValueError):
    """The memory budget leaves no room for one KV block; the attributes give the parts (bytes).

    Attributes
    ----------
    budget, weights, peak, block_bytes : int
        The budget, the model's weights, the profile run's peak activations, one block.
    tokens : int
        The profile run's batch (``max_num_batched_tokens``).
    free_after : int or None
        CUDA: the device's free bytes after the profile run (the KV cache's other cap); None on CPU.
    """

    def __init__(self, message: str, *, budget: int, weights: int, peak: int, block_bytes: int,
                 tokens: int, free_after: int | None = None) -> None:
        super().__init__(message)
        self.budget, self.weights, self.peak, self.block_bytes = budget, weights, peak, block_bytes
        self.tokens, self.free_after = tokens, free_after

    @property
    def needed(self) -> int:
        """Bytes of the smallest budget that fits: weights + peak activations + one block."""
        return self.weights + self.peak + self.block_bytes


def determine_num_blocks(model, spec, *, memory_budget_bytes: int, max_num_batched_tokens: int,
                         device: Any = "cpu") -> int:
    """Size the paged KV cache by a profile run (see the module docstring for the formula).

    Builds a one-block scratch cache and an :class:`~kvflow.engine.Engine` over it, runs
    :meth:`~kvflow.engine.Engine.profile_run` (``is_dummy_or_profile_run`` set: nothing is set
    up, signalled or sent; the scratch block is not written), then applies the formula.

    Parameters
    ----------
    model : kvflow.model.LlamaForCausalLM
        On ``device``.
    spec : KVCacheSpec
        The cache's geometry (``model.kv_spec(block_size)``).
    memory_budget_bytes : int
        Bytes this instance may use for weights, activations and KV cache (e.g. 1 GiB for
        kvflow-tiny on CPU; on CUDA e.g. 0.9 x total device memory).
    max_num_batched_tokens : int
        Largest number of tokens one forward runs (the profile run's batch).
    device : str or torch.device

    Returns
    -------
    int
        ``num_blocks`` >= 1.

    Raises
    ------
    ValueError
        ``memory_budget_bytes`` not a positive int; :class:`MemoryBudgetError` (a ValueError)
        when it is too small for one block (the message and attributes give weights,
        activations, block bytes).
    """
    b = memory_budget_bytes
    if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive int, got {b!r}")
    device = torch.device(device)
    engine = Engine(model, PagedKVCache(spec, 1, device))
    peak = engine.profile_run(max_num_batched_tokens)
    weights = weight_bytes(model)
    kv_bytes = b - weights - peak
    free_after = None
    if device.type == "cuda":
        free_after = torch.cuda.mem_get_info(device)[0]
        kv_bytes = min(kv_bytes, free_after)
    num_blocks = kv_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise MemoryBudgetError(
            f"memory_budget_bytes={b} leaves {kv_bytes} bytes for the KV cache after weights "
            f"({weights} B) and peak activations ({peak} B at {max_num_batched_tokens} tokens); "
            f"one block needs {spec.bytes_per_block} B", budget=b, weights=weights, peak=peak,
            block_bytes=spec.bytes_per_block, tokens=max_num_batched_tokens, free_after=free_after)
    return int(num_blocks)
