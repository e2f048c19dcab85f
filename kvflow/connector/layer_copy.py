"""P's copies of a request's blocks into a peer's mapped cache (ipc-push), one launch per group
of ``layers_per_copy`` layers, ordered behind P's compute: on CUDA each waits on an event of the
compute stream and runs on a copy stream, capped at ``max_ctas`` while it overlaps compute (the
last group and the copy after the prefill take the whole GPU); on CPU each runs at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.kernels import copy_blocks

from .base import TransferError

#: Programs (CTAs) of a layerwise copy launched beside P's compute (``max_ctas``).
LAYERWISE_MAX_CTAS = 16
#: Layers per layerwise copy launch (``layers_per_copy``).
LAYERS_PER_COPY = 4


def block_pairs(blocks, dst_ids, first: int, stop: int, skip: int, p_blocks: int,
                d_blocks: int) -> tuple[list[int], list[int]] | None:
    """P's and D's ids of logical blocks ``[max(first, skip), stop)`` (None when empty);
    TransferError for an id outside its cache (``p_blocks`` / ``d_blocks``) or a repeated D id."""
    lo = max(first, skip)
    if lo >= stop:
        return None
    src, dst = list(blocks[lo:stop]), list(dst_ids[lo:stop])
    for name, ids, n in (("P's block table", src, p_blocks), ("decode_block_ids", dst, d_blocks)):
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise TransferError(f"{name} holds block {bad[0]}, not in [0, {n})")
    if len(set(dst)) != len(dst):
        raise TransferError(f"decode_block_ids repeats a block: {dst}")
    return src, dst


@dataclasses.dataclass
class PushStats:
    """One request's push as seen by P: ``blocks`` and ``payload_bytes`` written into D's cache,
    ``t_start`` (``time.time()`` of the first copy; 0: nothing moved), ``copy_ms`` (the copy calls;
    on CUDA, issuing them), ``exposed_ms`` (first token to every copy done), ``prefill_ms``,
    ``layerwise`` (copied during the prefill)."""

    blocks: int = 0
    payload_bytes: int = 0
    t_start: float = 0.0
    copy_ms: float = 0.0
    exposed_ms: float = 0.0
    prefill_ms: float = 0.0
    layerwise: bool = False
    pending: Any = dataclasses.field(default=None, repr=False)  # ids to copy after the prefill
    dst: Any = dataclasses.field(default=None, repr=False)      # the D cache written into


class LayerCopier:
    """Copies from P's ``cache`` into mapped peer caches (``backend``, ``max_ctas``,
    ``layers_per_copy``: as :class:`~kvflow.connector.ipc_push.PushSender`'s)."""

    def __init__(self, cache: PagedKVCache, backend: str, max_ctas: int,
                 layers_per_copy: int) -> None:
        self.cache, self.backend = cache, backend
        self.max_ctas, self.layers_per_copy = max_ctas, layers_per_copy
        self.cuda = cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self._events = ([torch.cuda.Event() for _ in range(cache.spec.num_layers)]
                        if self.cuda else [])
        self._keep: list = []
        self._pinned: torch.Tensor | None = None  # CUDA: reused pinned ids, [used:] free
        self._used = 0

    def start(self) -> None:
        """Order the copies after P's earlier writes into its blocks (other streams)."""
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))

    def pairs(self, blocks: list[int], dst_ids: list[int], first: int, stop: int, skip: int,
              peer: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`block_pairs` as two int64 tensors (the copies skip validation), on CUDA put
        on the device once through the copy stream."""
        ids = block_pairs(blocks, dst_ids, first, stop, skip, self.cache.num_blocks,
                          peer.num_blocks)
        if ids is None:
            return None
        if not self.cuda:
            return tuple(torch.tensor(x, dtype=torch.int64) for x in ids)
        n = len(ids[0])
        if self._pinned is None or self._used + 2 * n > self._pinned.numel():
            if self._pinned is not None:
                self._keep.append(self._pinned)  # copies in flight may read it: kept to finish()
            # one pinned allocation reused by every request (cudaHostAlloc per request cost
            # ~0.1 ms on an H200 host)
            self._pinned = torch.empty(max(4 * n, 4096), dtype=torch.int64, pin_memory=True)
            self._used = 0
        host = self._pinned[self._used:self._used + 2 * n]
        self._used += 2 * n  # reused only after finish(): the stream has read it by then
        host.numpy()[:n], host.numpy()[n:] = ids
        with torch.cuda.stream(self._stream):
            dev = host.to(self.cache.device, non_blocking=True)  # one H2D for both sides
        return dev[:n], dev[n:]

    def layer_hook(self, pairs, stats: PushStats, last_chunk: bool):
        """The engine's per-layer hook for one chunk: after each group of layers, copy that
        group of ``pairs`` into ``stats.dst`` (the last group of the ``last_chunk`` uncapped)."""
        L, G = self.cache.spec.num_layers, self.layers_per_copy

        def hook(layer: int) -> None:
            if (layer + 1) % G and layer != L - 1:
                return  # the group of layers is not complete yet
            if self.cuda:
                ev = self._events[layer]
                ev.record(torch.cuda.current_stream(self.cache.device))
                self._stream.wait_event(ev)
            final = last_chunk and layer == L - 1  # nothing left to overlap: the whole GPU
            self._copy(pairs, (layer - layer % G, layer + 1), None if final else self.max_ctas,
                       stats)
        return hook

    def _copy(self, pairs, layers, max_ctas, stats: PushStats) -> None:
        t0 = time.perf_counter()
        if not stats.t_start:
            stats.t_start = time.time()
        src, dst = pairs
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext():
            copy_blocks(self.cache, stats.dst, src, dst, layers, backend=self.backend,
                        max_ctas=max_ctas, validate=False)
        stats.copy_ms += (time.perf_counter() - t0) * 1e3

    def finish(self, stats: PushStats | None = None) -> None:
        """Issue the copy after the prefill (``stats.pending``, if any) and block until every
        copy issued so far is done; the time spent here is ``stats.exposed_ms``."""
        t0 = time.perf_counter()
        if stats is not None and stats.pending is not None:
            self.start()
            self._copy(stats.pending, None, None, stats)
            stats.pending = None
        if self._stream is not None:
            self._stream.synchronize()
        self._keep.clear()
        self._used = 0
        if stats is not None:
            stats.exposed_ms = (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        """Wait for every copy issued."""
        if self._stream is not None:
            self._stream.synchronize()
