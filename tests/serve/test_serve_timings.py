"""The router's side of P's first token (kvflow.serve.router.router, kvflow.serve.timings) with a fake
control plane: output order whichever instance's message comes first, P still needed until D's
first message, a request finished on P's token followed until D is done, and the clock's hops."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvflow.serve.protocol import Abort, Allocate, Allocated, Prefill, Register, Tokens
from kvflow.serve.router.api import CompletionRequest
from kvflow.serve.router.metrics import Metrics
from kvflow.serve.router.placement import InstanceInfo
from kvflow.serve.router.router import Router
from kvflow.serve.timings import HOPS, MILESTONES, RequestClock, stamp


def info(role: str, name: str) -> InstanceInfo:
    reg = Register(instance_id=name, role=role, spec={}, num_blocks=8, free_blocks=8,
                   max_model_len=64, kv_connector="ipc-pull", pid=1)
    return InstanceInfo(reg, name.encode(), 0.0, 8)


class FakeCtl:
    """Answers Allocate at once; the test plays P's and D's later messages."""

    def __init__(self) -> None:
        self.p, self.d = info("prefill", "p-1"), info("decode", "d-1")
        self.instances = {"p-1": self.p, "d-1": self.d}
        self.requests, self.sent, self.exited = {}, [], set()

    def pick(self):
        return self.p, self.d

    async def send(self, inst, msg) -> None:
        self.sent.append((inst.id, msg))
        if isinstance(msg, Allocate):
            self.requests[msg.req_id].queue.put_nowait(Allocated(req_id=msg.req_id, block_ids=[0]))

    def put(self, msg: Tokens) -> None:
        (req_id,) = self.requests
        msg.req_id = req_id
        self.requests[req_id].queue.put_nowait(msg)


async def drive(ctl: FakeCtl, max_tokens: int, script) -> list[Tokens]:
    """Run one request; ``script(ctl)`` plays the instances once the Prefill went out."""
    router = Router(ctl, None, "m", Metrics())
    body = CompletionRequest(prompt=[1, 2, 3], max_tokens=max_tokens)

    async def consume() -> list[Tokens]:
        return [m async for m in router.run(body, [1, 2, 3], time.monotonic())]
    task = asyncio.ensure_future(consume())
    while not any(isinstance(m, Prefill) for _, m in ctl.sent):
        await asyncio.sleep(0.001)
    script(ctl)
    return await asyncio.wait_for(task, 5)


def clock(**names: float) -> dict:
    return {"clock": dict(names)}


def test_d_token_that_overtakes_ps_is_held_back_and_the_order_kept():
    def script(ctl):
        now = time.monotonic()
        ctl.put(Tokens(req_id="", token_ids=[22], index=1, kvflow={
            "blocks": 1, **clock(kv_done=now, second_token_emitted=now)}))
        ctl.put(Tokens(req_id="", token_ids=[11], index=0, kvflow=clock(first_token_sampled=now)))
        ctl.put(Tokens(req_id="", token_ids=[33], index=2, finished=True, finish_reason="length"))
    ctl = FakeCtl()
    msgs = asyncio.run(drive(ctl, 3, script))
    (_, prefill), = [(i, m) for i, m in ctl.sent if isinstance(m, Prefill)]
    assert (prefill.max_tokens, prefill.ignore_eos) == (3, False)  # P's stop rule
    assert [m.token_ids for m in msgs] == [[11], [22], [33]]
    kv = msgs[-1].kvflow
    assert kv["blocks"] == 1 and kv["prefill_instance"] == "p-1" and kv["decode_instance"] == "d-1"
    assert list(kv["timings_ms"])[:3] == ["allocate_sent", "allocated", "prefill_sent"]
    assert not ctl.requests and not [m for _, m in ctl.sent if isinstance(m, Abort)]


def test_request_finished_on_ps_token_is_followed_until_d_is_done():
    async def run():
        ctl = FakeCtl()
        msgs = await drive(ctl, 1, lambda c: c.put(Tokens(req_id="", token_ids=[11], index=0,
                                                          finished=True, finish_reason="length")))
        assert [m.token_ids for m in msgs] == [[11]] and len(ctl.requests) == 1  # followed
        (req_id,) = ctl.requests
        assert ctl.requests[req_id].stage == "transferring"  # P's death would fail it
        ctl.put(Tokens(req_id="", token_ids=[], index=1, finished=True, finish_reason="length"))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not ctl.requests and not [m for _, m in ctl.sent if isinstance(m, Abort)]
    asyncio.run(run())


def test_d_done_before_ps_finishing_token_arrives_is_not_followed():
    def script(ctl):
        ctl.put(Tokens(req_id="", token_ids=[], index=1, finished=True, finish_reason="length"))
        ctl.put(Tokens(req_id="", token_ids=[11], index=0, finished=True, finish_reason="length"))
    async def run():
        ctl = FakeCtl()
        msgs = await drive(ctl, 1, script)
        assert [m.token_ids for m in msgs] == [[11]] and msgs[0].finish_reason == "length"
        await asyncio.sleep(0.01)
        assert not ctl.requests  # nothing left to wait for: not followed
    asyncio.run(run())


def test_followed_request_whose_transfer_fails_is_aborted_on_p_and_d():
    async def run():
        ctl = FakeCtl()
        await drive(ctl, 1, lambda c: c.put(Tokens(req_id="", token_ids=[11], index=0,
                                                   finished=True, finish_reason="length")))
        ctl.put(Tokens(req_id="", token_ids=[], finished=True, finish_reason="error",
                       error="KV transfer failed: boom"))
        for _ in range(20):
            await asyncio.sleep(0.01)
        aborted = sorted(i for i, m in ctl.sent if isinstance(m, Abort))
        assert aborted == ["d-1", "p-1"] and not ctl.requests
    asyncio.run(run())


def test_clock_hops_telescope_and_bad_names_are_refused():
    c = RequestClock(100.0)
    for i, name in enumerate(MILESTONES):
        c.stamps[name] = 100.0 + (i + 1) / 1000
    c.merge({"clock": {"not_a_milestone": 1.0}, "blocks": 2})
    hops = c.hops_ms()
    assert set(hops) == set(HOPS) and c.report()["blocks"] == 2
    ttft_hops = ("router_in", "d_allocate", "to_p", "p_queue", "p_prefill",
                 "first_token_to_router", "router_out")
    assert sum(hops[h] for h in ttft_hops) == pytest.approx(hops["ttft"]) == 8.0
    assert c.timings_ms()["second_token_out"] == 12.0
    with pytest.raises(ValueError, match="got 'kv_arrived'"):
        stamp({}, "kv_arrived")
    with pytest.raises(ValueError, match="got 'x'"):
        c.mark("x")
