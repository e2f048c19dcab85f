"""The connector's data plane: the messages P's and D's halves send each other (which kind sends
which, and when: docs/design.md, "One request, from the router to D's cache"), encoded by
:data:`CODEC`; KV payload bytes travel as raw frames after a header, never msgpack-encoded.
:class:`NixlAgentInfo` is no message: it rides in serve's ``Register.connector_md``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvflow.wire import Codec, ProtocolError, WireMsg

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
BlockId = Annotated[int, msgspec.Meta(ge=-1)]


class KVReady(WireMsg):
    """P -> D (ipc-pull): the request's KV is in P's shared cache at ``src_block_ids``."""
    req_id: str
    src_block_ids: list[BlockId]
    first_token: int
    num_prompt_tokens: int
    t_start: float                  # time.time() when P began the transfer
    block_digests: list[int] = []   # --kv-verify: digest of each named block (kernels.digest)


class KVData(WireMsg):
    """P -> D (tcp): header frame; the staging buffer of ``num_blocks`` blocks follows as
    ``num_frames`` raw frames, one per layer ([tensors_per_layer, num_blocks, *block_shape])."""
    req_id: str
    num_blocks: NonNeg
    num_frames: NonNeg
    first_token: int
    num_prompt_tokens: int
    t_start: float
    gather_ms: float = 0.0
    block_digests: list[int] = []   # --kv-verify: digest of each sent block (kernels.digest)


class KVLayer(WireMsg):
    """P -> D (layerwise): layers ``[layer_start, layer_stop)`` of the prompt's logical blocks
    ``[block_offset, block_offset + num_blocks)`` (ipc: D pulls P's ``src_block_ids``; tcp: one raw
    frame per layer follows, as after :class:`KVData`). The last message has ``last`` set, no
    layers, and the first token; D acks to ``reply_to`` (P's control link)."""
    req_id: str
    reply_to: str
    layer_start: int = 0
    layer_stop: int = 0
    block_offset: int = 0
    num_blocks: int = 0
    src_block_ids: list[BlockId] = []
    last: bool = False
    first_token: int = -1
    num_prompt_tokens: int = 0
    t_start: float = 0.0            # time.time() when P sent the request's first part
    gather_ms: float = 0.0          # tcp, last message: P's gather time over all parts


class KVPushed(WireMsg):
    """P -> D (ipc-push, nixl): P is done writing ``req_id``'s KV into D's blocks: ``ok``, all
    ``num_blocks`` prompt blocks (``payload_bytes``) are there and ``first_token`` follows; else
    nothing more will be written (``error`` says why) and D may free the blocks. P's times:
    ``t_start`` / ``t_done`` (``time.time()`` at the first copy, at the send), ``copy_ms`` (issuing
    copies), ``exposed_ms`` (its wait for them after the first token), ``prefill_ms``."""
    req_id: str
    ok: bool
    error: str = ""
    first_token: int = -1
    num_prompt_tokens: int = 0
    num_blocks: NonNeg = 0
    payload_bytes: NonNeg = 0
    t_start: float = 0.0
    t_done: float = 0.0
    copy_ms: float = 0.0
    exposed_ms: float = 0.0
    prefill_ms: float = 0.0
    layerwise: bool = False


class KVAck(WireMsg):
    """D -> P: the blocks of ``req_id`` are in D's cache (``ok``) or were dropped; P may free."""
    req_id: str
    ok: bool
    error: str = ""


class LeaseRenew(WireMsg):
    """D -> P, every heartbeat, on D's lease socket (``Register.lease_addr``): D still means to read
    the blocks P sent (or will send) for ``req_ids`` (docs/reliability.md, "Liveness")."""
    req_ids: list[str]


#: the data plane between P and D (serve hands these to the connector, never names them)
DATA_MESSAGES = (KVReady, KVData, KVLayer, KVPushed, KVAck, LeaseRenew)

CODEC = Codec(DATA_MESSAGES, what="kvflow.connector.messages", reject="rejected data frame",
              logger="kvflow.connector.messages")
encode, decode, decode_or_log = CODEC.encode, CODEC.decode, CODEC.decode_or_log


class NixlAgentInfo(msgspec.Struct, forbid_unknown_fields=True):
    """What a ``nixl`` instance tells its peers at pairing (``Register.connector_md``): D's one
    registered cache allocation and, staged, its staging buffer of one slot per paired P."""
    agent: str                      # the NIXL agent's name (unique per instance)
    metadata: bytes                 # get_agent_metadata(): what a peer's add_remote_agent loads
    cache_addr: NonNeg = 0          # D: address of its registered KV cache; 0 for P
    cache_bytes: NonNeg = 0         # D: its size in bytes; 0 for P
    num_blocks: NonNeg = 0          # blocks of that cache
    staging_addr: NonNeg = 0        # D, staged mode: its staging buffer; 0 otherwise
    staging_slots: NonNeg = 0       # D, staged mode: slots of that buffer (one per paired P)
    slot_bytes: NonNeg = 0          # D, staged mode: bytes of one slot
    mode: str = "direct"            # "direct" or "staged": P and D must agree
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"  # where the memory lives: host or GPU
    device_id: NonNeg = 0           # VRAM: the CUDA ordinal on the sender's host (DRAM: 0)


_INFO_DECODER = msgspec.msgpack.Decoder(NixlAgentInfo)


def encode_agent_info(info: NixlAgentInfo) -> bytes:
    """``info`` as msgpack bytes (for ``Register.connector_md``)."""
    return msgspec.msgpack.encode(info)


def decode_agent_info(data: bytes) -> NixlAgentInfo:
    """The :class:`NixlAgentInfo` a peer sent; ProtocolError when ``data`` is empty or not a
    well-formed NixlAgentInfo."""
    if not data:
        raise ProtocolError("no nixl agent info (connector_md is empty: is the peer running "
                            "with --kv-connector nixl?)")
    try:
        return _INFO_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"rejected nixl agent info ({len(data)} bytes): {exc}") from None
