"""Block allocator of one instance's paged KV cache: a free list with reference counts.

A block is free when its count is 0. ``allocate`` hands out blocks with count 1; ``incref``
shares a block (a prefix used by two requests); ``free`` drops one reference per id and
returns the block to the free list at 0. All methods take one lock, so the serving loop and
the transfer thread may call them concurrently.
"""

from __future__ import annotations

import collections
import threading
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when too few blocks are free."""


def _ids(ids: Iterable[int], n: int) -> list[int]:
    out = list(ids)
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"block id {i!r} is not in [0, {n})")
    return out


class BlockAllocator:
    """Free list and reference counts of ``num_blocks`` physical blocks.

    Parameters
    ----------
    num_blocks : int
        Physical blocks of the cache (ids ``0 .. num_blocks-1``).

    Raises
    ------
    ValueError
        If ``num_blocks`` is not a positive int.

    Examples
    --------
    >>> a = BlockAllocator(4)
    >>> a.allocate(3), a.num_free
    ([0, 1, 2], 1)
    >>> a.free([0, 1, 2]); a.num_free
    4
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = collections.deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with reference count >= 1."""
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (count 1 each), lowest-recently-freed first.

        Raises
        ------
        ValueError
            If ``n`` is not a non-negative int.
        NoFreeBlocksError
            If fewer than ``n`` blocks are free (message: requested and free counts); nothing
            is allocated.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        with self._lock:
            if n > len(self._free):
                raise NoFreeBlocksError(f"requested {n} blocks but only {len(self._free)} of "
                                        f"{self.num_blocks} are free")
            out = [self._free.popleft() for _ in range(n)]
            for i in out:
                self._refs[i] = 1
            return out

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference to each (allocated) block, e.g. a shared prefix block.

        Raises
        ------
        ValueError
            For an unknown id or a free block (named); no count changes.
        """
        ids = _ids(ids, self.num_blocks)
        with self._lock:
            for i in ids:
                if self._refs[i] == 0:
                    raise ValueError(f"block id {i} is free; incref needs an allocated block")
            for i in ids:
                self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose count reaches 0 returns to the free list.

        Raises
        ------
        ValueError
            For an unknown id, or a double free (more drops than references, counting repeats
            within ``ids``), naming the id; no count changes.
        """
        ids = _ids(ids, self.num_blocks)
        with self._lock:
            drops = collections.Counter(ids)
            for i, d in drops.items():
                if d > self._refs[i]:
                    raise ValueError(f"double free of block id {i}: {self._refs[i]} reference(s), "
                                     f"{d} free(s)")
            for i in ids:
                self._refs[i] -= 1
                if self._refs[i] == 0:
                    self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (0 = free)."""
        (i,) = _ids([block_id], self.num_blocks)
        return self._refs[i]

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"
