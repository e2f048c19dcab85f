"""Failure kinds of issue 26 that peers shipped as bugs, on in-process instances
(tests/reliability_harness.py): each ends in a refusal or correct tokens, with every block back."""

from __future__ import annotations

import pytest

from kvflow.connector.nixl_agent import nixl_available
from kvflow.protocol import Pair, PairResult, Unpair
from kvflow.serve.decode import DecodeInstance
from kvflow.serve.prefill import PrefillInstance

from .reliability_harness import make_instance

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
STAGED = {"kv_connector": "nixl", "kv_connector_config": {"mode": "staged", "staging_slots": 1}}


def _pair_msg(p) -> Pair:
    return Pair(peer_id=p.instance_id, peer_role="prefill", peer_spec=p.spec.to_dict(),
                peer_num_blocks=p.num_blocks, peer_pid=p.pid if hasattr(p, "pid") else 0,
                peer_fingerprint=p.fingerprint,
                peer_connector_md=p.connector.export()["connector_md"])


@needs_nixl
def test_a_p_refused_for_want_of_a_staging_slot_pairs_once_the_slot_frees():
    d = make_instance(DecodeInstance, "decode", **STAGED)
    p1 = make_instance(PrefillInstance, "prefill", **STAGED)
    p2 = make_instance(PrefillInstance, "prefill", **STAGED)
    try:
        d.on_pair(_pair_msg(p1), [], None)
        d.on_pair(_pair_msg(p2), [], None)
        ok, refused = [m for m in d.out if isinstance(m, PairResult)]
        assert ok.ok and ok.peer_id == p1.instance_id
        assert not refused.ok and refused.peer_id == p2.instance_id
        assert refused.error == (
            f"cannot attach to {p2.instance_id}'s cache: all 1 staging slots of this decode "
            f"instance are taken (by ['{p1.instance_id}']); raise kv_connector_config "
            f"staging_slots; it pairs once one frees")
        assert d.receiver.slots == {p1.instance_id: 0}
        d.out.clear()
        d.on_unpair(Unpair(peer_id=p1.instance_id, reason="exited", exited=True), [], None)
        (late,) = [m for m in d.out if isinstance(m, PairResult)]
        assert late.ok and late.peer_id == p2.instance_id and late.error == ""
        assert d.receiver.slots == {p2.instance_id: 0} and d.waiting_pairs == {}
    finally:
        for inst in (d, p1, p2):
            inst.close()
