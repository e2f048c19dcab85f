"""Typed messages between a decode (D) worker that pulls KV and the prefill (P) worker that
holds it, for :class:`~kvflow.integrations.vllm.KvflowConnector`.

:class:`kvflow.wire.WireMsg` messages in the one codec of :mod:`kvflow.wire` (MessagePack,
tagged by class name); a frame that is not one of them is rejected
(:class:`~kvflow.wire.ProtocolError`), never unpickled. KV bytes travel
as raw frames after a :class:`PullReply` header.

    transport tcp:
    D --Pull(req, P's block ids, D's spec)--> P --PullReply + one frame per layer--> D
    transport nixl (D READs P's blocks itself, one-sided):
    D --NixlHello(D's spec)--> P --NixlInfo(P's agent metadata, tensor addresses)--> D  (once)
    D --Pull(req, ids, spec, nixl=True)--> P --PullReply(ok, P's agent name)--> D
    D: NIXL READ of P's blocks into D's, then D --Release(req)--> P
    transport ipc (one host; D's staging cache exported, mapped by P):
    D --Pull(req, ids, spec, staging=name)--> P copies into D's staging --PullReply(ok)--> D
    D: copy staging -> its blocks (per chunk of staging_blocks), then D --Release(req)--> P
    both:
    D --Release(req)--> P   (done reading, or D will never pull: aborted, full prefix hit)
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvflow.wire import Codec, WireMsg

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class Pull(WireMsg):
    """D -> P: send the blocks ``block_ids`` (P's ids, in logical order) of request ``req_id``;
    with ``nixl``, only check them and keep them held until D's :class:`Release` (D READs)."""
    req_id: str
    block_ids: list[BlockId]
    spec: dict[str, Any]            # D's KVCacheSpec.to_dict(): P refuses a different geometry
    nixl: bool = False
    staging: str = ""               # ipc: D's staging export; P copies the blocks into it
    staging_blocks: int = 0         # ipc: blocks of that staging cache


class Release(WireMsg):
    """D -> P: D will not pull ``req_id``; P may free its blocks now."""
    req_id: str


class PullReply(WireMsg):
    """P -> D: ``ok`` and ``num_layers`` raw frames follow (frame ``l`` is
    ``staging[l]`` of ``staging_shape(spec, len(block_ids))``), or ``error`` says why not."""
    req_id: str
    ok: bool
    num_layers: int = 0
    error: str = ""
    agent: str = ""                 # nixl: P's agent name (D meets P anew when it changed)


class NixlHello(WireMsg):
    """D -> P: where are your blocks? (transport nixl, once per P)."""
    spec: dict[str, Any]            # D's KVCacheSpec.to_dict()


class NixlInfo(WireMsg):
    """P -> D: P's NIXL agent and cache. Block ``b`` of tensor ``t`` (``PagedKVCache.tensors()``
    order) is ``block_bytes`` bytes at ``addrs[t] + b * block_bytes`` of memory type ``mem``
    (``DRAM`` / ``VRAM``) on ``device_id``; or ``error`` says why not (different spec)."""
    ok: bool
    error: str = ""
    agent: str = ""
    metadata: bytes = b""           # get_agent_metadata(): what add_remote_agent loads
    addrs: list[int] = []
    num_blocks: int = 0
    block_bytes: int = 0
    mem: str = "DRAM"
    device_id: int = 0


_MESSAGES = (Pull, Release, PullReply, NixlHello, NixlInfo)
CODEC = Codec(_MESSAGES, what="kvflow vLLM-connector",
              reject="not a kvflow vLLM-connector message", logger=__name__)
#: One msgpack frame of a message of this module (TypeError for anything else).
encode = CODEC.encode
#: The message in one frame (:class:`~kvflow.wire.ProtocolError` naming what is wrong).
decode = CODEC.decode
