"""What crosses the connector contract (:mod:`.base`): the records P's and D's serve pass in
and get back, the connector errors, and small helpers every kind uses."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.layout import KVCacheSpec

from .transport import TransferError


class SlotsTaken(TransferError):
    """A pairing refused for now: D's receiver has no free slot for another P (nixl staged);
    D keeps the pairing and makes it once a slot frees."""


@dataclasses.dataclass
class TransferStats:
    """What a request's transfer moved, as D saw it: ``blocks`` (written into D's cache, past a
    prefix hit), ``payload_bytes``, ``copy_ms`` (D's copy; ipc-push: P's calls), ``layerwise``."""
    blocks: int
    payload_bytes: int
    copy_ms: float
    layerwise: bool = False


@dataclasses.dataclass
class Peer:
    """The other instance of a pairing (from ``Pair``): id, cache spec, ``num_blocks``, ``shm_name``
    (its export, or ''), ``data_addr`` (D's; '' for P), ``connector_md`` (nixl's info)."""
    id: str
    spec: KVCacheSpec
    num_blocks: int
    shm_name: str = ""
    data_addr: str = ""
    connector_md: bytes = b""


@dataclasses.dataclass
class PrefillJob:
    """One request as P's connector sees it: prompt ``token_ids``, P's table ``blocks``, D
    ``decode_id``'s ``decode_block_ids`` by logical block, D's prefix hit ``num_cached_blocks``."""
    req_id: str
    token_ids: list[int]
    blocks: list[int]
    decode_id: str
    decode_block_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0


#: :meth:`Engine.prefill <kvflow.engine.Engine.prefill>`'s ``on_chunk``: called as
#: ``on_chunk(start, end)`` before the forward of positions ``[start, end)``; returns the
#: chunk's per-layer hook ``on_layer(layer)`` or None.
ChunkHook = Callable[[int, int], Callable[[int], None] | None]


@dataclasses.dataclass
class Prefilling:
    """A request between ``KVSender.begin`` and ``finish`` or ``fail``: ``layerwise``, ``t_begin``
    (``time.perf_counter()`` at ``begin``), ``state`` (what the kind's ``prepare`` returned)."""
    layerwise: bool
    t_begin: float
    state: Any = None


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` with an index on CUDA (``"cuda"`` is the current GPU),
    so two names of one GPU compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_send_allowed(what: str) -> None:
    """Raise RuntimeError if called during a dummy/profile run (nothing may be sent then)."""
    if not sends_allowed():
        raise RuntimeError(f"{what} during a dummy/profile run: nothing may be sent "
                           f"while is_dummy_or_profile_run is set")


def as_ids(ids: Any) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor."""
    return torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids,
                           dtype=torch.int64).reshape(-1)


def warm_copy(spec: KVCacheSpec, device: Any, backend: str, *caps: int | None) -> None:
    """Compile :func:`~kvflow.kernels.copy_blocks` on two scratch caches of ``spec``, once per
    grid cap of ``caps`` (none: the full grid only)."""
    from kvflow.kernels import copy_blocks
    a, b = PagedKVCache(spec, 2, device=device), PagedKVCache(spec, 2, device=device)
    for cap in caps or (None,):
        copy_blocks(a, b, [0], [1], backend=backend, max_ctas=cap)


class ExportedCache:
    """A half whose cache another process of this host maps (ipc-pull's P, ipc-push's D):
    :func:`~.transport.shm.export_new_cache`, named in ``Register.shm_name``."""

    export_role = ""
    export_name = ""  # the shm segment (CPU) or published CUDA IPC export

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        from .transport.shm import export_new_cache
        self.cache, self.export_name = export_new_cache(self.spec, num_blocks, self.device,
                                                        self.export_role)
        return self.cache

    def export(self) -> dict[str, str]:
        return {"shm_name": self.export_name}

    def unexport(self) -> None:
        if self.export_name:  # the router also removes it if its owner dies
            from kvflow.segments import unlink
            unlink(self.export_name)
        self.export_name = ""
