"""D's side of a layerwise transfer: put each :class:`~kvflow.connector.messages.KVLayer` part into D's
own blocks as it arrives, and check at the last part that every layer of every prompt block
came exactly once. Parts name logical prompt positions, mapped through D's own block table.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from kvflow.cache import PagedKVCache

from ..base import TransferError, TransferStats

#: ``move(header, frames, cache, dst_ids, layers) -> payload bytes``: the connector's copy of one
#: part into ``cache`` at D's ``dst_ids`` (checks its frames before writing anything).
MoveFn = Callable[[Any, list, PagedKVCache, list[int], range], int]


@dataclasses.dataclass
class _Assembly:
    seen: torch.Tensor  # bool [num_layers, prompt_blocks]
    payload_bytes: int = 0
    copy_ms: float = 0.0


class LayerParts:
    """Per-request bookkeeping of received layerwise parts (one per :class:`~kvflow.connector.base.KVReceiver`)."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Assembly] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def receive(self, header: Any, frames: list, cache: PagedKVCache, dst_ids: list[int],
                move: MoveFn) -> TransferStats | None:
        """Apply one ``KVLayer`` ``header`` with its raw ``frames`` (tcp: one per layer; ipc: none)
        to D's ``cache`` at ``dst_ids`` (the prompt's blocks) through ``move``; None while parts are
        missing, the totals at the last. TransferError (the request dropped): a range outside the
        prompt, a block-layer twice, or block-layers missing at the last part (counted, first
        named)."""
        rid, L, n = header.req_id, cache.spec.num_layers, len(dst_ids)
        asm = self._reqs.get(rid)
        if asm is None:
            asm = self._reqs[rid] = _Assembly(torch.zeros(L, n, dtype=torch.bool))
        try:
            if header.last:
                del self._reqs[rid]
                if frames:
                    raise TransferError(f"KVLayer for {rid}: the last part carries no payload, "
                                        f"got {len(frames)} frames")
                missing = (~asm.seen).nonzero()
                if missing.numel():
                    layer, block = missing[0].tolist()
                    raise TransferError(
                        f"KVLayer for {rid}: last part arrived with {missing.shape[0]} of {L * n} "
                        f"block-layers missing (first: layer {layer}, prompt block {block})")
                return TransferStats(blocks=n, payload_bytes=asm.payload_bytes, copy_ms=asm.copy_ms,
                                     layerwise=True)
            lo, hi = header.block_offset, header.block_offset + header.num_blocks
            if not 0 <= header.layer_start < header.layer_stop <= L:
                raise TransferError(f"KVLayer for {rid}: layers [{header.layer_start}, "
                                    f"{header.layer_stop}) not a non-empty range in [0, {L})")
            if not (header.num_blocks >= 1 and 0 <= lo and hi <= n):
                raise TransferError(f"KVLayer for {rid}: prompt blocks [{lo}, {hi}) not a non-empty "
                                    f"range in [0, {n})")
            layers = range(header.layer_start, header.layer_stop)
            twice = asm.seen[header.layer_start:header.layer_stop, lo:hi].nonzero()
            if twice.numel():
                layer, block = twice[0].tolist()
                raise TransferError(f"KVLayer for {rid}: layer {header.layer_start + layer} of "
                                    f"prompt block {lo + block} received twice")
            t0 = time.perf_counter()
            asm.payload_bytes += move(header, frames, cache, list(dst_ids[lo:hi]), layers)
            asm.copy_ms += (time.perf_counter() - t0) * 1e3
            asm.seen[header.layer_start:header.layer_stop, lo:hi] = True
            return None
        except Exception:
            self._reqs.pop(rid, None)
            raise

    def forget(self, req_id: str) -> bool:
        """Drop a partly received request; True if there was one."""
        return self._reqs.pop(req_id, None) is not None
