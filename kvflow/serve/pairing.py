"""Whether two instances may pair: equal KV cache spec, then equal model fingerprint."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.layout import KVCacheSpec

from .fingerprint import check_fingerprint


def check_pairing(mine: KVCacheSpec, my_id: str, peer: dict[str, Any], peer_id: str) -> str:
    """'' when the peer's KV cache spec equals ours, else an error naming every differing field
    with both values, e.g. ``block_size: 16 (p-1-ab) vs 32 (d-2-cd)``."""
    try:
        theirs = KVCacheSpec.from_dict(peer)
    except (TypeError, ValueError) as exc:
        return f"pairing refused: {peer_id} sent an invalid KV cache spec {peer!r}: {exc}"
    diffs = [f"{f.name}: {getattr(mine, f.name)} ({my_id}) vs {getattr(theirs, f.name)} ({peer_id})"
             for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
    return "KV cache spec mismatch, pairing refused: " + "; ".join(diffs) if diffs else ""


def check_peer(inst: Any, msg: Any) -> str:
    """'' when the peer of ``msg`` (:class:`~kvflow.protocol.Pair`) may pair with ``inst`` (an
    :class:`~kvflow.serve.instance.Instance`): equal KV cache spec (:func:`check_pairing`),
    then equal model fingerprint (:func:`~kvflow.serve.fingerprint.check_fingerprint`); else
    the refusal."""
    return (check_pairing(inst.spec, inst.instance_id, msg.peer_spec, msg.peer_id)
            or check_fingerprint(inst.fingerprint, inst.instance_id, msg.peer_fingerprint,
                                 msg.peer_id))


def peer_of(msg: Any, spec: KVCacheSpec) -> Any:
    """The :class:`~kvflow.connector.Peer` a :class:`~kvflow.protocol.Pair` names (its spec
    equals ``spec``: checked by :func:`check_peer`)."""
    from kvflow.connector import Peer
    return Peer(id=msg.peer_id, spec=spec, num_blocks=msg.peer_num_blocks, shm_name=msg.shm_name,
                data_addr=msg.data_addr, connector_md=msg.peer_connector_md)
