"""The messages between D, which pulls KV, and P, which holds it (:mod:`kvflow.wire`); tcp's KV
travels as raw frames after a :class:`PullReply`. docs/tutorials/vllm.md, "What happens to one
request"."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvflow.wire import Codec, WireMsg

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class Pull(WireMsg):
    """D -> P: the blocks ``block_ids`` (P's, logical order) of ``req_id`` for D's ``spec``
    (``KVCacheSpec.to_dict()``); ``nixl``: check and hold them until D's :class:`Release`;
    ``staging``: copy them into D's staging export of ``staging_blocks`` blocks (ipc-push)."""
    req_id: str
    block_ids: list[BlockId]
    spec: dict[str, Any]
    nixl: bool = False
    staging: str = ""
    staging_blocks: int = 0


class Release(WireMsg):
    """D -> P: D will not pull ``req_id``; P may free its blocks now."""
    req_id: str


class PullReply(WireMsg):
    """P -> D: ``ok`` and ``num_layers`` raw frames (``staging[l]`` of ``staging_shape``) follow, or
    ``error``; ``agent``: P's NIXL agent name (D meets P anew when it changed)."""
    req_id: str
    ok: bool
    num_layers: int = 0
    error: str = ""
    agent: str = ""


class NixlHello(WireMsg):
    """D -> P, once per P (nixl): where are your blocks? ``spec``: D's ``KVCacheSpec.to_dict()``."""
    spec: dict[str, Any]


class NixlInfo(WireMsg):
    """P -> D: P's NIXL agent (``metadata``: what ``add_remote_agent`` loads) and cache: block ``b``
    of tensor ``t`` (``PagedKVCache.tensors()`` order) is ``block_bytes`` bytes at ``addrs[t] + b *
    block_bytes`` of ``mem`` (``DRAM`` / ``VRAM``) on ``device_id``; or ``error``."""
    ok: bool
    error: str = ""
    agent: str = ""
    metadata: bytes = b""
    addrs: list[int] = []
    num_blocks: int = 0
    block_bytes: int = 0
    mem: str = "DRAM"
    device_id: int = 0


CODEC = Codec((Pull, Release, PullReply, NixlHello, NixlInfo), what="kvflow vLLM-connector",
              reject="not a kvflow vLLM-connector message", logger=__name__)
encode, decode = CODEC.encode, CODEC.decode
