"""Typed control messages between the router, prefill (P) and decode (D) instances.

Every message is a :class:`kvflow.wire.WireMsg` (a :class:`msgspec.Struct` tagged by its class
name, field ``type`` on the wire) encoded as MessagePack by the one codec of :mod:`kvflow.wire`;
a frame is decoded against the union of all known messages, so an unknown tag, a missing field
or a wrong type is rejected (:class:`ProtocolError`) and logged by the receiver, never executed.
Nothing is ever unpickled from a socket.

Flow of one disaggregated request (docs/design.md, "One request's path")::

    router --Allocate--> D --Allocated/Rejected--> router
    router --Prefill (D's block ids)--> P
    P --KVReady (ipc-pull: P's block ids) or KVData + payload frames (tcp)--> D --KVAck--> P
      (layerwise: KVLayer parts as layers are signalled, then a last KVLayer --> D --KVAck--> P)
    P --KVPushed (ipc-push: the KV is already in D's blocks)--> D
    P --Tokens (index 0)--> router   (the first token, as soon as P sampled it; the router
                                      streams it while the KV still moves)
    D --Tokens (index 1..)--> router (one per decode step once the KV is in; ``finished``
                                      ends it; a request P's token finished gets an empty
                                      finished Tokens when D has the KV)
    router --Abort--> P, D (on done-by-error, timeout, client disconnect, peer death)
    router --Unpair--> P  (a paired D died: P drops only that D's link)
    P, D --Leaving--> router (a clean stop: logged as a stop, not a death)
    D --LeaseRenew--> P   (every heartbeat, from D's heartbeat thread on its lease socket:
                           "I still mean to read these requests' blocks")

Prefix hit on D: ``Allocated.num_cached_blocks = k`` says D already holds the request's logical
blocks ``0..k-1``; the router passes ``Prefill.num_cached_blocks = k`` and P sends only its logical
blocks ``k..`` (paired by logical position with D's table ``[k:]``).

KV payload bytes (tcp) travel as extra raw frames after a :class:`KVData` header frame; they
are never msgpack-encoded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from kvflow.wire import Codec, ProtocolError, WireMsg

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]

PROTOCOL_VERSION = 1


_Msg = WireMsg  # every message below is a kvflow.wire message


# ---- instance <-> router -----------------------------------------------------------------
class Register(_Msg):
    """Instance -> router, once after start-up (after the profile run)."""
    instance_id: str
    role: str                       # "prefill" | "decode" | "colocated"
    spec: dict[str, Any]            # KVCacheSpec.to_dict()
    num_blocks: int
    free_blocks: int
    max_model_len: int
    kv_connector: str               # the connector: "ipc-pull" | "ipc-push" | "tcp" | "none"
    pid: int
    data_addr: str = ""             # D: ZMQ address P connects to; "" otherwise
    shm_name: str = ""              # ipc: the exported cache (P's for pull, D's for push)
    host_id: str = ""               # kvflow.segments.host_id(): pids comparable when equal
    fingerprint: dict[str, Any] = {}  # kvflow.serve.fingerprint (config, dtype, weights...)
    model: str = ""                 # the instance's --model
    tokenizer: str = ""             # its tokenizer's digest: the router's must be equal
    connector_md: bytes = b""       # nixl: an encoded NixlAgentInfo (agent metadata, cache)
    lease_addr: str = ""            # D: ZMQ address of its lease socket (LeaseRenew to P's)
    version: int = PROTOCOL_VERSION


class Registered(_Msg):
    """Router -> instance, the answer to every :class:`Register`: accepted (``ok``), or refused
    with ``error`` (protocol version, a role that does not fit the router's ``--mode``, ...);
    a refused instance prints the error and exits 1."""
    ok: bool
    error: str = ""


class Reregister(_Msg):
    """Router -> an instance it does not know (declared dead after missed heartbeats, e.g. a
    load spike, yet still alive): send :class:`Register` again to be paired anew."""
    reason: str = ""


class Heartbeat(_Msg):
    """Instance -> router, every heartbeat interval (from the instance's heartbeat thread,
    :mod:`kvflow.serve.heartbeat`) and after blocks were freed; carries block counts. ``seq``
    grows with every heartbeat of one process: the router keeps the counts of the newest."""
    instance_id: str
    free_blocks: int
    num_running: int = 0
    seq: int = 0


class Leaving(_Msg):
    """Instance -> router, once, when it stops cleanly (SIGINT/SIGTERM, after its current
    step; before it closes its sockets): the router forgets it and logs a stop at INFO, not a
    death (a crash, or a process gone without this message, stays an ERROR). ``reason``: what
    stopped it, e.g. "SIGINT"."""
    instance_id: str
    reason: str = ""


class Pair(_Msg):
    """Router -> P and D: meet this peer (its spec is checked before any request)."""
    peer_id: str
    peer_role: str
    peer_spec: dict[str, Any]
    peer_num_blocks: int
    data_addr: str = ""             # to P: D's data address
    shm_name: str = ""              # the peer's exported cache (ipc): P's to D (pull), D's to P (push)
    peer_pid: int = 0               # the peer's process id (one host: a liveness check)
    peer_host_id: str = ""          # the peer's Register.host_id: its pid is comparable when equal
    peer_fingerprint: dict[str, Any] = {}  # the peer's Register.fingerprint, checked too
    peer_connector_md: bytes = b""  # the peer's Register.connector_md (nixl: NixlAgentInfo)
    lease_addr: str = ""            # to P: D's lease socket (P connects; D's LeaseRenew come on it)


class Unpair(_Msg):
    """Router -> P: forget decode instance ``peer_id`` (it died or left): drop the link to it
    (and whatever P's connector holds for it); links to other D's stay. Router -> D: prefill
    instance ``peer_id`` died; ``exited``: the router saw its process exit (D then frees at
    once what it kept for it: blocks lent to it, a nixl staging slot; else only ``kv_lease_s``
    later, as a silent P may still write); ``stopped``: it left by a clean stop (its
    :class:`Leaving`), not a failure."""
    peer_id: str
    reason: str = ""
    exited: bool = False
    stopped: bool = False


class PairResult(_Msg):
    """P or D -> router: the pairing was accepted (``ok``) or refused with ``error``."""
    instance_id: str
    peer_id: str
    ok: bool
    error: str = ""


class Allocate(_Msg):
    """Router -> D (or colocated): admit the request and allocate blocks for
    prompt + max_tokens (D's own ids); carries what decoding needs."""
    req_id: str
    token_ids: list[TokenId]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False


class Allocated(_Msg):
    """D -> router: the block table D allocated for the request (D's own ids); its first
    ``num_cached_blocks`` blocks already hold the prompt's KV (prefix cache hit on D)."""
    req_id: str
    block_ids: list[NonNeg]
    num_cached_blocks: NonNeg = 0


class Rejected(_Msg):
    """Any instance -> router: the request cannot be served; ``kind`` is "capacity" (never
    fits: HTTP 400, ``param`` names the request field to blame), "busy" (no free blocks now:
    retry), "transfer" (P could not move the KV to D: HTTP 502, as D's own transfer failures)
    or "error" (HTTP 500)."""
    req_id: str
    kind: str
    error: str
    param: str = ""


class Prefill(_Msg):
    """Router -> P (disagg) or colocated instance: run the prefill of ``token_ids``, sample the
    first token, send it to the router at once (:class:`Tokens`, ``index`` 0; ``finished`` by
    the stop rules of ``max_tokens`` and ``ignore_eos``, 0: never finished at P), and hand the
    KV to the D the router chose, ``decode_id`` (which allocated ``decode_block_ids``). P
    refuses (:class:`Rejected`) a ``decode_id`` it is not paired with and a ``req_id`` it
    already has queued or pending."""
    req_id: str
    token_ids: list[TokenId]
    temperature: float = 0.0
    seed: int = 0
    decode_id: str = ""
    decode_block_ids: list[NonNeg] = []
    num_cached_blocks: NonNeg = 0   # D holds logical blocks 0..k-1 (prefix hit): send the rest
    max_tokens: NonNeg = 0          # the request's, for P's stop rule on the first token
    ignore_eos: bool = False


class Tokens(_Msg):
    """P (the first token), D (the rest) or colocated -> router: new tokens of a request.
    ``index``: the output position of ``token_ids[0]`` (the router streams in that order,
    whichever instance's message comes first). ``kvflow`` rides on each instance's first
    message; its ``clock`` holds that instance's ``time.monotonic()`` stamps
    (:mod:`kvflow.serve.timings`)."""
    req_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""         # "stop" | "length" | "abort" | "error"
    error: str = ""
    kvflow: dict[str, Any] = {}
    index: NonNeg = 0


class Abort(_Msg):
    """Router -> P and D: drop the request and give its blocks back. ``peer_dead`` names the
    request's other instance when the router declared it dead; ``peer_exited`` says the router
    saw its process exit (not only its heartbeats stop). Only then does P free blocks it sent
    at once (nobody will read them) instead of holding them until D's ack or the lease ends.
    ``prefill_sent``: the router had sent the Prefill to P, so with ipc push P may still be
    writing D's blocks: D keeps them until P's :class:`KVPushed`, or P's process is gone, or
    (a P that D cannot judge) ``kv_lease_s`` after P was declared dead."""
    req_id: str
    reason: str = ""
    peer_dead: str = ""
    prefill_sent: bool = True
    prefill_id: str = ""            # the P that got the Prefill ("" if none or unknown)
    peer_exited: bool = False       # peer_dead's process has exited (seen by the router)


# ---- P <-> D (data link) -----------------------------------------------------------------
class KVReady(_Msg):
    """P -> D (ipc): the request's KV is in P's shared cache at ``src_block_ids``; pull it."""
    req_id: str
    src_block_ids: list[Annotated[int, msgspec.Meta(ge=-1)]]
    first_token: int
    num_prompt_tokens: int
    t_start: float                  # time.time() when P began the transfer
    block_digests: list[int] = []   # --kv-verify: digest of each named block (kernels.digest)


class KVData(_Msg):
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


class KVLayer(_Msg):
    """P -> D (layerwise transfer): one part of a request's KV, sent as soon as the prefill
    signals the layers. A part covers layers ``[layer_start, layer_stop)`` of the prompt's
    logical blocks ``[block_offset, block_offset + num_blocks)``; D writes them into *its own*
    table at those positions. ipc: D pulls P's ``src_block_ids`` with copy_blocks; tcp: one raw
    frame per layer follows ([tensors_per_layer, num_blocks, *block_shape]). The request's
    last message has ``last`` set, no layers, and the first token; D acks to ``reply_to``
    (P's control link, not the sender thread's socket)."""
    req_id: str
    reply_to: str
    layer_start: int = 0
    layer_stop: int = 0
    block_offset: int = 0
    num_blocks: int = 0
    src_block_ids: list[Annotated[int, msgspec.Meta(ge=-1)]] = []
    last: bool = False
    first_token: int = -1
    num_prompt_tokens: int = 0
    t_start: float = 0.0            # time.time() when P sent the request's first part
    gather_ms: float = 0.0          # tcp, last message: P's gather time over all parts


class KVPushed(_Msg):
    """P -> D (ipc push): P is done writing ``req_id``'s KV into D's blocks. ``ok``: all
    ``num_blocks`` prompt blocks (``payload_bytes``) are there and ``first_token`` follows; not
    ``ok``: nothing more will be written (``error`` says why) and D may free the blocks.
    Times: ``t_start`` / ``t_done`` are P's ``time.time()`` at the first copy and at the send;
    ``copy_ms`` P's time issuing copies; ``exposed_ms`` P's wait for them after the first token;
    ``prefill_ms`` P's prefill until the first token was sampled."""
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


class KVAck(_Msg):
    """D -> P: the blocks of ``req_id`` are in D's cache (``ok``) or were dropped; P may free."""
    req_id: str
    ok: bool
    error: str = ""


class LeaseRenew(_Msg):
    """D -> P, every heartbeat, from D's heartbeat thread (:mod:`kvflow.serve.heartbeat`, on
    the socket of :attr:`Register.lease_addr`, so a long decode step does not delay it): D
    still means to read the blocks P sent (or will send) for ``req_ids``; P ignores ids it does
    not hold, and frees a sent request's blocks when neither a renewal nor an ack came within
    its lease (``--kv-lease-s``)."""
    req_ids: list[str]


class NixlAgentInfo(msgspec.Struct, forbid_unknown_fields=True):
    """What a ``nixl`` instance tells its peers at pairing (msgpack in
    :attr:`Register.connector_md` / :attr:`Pair.peer_connector_md`; not a control message).

    Attributes
    ----------
    agent : str
        The NIXL agent's name (unique per instance).
    metadata : bytes
        ``nixl_agent.get_agent_metadata()``: the agent's backends and connection info (UCX
        worker address) and its registered memory; a peer loads it with ``add_remote_agent``.
    cache_addr, cache_bytes : int
        D: address and size (bytes) of its whole registered KV cache (one allocation, laid out
        as :class:`~kvflow.cache.PagedKVCache`); 0 for P.
    num_blocks : int
        Blocks of that cache.
    staging_addr, staging_slots, slot_bytes : int
        D in staged mode: its registered staging buffer of ``staging_slots`` slots of
        ``slot_bytes`` bytes each (one per paired P); 0 otherwise.
    mode : str
        ``direct`` or ``staged``: P and D must agree.
    mem_type, device_id : str, int
        Where that memory lives, as NIXL names it: ``DRAM`` (host, device 0) or ``VRAM`` (GPU
        ``device_id``, the CUDA ordinal on the sender's host).
    """
    agent: str
    metadata: bytes
    cache_addr: NonNeg = 0
    cache_bytes: NonNeg = 0
    num_blocks: NonNeg = 0
    staging_addr: NonNeg = 0
    staging_slots: NonNeg = 0
    slot_bytes: NonNeg = 0
    mode: str = "direct"
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: NonNeg = 0


_INFO_DECODER = msgspec.msgpack.Decoder(NixlAgentInfo)


def encode_agent_info(info: NixlAgentInfo) -> bytes:
    """``info`` as msgpack bytes (for ``Register.connector_md``)."""
    return msgspec.msgpack.encode(info)


def decode_agent_info(data: bytes) -> NixlAgentInfo:
    """The :class:`NixlAgentInfo` a peer sent.

    Raises
    ------
    ProtocolError
        ``data`` is empty or not a well-formed NixlAgentInfo.
    """
    if not data:
        raise ProtocolError("no nixl agent info (connector_md is empty: is the peer running "
                            "with --kv-connector nixl?)")
    try:
        return _INFO_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"rejected nixl agent info ({len(data)} bytes): {exc}") from None


Message = Union[Register, Registered, Reregister, Heartbeat, Leaving, Pair, Unpair, PairResult, Allocate,
                Allocated, Rejected, Prefill,
                Tokens, Abort, KVReady, KVData, KVLayer, KVPushed, KVAck, LeaseRenew]
MESSAGE_TYPES = Message.__args__

CODEC = Codec(MESSAGE_TYPES, what="kvflow.protocol", reject="rejected control frame",
              logger="kvflow.protocol")
#: One control/data-plane frame from a message (TypeError for any other object).
encode = CODEC.encode
#: The message in one frame (:class:`ProtocolError` naming the fault).
decode = CODEC.decode
#: :func:`decode`, logging a rejected frame (naming its source) and returning None.
decode_or_log = CODEC.decode_or_log
