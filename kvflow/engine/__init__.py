"""The engine: a model over a paged KV cache (prefill, chunked prefill, batched decode),
sampling, and the profile run that sizes the cache."""

from .engine import Engine
from .profile import MemoryBudgetError, determine_num_blocks
from .sampling import sample

__all__ = ["Engine", "MemoryBudgetError", "determine_num_blocks", "sample"]
