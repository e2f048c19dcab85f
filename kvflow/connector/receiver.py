"""D's half of the connector contract (what D's serve calls and when: :mod:`.base`)."""

from __future__ import annotations

import abc
from typing import Any

from kvflow.cache import PagedKVCache

from .arrival import ArrivalSide
from .records import TransferError, TransferStats, as_device

#: Grid cap (CTAs) of D's receive copies on CUDA, beside its decode: ``receive_max_ctas``'s
#: default (the interference study, docs/benchmarks.md; kinds.py's entries name it).
RECEIVE_MAX_CTAS = 16


class KVReceiver(ArrivalSide, abc.ABC):
    """D's half of a connector for D's cache ``spec`` on ``device`` (``backend``: of the copies);
    serve hands it every data-plane message, the kind's :meth:`receive` does the copy."""

    name: str = ""
    #: D acks each transfer (P keeps blocks or buffers until then).
    acks: bool = True
    #: D reads P's memory after P sent the pointer: check P's lease first.
    reads_peer_memory: bool = False
    #: P writes D's blocks: blocks of a request that ends early stay lent until P is done.
    peer_writes: bool = False
    #: P and D share one host (their processes can be judged by pid).
    host_local: bool = True

    def __init__(self, spec: KVCacheSpec | None = None, device: Any = "cpu", *,
                 backend: str = "auto") -> None:
        self.spec, self.device, self.backend = spec, as_device(device), backend
        self.cache: PagedKVCache | None = None
        self._init_arrivals()

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        self.cache = PagedKVCache(self.spec, num_blocks, device=self.device)
        return self.cache

    def warmup(self) -> None:
        """Compile the copy kernels on scratch caches (no socket exists yet)."""

    def export(self) -> dict[str, Any]:
        """Fields for D's :class:`~kvflow.serve.protocol.Register` (``shm_name``, ``connector_md``)."""
        return {"shm_name": ""}

    def describe(self) -> dict[str, Any]:
        """The connector fields of a request's ``kvflow`` response block."""
        return {"kv_connector": self.name}

    def attach(self, peer: Peer) -> None:
        """Meet P ``peer`` (at pairing): map its cache if D reads it directly."""

    def detach(self, peer_id: str) -> None:
        """Forget P ``peer_id`` (it died): drop its mapping, if the connector keeps one."""

    @abc.abstractmethod
    def receive(self, header: Any, frames: list[Any], cache: PagedKVCache,
                dst_ids: list[int], peer_id: str | None = None) -> TransferStats | None:
        """Put the KV of ``header`` (+ raw ``frames``) into ``cache`` at ``dst_ids`` (D's ids past
        its prefix hit) from P ``peer_id`` (None: the last paired); None while layerwise parts are
        missing, else the totals. TransferError: frames that fit neither header nor spec, or an
        unattached peer."""

    def _unverified(self, header: Any, reblocked: bool = False) -> None:
        """Under ``--kv-verify`` refuse a move it does not check (a layerwise part or, with
        ``reblocked``, a move between specs; layerwise is refused at start too)."""
        if getattr(self, "verify", False):
            raise TransferError(f"kv verify: {header.req_id} " + (
                "comes from a P of another KV cache spec; --kv-verify does not check re-blocked "
                "moves" if reblocked else "moves layer by layer, which --kv-verify does not check"))

    def expect(self, req_id: str) -> None:
        """D allocated blocks for ``req_id``: its KV may come from now on."""

    def forget(self, req_id: str) -> None:
        """Drop the state of a partly received layerwise transfer (D ended the request)."""

    def close(self) -> None:
        """Unmap the peers and remove this side's export."""
