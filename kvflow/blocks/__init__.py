"""Scheduling pieces of one instance: the block allocator and the request lifecycle."""

from .allocator import BlockAllocator, NoFreeBlocksError
from .request import (AdmissionError, ColocatedState, DecodeState, IllegalTransitionError,
                      Request, admission_check, blocks_needed, is_terminal)

__all__ = ["BlockAllocator", "NoFreeBlocksError", "Request", "DecodeState",
           "ColocatedState", "AdmissionError", "IllegalTransitionError", "admission_check",
           "blocks_needed", "is_terminal"]
from .prefix import PrefixCache, block_keys  # noqa: E402

__all__ += ["PrefixCache", "block_keys"]
