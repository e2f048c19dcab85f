"""Serve's control plane: the :class:`kvflow.wire.WireMsg` messages between the router and the
P, D and colocated instances (one request's path: docs/design.md, "One request, from the router
to D's cache"). :data:`CODEC` also decodes the connector's data plane
(:mod:`kvflow.connector.messages`), which serve hands on unnamed; a bad frame is a
:class:`ProtocolError`, logged and never executed.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvflow.connector import DATA_MESSAGES
from kvflow.wire import Codec, ProtocolError, WireMsg  # noqa: F401 (ProtocolError: the codec's)

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]

PROTOCOL_VERSION = 1


class Register(WireMsg):
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


class Registered(WireMsg):
    """Router -> instance, the answer to every :class:`Register`: accepted (``ok``) or refused
    with ``error``; a refused instance prints the error and exits 1."""
    ok: bool
    error: str = ""


class Reregister(WireMsg):
    """Router -> an instance it does not know (declared dead, yet alive): register again."""
    reason: str = ""


class Heartbeat(WireMsg):
    """Instance -> router, every heartbeat interval and after blocks were freed. ``seq`` grows
    with every heartbeat of one process: the router keeps the counts of the newest."""
    instance_id: str
    free_blocks: int
    num_running: int = 0
    seq: int = 0


class Leaving(WireMsg):
    """Instance -> router, once, on a clean stop (before it closes its sockets): logged as a
    stop, not a death. ``reason``: what stopped it, e.g. "SIGINT"."""
    instance_id: str
    reason: str = ""


class Pair(WireMsg):
    """Router -> P and D: meet this peer (its spec is checked before any request)."""
    peer_id: str
    peer_role: str
    peer_spec: dict[str, Any]
    peer_num_blocks: int
    data_addr: str = ""             # to P: D's data address
    shm_name: str = ""              # the peer's ipc export: P's to D (pull), D's to P (push)
    peer_pid: int = 0               # the peer's process id (one host: a liveness check)
    peer_host_id: str = ""          # the peer's Register.host_id: its pid is comparable when equal
    peer_fingerprint: dict[str, Any] = {}  # the peer's Register.fingerprint, checked too
    peer_connector_md: bytes = b""  # the peer's Register.connector_md (nixl: NixlAgentInfo)
    lease_addr: str = ""            # to P: D's lease socket (P connects; D's LeaseRenew come on it)


class Unpair(WireMsg):
    """Router -> P: forget decode instance ``peer_id`` (it died or left; other links stay). Router
    -> D: prefill instance ``peer_id`` died; ``exited``: its process exited (D frees what it kept
    for it at once, else ``kv_lease_s`` later); ``stopped``: a clean stop (:class:`Leaving`)."""
    peer_id: str
    reason: str = ""
    exited: bool = False
    stopped: bool = False


class PairResult(WireMsg):
    """P or D -> router: the pairing was accepted (``ok``) or refused with ``error``."""
    instance_id: str
    peer_id: str
    ok: bool
    error: str = ""


class Allocate(WireMsg):
    """Router -> D (or colocated): admit the request and allocate blocks for
    prompt + max_tokens (D's own ids); carries what decoding needs."""
    req_id: str
    token_ids: list[TokenId]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False


class Allocated(WireMsg):
    """D -> router: D's block table for the request; its first ``num_cached_blocks`` blocks
    already hold the prompt's KV (prefix cache hit on D)."""
    req_id: str
    block_ids: list[NonNeg]
    num_cached_blocks: NonNeg = 0


class Rejected(WireMsg):
    """Any instance -> router: the request cannot be served; ``kind``: "capacity" (HTTP 400,
    ``param`` the field to blame), "busy" (retry), "transfer" (HTTP 502) or "error" (HTTP 500)."""
    req_id: str
    kind: str
    error: str
    param: str = ""


class Prefill(WireMsg):
    """Router -> P (disagg) or colocated: prefill ``token_ids``, send the first token at once and
    hand the KV to ``decode_id`` at ``decode_block_ids``; refused for an unpaired D or a live id."""
    req_id: str
    token_ids: list[TokenId]
    temperature: float = 0.0
    seed: int = 0
    decode_id: str = ""
    decode_block_ids: list[NonNeg] = []
    num_cached_blocks: NonNeg = 0   # D holds logical blocks 0..k-1 (prefix hit): send the rest
    max_tokens: NonNeg = 0          # the request's, for P's stop rule on the first token (0: none)
    ignore_eos: bool = False


class Tokens(WireMsg):
    """P (the first token), D (the rest) or colocated -> router: ``token_ids[0]`` at output position
    ``index``; ``kvflow`` rides on each instance's first message (:mod:`.timings`)."""
    req_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""         # "stop" | "length" | "abort" | "error"
    error: str = ""
    kvflow: dict[str, Any] = {}
    index: NonNeg = 0


class Abort(WireMsg):
    """Router -> P and D: drop the request and give its blocks back. ``peer_dead``: its other
    instance, declared dead; ``peer_exited``: that process exited (only then does P free sent blocks
    at once); ``prefill_sent``: P got the Prefill (with ipc-push D keeps the blocks lent:
    docs/reliability.md, "Failure kinds and policies")."""
    req_id: str
    reason: str = ""
    peer_dead: str = ""
    prefill_sent: bool = True
    prefill_id: str = ""            # the P that got the Prefill ("" if none or unknown)
    peer_exited: bool = False       # peer_dead's process has exited (seen by the router)


#: router <-> instance messages
CONTROL_MESSAGES = (Register, Registered, Reregister, Heartbeat, Leaving, Pair, Unpair,
                    PairResult, Allocate, Allocated, Rejected, Prefill, Tokens, Abort)
#: every message an instance's socket carries: the control plane and the connector's data plane
MESSAGE_TYPES = CONTROL_MESSAGES + tuple(DATA_MESSAGES)

CODEC = Codec(MESSAGE_TYPES, what="kvflow.serve.protocol", reject="rejected control frame",
              logger="kvflow.serve.protocol")
encode, decode, decode_or_log = CODEC.encode, CODEC.decode, CODEC.decode_or_log  # kvflow.wire.Codec
