"""Failure kinds of issue 26 that peers shipped as bugs, on in-process instances
(tests/reliability_harness.py): each ends in a refusal or correct tokens, with every block back."""

from __future__ import annotations

import pytest
import torch

from kvflow.connector.transport.nixl_agent import nixl_available
from kvflow.layout import KVCacheSpec
from kvflow.serve.protocol import Pair, PairResult, Unpair
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.instance.pairing import check_pairing
from kvflow.serve.instance.prefill import PrefillInstance

from tests.reliability_harness import make_instance

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
STAGED = {"kv_connector": "nixl", "kv_connector_config": {"mode": "staged", "staging_slots": 1}}


def _pair_msg(p) -> Pair:
    return Pair(peer_id=p.instance_id, peer_role="prefill", peer_spec=p.spec.to_dict(),
                peer_num_blocks=p.num_blocks, peer_pid=p.pid if hasattr(p, "pid") else 0,
                peer_fingerprint=p.fingerprint,
                peer_connector_md=p.connector.export()["connector_md"])


@needs_nixl
def test_a_p_refused_for_want_of_a_staging_slot_pairs_once_the_slot_frees():
    """Then the same P, declared dead and back with the same agent metadata, pairs again in
    its own slot (not refused as a second P)."""
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
        d.out.clear()  # p2 declared dead, back with the same agent metadata: paired anew
        d.on_pair(_pair_msg(p2), [], None)
        (again,) = [m for m in d.out if isinstance(m, PairResult)]
        assert again.ok and d.receiver.slots == {p2.instance_id: 0}
    finally:
        for inst in (d, p1, p2):
            inst.close()


def _ctl_with(*regs):
    """A router Controller holding ``regs`` ((id, role, connector) each), every send captured
    in ``ctl.sent`` as (instance id, message)."""
    from kvflow.serve.protocol import Register
    from kvflow.serve.router.control import Controller, InstanceInfo
    ctl = Controller()
    ctl.sent = []

    async def send(inst, msg):
        ctl.sent.append((inst.id, msg))
    ctl.send = send
    for iid, role, conn in regs:
        reg = Register(instance_id=iid, role=role, spec={}, num_blocks=40, free_blocks=40,
                       max_model_len=256, kv_connector=conn, pid=1)
        ctl.instances[iid] = InstanceInfo(reg, iid.encode(), 0.0, 40)
    return ctl


def test_mixed_connectors_are_never_paired_and_the_error_names_both():
    import asyncio
    ctl = _ctl_with(("p-0", "prefill", "ipc-pull"), ("d-0", "decode", "tcp"),
                    ("d-1", "decode", "ipc-pull"))
    try:
        asyncio.run(ctl._pair(ctl.instances["p-0"]))
        assert [(i, m.peer_id) for i, m in ctl.sent] == [("p-0", "d-1"), ("d-1", "p-0")]
        assert ctl.errors == ["kv connector mismatch: p-0 uses 'ipc-pull', d-0 uses 'tcp'; "
                              "not paired"]
        for iid in ("p-0", "d-1"):  # both accept: only that pair is ever picked
            other = "d-1" if iid == "p-0" else "p-0"
            asyncio.run(ctl._handle(iid.encode(), PairResult(instance_id=iid, peer_id=other,
                                                             ok=True)))
        assert {(p.id, d.id) for p, d in (ctl.pick() for _ in range(4))} == {("p-0", "d-1")}
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()


def test_a_late_pairing_with_a_peer_that_died_meanwhile_is_undone():
    """D paired a P once a staging slot freed, but the P died meanwhile: the router sends D an
    Unpair (exited, as the router saw) and the pair is never picked."""
    import asyncio
    ctl = _ctl_with(("d-0", "decode", "nixl"))
    ctl.exited.add("p-gone")
    try:
        asyncio.run(ctl._handle(b"d-0", PairResult(instance_id="d-0", peer_id="p-gone", ok=True)))
        ((to, msg),) = ctl.sent
        assert to == "d-0" and msg == Unpair(peer_id="p-gone", reason="not registered",
                                             exited=True)
        assert ctl.instances["d-0"].pair_ok == set() and ctl.pick() is None
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()


FP32 = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16,
                   dtype=torch.float32, layout="NHD")
FP8 = FP32.with_(dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("p_spec, d_spec", [(FP8, FP32), (FP32, FP8)], ids=["fp8-P", "fp8-D"])
@pytest.mark.parametrize("connector", ["ipc-pull", "ipc-push", "tcp", "nixl"])
def test_fp8_on_one_side_only_is_mapped_or_refused_per_connector(p_spec, d_spec, connector):
    """ipc-pull / ipc-push re-block (D's quantized values byte-checked in tests/kernels/test_reblock*.py);
    tcp carries no fp8 scales, so an fp8 P is refused, an fp8 D quantizes P's float32 blocks;
    nixl writes bytes as they are: refused. Both sides refuse alike, naming both dtypes."""
    sides = {"prefill": (p_spec, "p-1", d_spec, "d-2"), "decode": (d_spec, "d-2", p_spec, "p-1")}
    got = {role: check_pairing(mine, me, theirs.to_dict(), them, connector, role)
           for role, (mine, me, theirs, them) in sides.items()}
    if connector in ("ipc-pull", "ipc-push") or (connector == "tcp" and p_spec is FP32):
        assert got == {"prefill": "", "decode": ""}
        return
    tail = ("; the tcp connector does not carry the fp8 scales of P (p-1) that a D of another "
            "spec needs; use ipc-pull or ipc-push, or equal specs" if connector == "tcp" else
            "; the nixl connector moves only equal specs (re-blocking connectors: ipc-pull, ipc-push, "
            "tcp)")
    for role, (mine, me, theirs, them) in sides.items():
        assert got[role] == (f"KV cache spec mismatch, pairing refused: dtype: {mine.dtype} "
                             f"({me}) vs {theirs.dtype} ({them})" + tail), role


@needs_nixl
def test_a_prompt_that_fills_the_staging_slot_exactly_is_token_identical_and_frees_it():
    """Staged nixl, one slot of max_model_len (256 tokens: 16 blocks): a 248-token prompt (+8
    new tokens) fills the slot to its last byte; the next request reuses the slot (D's ``free``
    came back), both token-identical to colocated, every block back."""
    from tests.reliability_harness import PD
    from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of
    pd = PD(prefix=False, **STAGED)
    try:
        prompt = (TEXT * 2)[:248]
        alloc, _, header, toks = pd.run(prompt)
        assert len(alloc.block_ids) == header.num_blocks == 16
        assert header.payload_bytes == pd.d.receiver.slot_bytes == 16 * pd.d.spec.bytes_per_block
        assert tokens_of(toks) == colocated(pd, prompt)
        _, _, _, toks = pd.run(prompt[:100])
        assert tokens_of(toks) == colocated(pd, prompt[:100])
        assert pd.free() == (pd.p.num_blocks, pd.d.num_blocks)
    finally:
        pd.close()
