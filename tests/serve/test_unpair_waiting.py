"""Issue 26: a D waiting to pair with a P (refused for want of a nixl staging slot) is told
when that P is declared dead (:class:`~kvflow.serve.protocol.Unpair`), drops the waiting pairing,
and never pairs with the dead P once a slot frees (before, the router sent Unpair only to
accepted pairs: the D kept the pairing and later gave the dead P its free slot)."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.serve.protocol import PairResult, Unpair
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.instance.prefill import PrefillInstance

from tests.reliability_harness import make_instance
from tests.serve.test_reliability_kinds import STAGED, _ctl_with, _pair_msg, needs_nixl


@pytest.fixture
def ctl_of():
    made = []

    def make(d, *ps):
        ctl = _ctl_with((d.instance_id, "decode", "nixl"),
                        *((p.instance_id, "prefill", "nixl") for p in ps))
        made.append(ctl)
        return ctl
    yield make
    for ctl in made:
        ctl.sock.close(0)
        ctl.ctx.term()


def _die(ctl, iid: str, why: str, exited: bool) -> None:
    """The router declares ``iid`` dead (in a running event loop; its Unpair sends run)."""
    async def died():
        ctl.instance_died(ctl.instances[iid], why, exited=exited)
        await asyncio.sleep(0)
    asyncio.run(died())


def _results_to_router(ctl, d) -> list[PairResult]:
    """D's PairResults (taken from ``d.out``), handled by the router."""
    results = [m for m in d.out if isinstance(m, PairResult)]
    d.out[:] = [m for m in d.out if not isinstance(m, PairResult)]
    for m in results:
        asyncio.run(ctl._handle(d.instance_id.encode(), m))
    return results


@needs_nixl
@pytest.mark.parametrize("exited", [False, True], ids=["silent", "exited"])
def test_a_d_waiting_on_a_dead_ps_pairing_drops_it_and_never_pairs_with_it(ctl_of, exited):
    d = make_instance(DecodeInstance, "decode", **STAGED)
    p1 = make_instance(PrefillInstance, "prefill", **STAGED)
    p2 = make_instance(PrefillInstance, "prefill", **STAGED)
    try:
        ctl = ctl_of(d, p1, p2)
        d.on_pair(_pair_msg(p1), [], None)   # the router's Pair messages, in its order
        d.on_pair(_pair_msg(p2), [], None)
        for p in (p1, p2):
            asyncio.run(ctl._pair(ctl.instances[p.instance_id]))
        ok, waiting = _results_to_router(ctl, d)
        assert ok.ok and not waiting.ok and waiting.error.endswith("it pairs once one frees")
        assert d.waiting_pairs.keys() == {p2.instance_id}
        ctl.sent.clear()
        why = "missed heartbeats for 10.0 s" if not exited else "exited"
        _die(ctl, p2.instance_id, why, exited)
        assert ctl.sent == [(d.instance_id, Unpair(peer_id=p2.instance_id, reason=why,
                                                   exited=exited))]
        for _, msg in ctl.sent:
            d.on_unpair(msg, [], None)
        assert d.waiting_pairs == {} and d.unpaired == {}
        assert d.receiver.slots == {p1.instance_id: 0}      # p1's slot untouched
        d.on_unpair(Unpair(peer_id=p1.instance_id, reason="exited", exited=True), [], None)
        assert [m for m in d.out if isinstance(m, PairResult)] == []  # no pairing with p2
        assert d.receiver.slots == {} and d.waiting_pairs == {}        # nothing held
        assert d.allocator.num_free == d.num_blocks and not d.lent
    finally:
        for inst in (d, p1, p2):
            inst.close()


def test_the_router_tells_only_instances_it_sent_a_pair_naming_the_dead_one(ctl_of):
    class Inst:  # ids only: the router's bookkeeping, no instance behind it
        def __init__(self, iid):
            self.instance_id = iid
    d, p1, p2 = Inst("d-0"), Inst("p-1"), Inst("p-2")
    ctl = ctl_of(d, p1, p2)
    asyncio.run(ctl._pair(ctl.instances["p-1"]))             # d-0 and p-1 are sent Pairs
    ctl.sent.clear()
    _die(ctl, "p-2", "exited", True)      # never paired with anyone: nobody is told
    _die(ctl, "p-1", "exited", True)      # d-0 was sent its Pair, not accepted yet: told
    assert ctl.sent == [("d-0", Unpair(peer_id="p-1", reason="exited", exited=True))]
    assert ctl.pairs_sent == {"d-0": set()}
