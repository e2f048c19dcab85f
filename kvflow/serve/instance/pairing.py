"""Whether two instances may pair: KV cache specs the connector can map (``block_size``,
``layout``, ``dtype`` with a re-blocking kind), then equal model fingerprints."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.connector import kinds, scales_refusal
from kvflow.layout import KVCacheSpec

from .fingerprint import check_fingerprint

MAPPABLE = ("block_size", "layout", "dtype", "scales")  # may differ, with a re-blocking kind


def spec_diff(mine: KVCacheSpec, theirs: KVCacheSpec) -> dict[str, tuple[Any, Any]]:
    """``{field: (ours, theirs)}`` of every field that differs, in field order."""
    return {f.name: (getattr(mine, f.name), getattr(theirs, f.name))
            for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)}


def check_pairing(mine: KVCacheSpec, my_id: str, peer: dict[str, Any], peer_id: str,
                  connector: str | None = None, my_role: str | None = None) -> str:
    """The refusal naming every field of the peer's KV cache spec that differs from ours, with both
    values; '' when equal or when ``connector`` maps the difference. Also refused: scales it cannot
    move (:func:`kvflow.connector.scales_refusal`), an fp8 P re-blocked without ``reblocks_fp8``."""
    try:
        theirs = KVCacheSpec.from_dict(peer)
    except (TypeError, ValueError) as exc:
        return f"pairing refused: {peer_id} sent an invalid KV cache spec {peer!r}: {exc}"
    for spec, who in ((mine, my_id), (theirs, peer_id)):
        if why := scales_refusal(connector, spec, who):
            return f"pairing refused: {why}"
    diff = spec_diff(mine, theirs)
    if not diff:
        return ""
    words = "; ".join(f"{k}: {a} ({my_id}) vs {b} ({peer_id})" for k, (a, b) in diff.items())
    fixed = [k for k in diff if k not in MAPPABLE]
    if fixed or (mine.layout != theirs.layout and "MLA" in (mine.layout, theirs.layout)):
        return (f"KV cache spec mismatch, pairing refused: {words}; P and D may differ only in "
                f"block_size, layout (NHD/HND) and dtype")
    kind = kinds.KINDS.get(connector) if connector else None
    if kind is None or not kind.reblocks:
        reblocking = ", ".join(kinds.with_capability("reblocks"))
        return (f"KV cache spec mismatch, pairing refused: {words}; the {connector} connector "
                f"moves only equal specs (re-blocking connectors: {reblocking})")
    p_spec, p_id = (mine, my_id) if my_role == "prefill" else (theirs, peer_id)
    if not kind.reblocks_fp8 and my_role in ("prefill", "decode") and p_spec.is_fp8:
        carriers = " or ".join(kinds.with_capability("reblocks_fp8"))
        return (f"KV cache spec mismatch, pairing refused: {words}; the {connector} connector "
                f"does not carry the fp8 scales of P ({p_id}) that a D of another spec needs; "
                f"use {carriers}, or equal specs")
    from kvflow.kernels.reblock import make_mapping
    try:
        make_mapping(mine, theirs, src_name=my_id, dst_name=peer_id)
    except (TypeError, ValueError) as exc:
        return f"KV cache spec mismatch, pairing refused: {exc}"
    return ""


def check_peer(inst: Any, msg: Any) -> str:
    """'' when the peer of :class:`~kvflow.serve.protocol.Pair` ``msg`` may pair with ``inst``
    (:func:`check_pairing`, then the fingerprints); else the refusal."""
    return (check_pairing(inst.spec, inst.instance_id, msg.peer_spec, msg.peer_id,
                          inst.connector_name(), inst.role)
            or check_fingerprint(inst.fingerprint, inst.instance_id, msg.peer_fingerprint,
                                 msg.peer_id))


def peer_of(msg: Any) -> Any:
    """The :class:`~kvflow.connector.Peer` a :class:`~kvflow.serve.protocol.Pair` names."""
    from kvflow.connector import Peer
    return Peer(id=msg.peer_id, spec=KVCacheSpec.from_dict(msg.peer_spec),
                num_blocks=msg.peer_num_blocks, shm_name=msg.shm_name, data_addr=msg.data_addr,
                connector_md=msg.peer_connector_md)
