"""Typed messages between a decode (D) worker that pulls KV and the prefill (P) worker that
holds it, for :class:`~kvflow.integrations.vllm.KvflowConnector`.

MessagePack-encoded :class:`msgspec.Struct` tagged by class name; a frame that is not one of
them is rejected (:class:`~kvflow.protocol.ProtocolError`), never unpickled. KV bytes travel
as raw frames after a :class:`PullReply` header.

    D --Pull(req, P's block ids, D's spec)--> P --PullReply + one frame per layer--> D
    D --Release(req)--> P   (D will never pull: aborted, or a full prefix hit on D)
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvflow.protocol import ProtocolError

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class _Msg(msgspec.Struct, tag_field="type", tag=str.lower, forbid_unknown_fields=True):
    pass


class Pull(_Msg):
    """D -> P: send the blocks ``block_ids`` (P's ids, in logical order) of request ``req_id``."""
    req_id: str
    block_ids: list[BlockId]
    spec: dict[str, Any]            # D's KVCacheSpec.to_dict(): P refuses a different geometry


class Release(_Msg):
    """D -> P: D will not pull ``req_id``; P may free its blocks now."""
    req_id: str


class PullReply(_Msg):
    """P -> D: ``ok`` and ``num_layers`` raw frames follow (frame ``l`` is
    ``staging[l]`` of ``staging_shape(spec, len(block_ids))``), or ``error`` says why not."""
    req_id: str
    ok: bool
    num_layers: int = 0
    error: str = ""


_DECODER = msgspec.msgpack.Decoder(Union[Pull, Release, PullReply])
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: _Msg) -> bytes:
    """One msgpack frame; TypeError for anything but a message of this module."""
    if not isinstance(msg, (Pull, Release, PullReply)):
        raise TypeError(f"msg must be Pull, Release or PullReply, got {type(msg).__name__}")
    return _ENCODER.encode(msg)


def decode(frame: Any) -> Pull | Release | PullReply:
    """Decode one frame; :class:`ProtocolError` naming what is wrong with it."""
    try:
        return _DECODER.decode(getattr(frame, "buffer", frame))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a kvflow vLLM-connector message: {exc}") from exc
