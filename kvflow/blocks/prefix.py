"""Prefix cache of one instance (used on D): full blocks of token ids -> physical block ids.

A *full* block ``i`` of a prompt (tokens ``i*block_size .. (i+1)*block_size - 1``) is keyed by a
chained hash: ``key_i = blake2b(key_{i-1} || tokens of block i)`` with ``key_{-1}`` empty, so a
key names the whole prefix up to and including block ``i`` (the block-hash chain of vLLM's
automatic prefix caching). A partial last block is never cached: decode writes into it.

Reference counts live in the :class:`~kvflow.blocks.BlockAllocator`: the cache holds one
reference on every block it maps; each request that uses a cached block adds one
(:meth:`PrefixCache.match`) and drops it by freeing its block table as usual. A block held
only by the cache (count 1) is *evictable*: :meth:`PrefixCache.evict` frees such blocks,
least recently used first, when the allocator runs short. Blocks are inserted only once their
KV is in the cache (after the transfer), so a hit never reads a block still in flight.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Sequence

from .allocator import BlockAllocator


def block_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` (16-byte blake2b digests).

    Raises
    ------
    ValueError
        If ``block_size`` is not a positive int.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    keys, prev = [], b""
    for i in range(len(token_ids) // block_size):
        chunk = token_ids[i * block_size:(i + 1) * block_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{block_size}q", *chunk),
                               digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Map from chained block keys to block ids of ``allocator``'s cache.

    Parameters
    ----------
    allocator : BlockAllocator
        The instance's allocator; the cache takes and drops references through it.
    block_size : int
        Tokens per block.

    Examples
    --------
    >>> a = BlockAllocator(8); pc = PrefixCache(a, block_size=2)
    >>> table = a.allocate(3)                    # a 5-token prompt: 2 full blocks + 1 partial
    >>> pc.insert([1, 2, 3, 4, 5], table)        # caches the 2 full blocks
    2
    >>> pc.match([1, 2, 3, 4, 9, 9])             # a new request shares logical blocks 0-1
    [0, 1]
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        block_keys([], block_size)  # validates block_size
        self.allocator, self.block_size = allocator, block_size
        self._blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU order
        self._ids: set[int] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request uses (reference count 1: only the cache's)."""
        return sum(1 for b in self._blocks.values() if self.allocator.ref_count(b) == 1)

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` (logical blocks 0..k-1), at
        most ``max_blocks``; each returned block gets one more reference (the caller's), which
        the caller drops with ``allocator.free`` like any block of its table."""
        out = []
        for key in block_keys(token_ids, self.block_size)[:max_blocks]:
            b = self._blocks.get(key)
            if b is None:
                break
            self._blocks.move_to_end(key)
            out.append(b)
        if out:
            self.allocator.incref(out)
        return out

    def insert(self, token_ids: Sequence[int], block_table: Sequence[int]) -> int:
        """Cache the full blocks of ``token_ids`` held at ``block_table`` (logical order; their
        KV must already be in the cache). Keys already cached keep their block. Returns how
        many blocks were newly cached.

        Raises
        ------
        ValueError
            If ``block_table`` is shorter than the full blocks of ``token_ids``.
        """
        keys = block_keys(token_ids, self.block_size)
        if len(block_table) < len(keys):
            raise ValueError(f"block_table has {len(block_table)} blocks; the {len(token_ids)} "
                             f"tokens fill {len(keys)} blocks of {self.block_size}")
        new = []
        for key, b in zip(keys, block_table):
            if key in self._blocks:
                self._blocks.move_to_end(key)
            elif b not in self._ids:
                self._blocks[key] = b
                self._ids.add(b)
                new.append(b)
        if new:
            self.allocator.incref(new)
        return len(new)

    def evict(self, n: int) -> int:
        """Free up to ``n`` evictable blocks, least recently used first; returns how many."""
        freed = []
        for key, b in list(self._blocks.items()):
            if len(freed) >= n:
                break
            if self.allocator.ref_count(b) == 1:
                del self._blocks[key]
                self._ids.discard(b)
                freed.append(b)
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def clear(self) -> int:
        """Drop every block no request uses; returns how many were freed."""
        return self.evict(len(self._blocks))
