"""What crosses the connector contract (:mod:`.base`): the records P's and D's serve pass in
and get back, the connector errors, and small checks every kind uses."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from kvflow.context import sends_allowed
from kvflow.layout import KVCacheSpec

from .transport import TransferError


class SlotsTaken(TransferError):
    """A pairing refused for now: D's receiver has no free slot for another P (nixl staged);
    D keeps the pairing and makes it once a slot frees."""


@dataclasses.dataclass
class TransferStats:
    """What one request's transfer moved, as D saw it.

    Attributes
    ----------
    blocks : int
        Prompt blocks written into D's cache (a prefix hit's blocks excluded).
    payload_bytes : int
        Bytes moved (``blocks`` x :attr:`KVCacheSpec.bytes_per_block` for whole blocks).
    copy_ms : float
        Copy time (ms): D's copy for ipc-pull / tcp, P's copy calls for ipc-push.
    layerwise : bool
        The request moved layer by layer during the prefill.
    """
    blocks: int
    payload_bytes: int
    copy_ms: float
    layerwise: bool = False


@dataclasses.dataclass
class Peer:
    """The other instance of a pairing (from :class:`~kvflow.serve.protocol.Pair`).

    Attributes
    ----------
    id : str
        Its instance id.
    spec : KVCacheSpec
        Its KV cache spec (equal to ours: checked before attaching).
    num_blocks : int
        Blocks of its cache.
    shm_name : str
        Its exported cache ('' if it exports none).
    data_addr : str
        D's data socket (P connects its link there; '' for a P).
    connector_md : bytes
        What its connector published for peers (nixl: an encoded
        :class:`~kvflow.connector.messages.NixlAgentInfo`; b'' for other kinds).
    """
    id: str
    spec: KVCacheSpec
    num_blocks: int
    shm_name: str = ""
    data_addr: str = ""
    connector_md: bytes = b""


@dataclasses.dataclass
class PrefillJob:
    """One request as P's connector sees it.

    Attributes
    ----------
    req_id : str
    token_ids : list[int]
        The prompt.
    blocks : list[int]
        P's block table (covers the prompt).
    decode_id : str
        The D that allocated ``decode_block_ids`` (attached).
    decode_block_ids : list[int]
        D's block table of the request (logical block ``i`` is ``decode_block_ids[i]`` there).
    num_cached_blocks : int
        D's prefix hit: D already holds logical blocks ``0..num_cached_blocks-1``; not sent.
    """
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
    """A request between ``KVSender.begin`` and ``KVSender.finish`` or ``KVSender.fail``
    (:class:`kvflow.connector.base.KVSender`).

    Attributes
    ----------
    layerwise : bool
        Its KV moves during the prefill (through the kind's ``chunk_hook``).
    t_begin : float
        ``time.perf_counter()`` at ``begin`` (s).
    state : object
        What the kind's ``prepare`` returned (ipc-push, nixl: its ``PushStats``).
    """
    layerwise: bool
    t_begin: float
    state: Any = None


@dataclasses.dataclass
class Handoff:
    """What P keeps for a request after :meth:`~kvflow.connector.base.KVSender.finish` until
    D's :class:`~kvflow.connector.messages.KVAck` or the lease ends.

    Attributes
    ----------
    holds_blocks : bool
        D reads P's blocks after the prefill returned (or parts still go out): keep them.
    keep : object
        Memory ZMQ still reads (a staging buffer), or None.
    """
    holds_blocks: bool
    keep: Any = None


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` with an index on CUDA (``"cuda"`` is the current GPU,
    ``cuda:N``), so two names of one GPU compare equal."""
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
