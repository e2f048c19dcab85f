"""Issue 14 kind 2 in process: N prefill (P) x M decode (D) instances, every P paired with
every D, real ZMQ links and transfer threads, this test as the router. A P paired with several
D's must send each request's KV to the D the request's Prefill names (``decode_id``), never
to the D that paired last; a Prefill naming an unpaired D is refused, and unpairing one D
drops only its link. Every transfer: ipc pull (request and layerwise), ipc push (layerwise
and request), tcp (request and layerwise). Outputs are token-identical to a colocated engine;
every block comes back."""

from __future__ import annotations

import itertools
import time

import pytest

from kvflow import PagedKVCache
from kvflow.engine import Engine
from kvflow.serve.protocol import (Allocate, Allocated, PairResult, Prefill, Register, Rejected,
                                   Tokens, Unpair)
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.launch.config import ServeConfig
from kvflow.serve.instance.sampling import sample_token
from kvflow.serve.instance.prefill import PrefillInstance

from tests.fake_router import FakeRouter

BLOCK, MAX_TOKENS = 16, 6


def prompt(i: int) -> list[int]:
    """Prompt ``i``: 20..90 tokens (2..6 blocks, partial last block), distinct per ``i``."""
    return [(31 * i + 7 * k + 3) % 256 for k in range(20 + 17 * (i % 5))]


class Mesh(FakeRouter):
    """``n_p`` P's and ``n_d`` D's of kvflow-tiny, all paired as the router pairs them."""

    def __init__(self, n_p: int, n_d: int, connector: str, mode: str) -> None:
        super().__init__()

        def cfg(role):
            return ServeConfig(role=role, router_url=self.addr, kv_connector=connector,
                               block_size=BLOCK, max_model_len=256, num_blocks=40,
                               max_num_batched_tokens=32, kv_lease_s=30.0,
                               layerwise_min_tokens=0 if mode == "layerwise" else 1 << 30)

        self.ps = [PrefillInstance(cfg("prefill")) for _ in range(n_p)]
        self.ds = [DecodeInstance(cfg("decode")) for _ in range(n_d)]
        for inst in self.ps + self.ds:
            inst.startup()
        self.regs = {m.instance_id: m for m in self.wait_for(Register, n_p + n_d)}
        for p, d in itertools.product(self.ps, self.ds):
            self.pair(p, d)
        got = self.wait_for(PairResult, 2 * n_p * n_d)
        assert all(r.ok for r in got), [r.error for r in got if not r.ok]
        self.free0 = self.free()

    def instances(self) -> list:
        return self.ps + self.ds

    def submit(self, rid: str, tokens: list[int], p, d) -> None:
        """Allocate on ``d``, then the Prefill to ``p`` naming ``d`` (as the router does)."""
        self.to(d, Allocate(req_id=rid, token_ids=tokens, max_tokens=MAX_TOKENS, ignore_eos=True))
        (alloc,) = self.wait_for((Allocated, Rejected), req_id=rid)
        assert isinstance(alloc, Allocated), alloc
        self.to(p, Prefill(req_id=rid, token_ids=tokens, decode_id=d.instance_id,
                           decode_block_ids=alloc.block_ids))

    def collect(self, rid: str) -> tuple[list[int], dict]:
        """(generated tokens, D's first Tokens' kvflow dict); raises on an error."""
        out, kv = [], None
        while True:
            (msg,) = self.wait_for((Tokens, Rejected), req_id=rid)
            assert isinstance(msg, Tokens) and not msg.error, msg
            if kv is None and "blocks" in msg.kvflow:  # D's (P's first token carries no blocks)
                kv = msg.kvflow
            out.append((msg.index, msg.token_ids))  # P's token and D's, either way round
            if msg.finished and len(out) > 1:
                return [t for _, ids in sorted(out) for t in ids], kv

    def free(self) -> list[int]:
        return [i.allocator.num_free for i in self.ps + self.ds]

    def blocks_back(self, timeout: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while self.free() != self.free0 and time.monotonic() < deadline:
            self.pump()
        return self.free()




def colocated(model, tokens: list[int]) -> list[int]:
    """Greedy tokens of one engine doing prefill and decode in one cache (the reference)."""
    eng = Engine(model, PagedKVCache(model.kv_spec(BLOCK), 16))
    table = list(range(-(-(len(tokens) + MAX_TOKENS) // BLOCK)))
    out = [sample_token(eng.prefill(tokens, table), 0.0, 0, 0)]
    while len(out) < MAX_TOKENS:
        out.append(sample_token(eng.decode([(out[-1], len(tokens) + len(out) - 1, table)])[0],
                                0.0, 0, len(out)))
    return out


TRANSFERS = [("ipc-pull", "request"), ("ipc-pull", "layerwise"), ("ipc-push", "layerwise"),
             ("ipc-push", "request"), ("tcp", "request"), ("tcp", "layerwise")]


@pytest.mark.parametrize("n_p,n_d", [(1, 2), (2, 2)])
@pytest.mark.parametrize("connector,mode", TRANSFERS, ids=["-".join(t) for t in TRANSFERS])
def test_every_request_lands_on_the_d_the_router_chose(connector, mode, n_p, n_d):
    """Requests to every (P, D) combination, all in flight at once (each P's queue holds
    requests for both D's): each D decodes exactly its own requests, token-identical to
    colocated; then every block is free on every instance."""
    mesh = Mesh(n_p, n_d, connector, mode)
    try:
        combos = list(itertools.product(mesh.ps, mesh.ds)) * 2
        for i, (p, d) in enumerate(combos):
            mesh.submit(f"r{i}", prompt(i), p, d)
        for i, (p, d) in enumerate(combos):
            out, kv = mesh.collect(f"r{i}")
            assert (kv["prefill_instance"], kv["decode_instance"]) == (p.instance_id, d.instance_id)
            assert out == colocated(mesh.ds[0].model, prompt(i)), (i, p.instance_id, d.instance_id)
        assert mesh.blocks_back() == mesh.free0
    finally:
        mesh.close()


@pytest.mark.parametrize("connector,mode", [("ipc-push", "layerwise"), ("tcp", "layerwise")])
def test_unpaired_d_is_refused_and_only_its_link_goes(connector, mode):
    mesh = Mesh(1, 2, connector, mode)
    (p,), (d0, d1) = mesh.ps, mesh.ds
    try:
        rid = "to-nowhere"
        mesh.to(p, Prefill(req_id=rid, token_ids=prompt(0), decode_id="d-404-000000",
                           decode_block_ids=[0, 1]))
        (rej,) = mesh.wait_for(Rejected, req_id=rid)
        assert rej.kind == "error" and rej.error == (
            f"prefill instance {p.instance_id} is not paired with decode instance 'd-404-000000' "
            f"(paired: {sorted([d0.instance_id, d1.instance_id])})")
        mesh.to(p, Unpair(peer_id=d1.instance_id, reason="decode instance died"))
        mesh.submit("a", prompt(1), p, d0)
        assert mesh.collect("a")[0] == colocated(d0.model, prompt(1))  # the other D still served
        mesh.to(d1, Allocate(req_id="b", token_ids=prompt(2), max_tokens=MAX_TOKENS))
        (alloc,) = mesh.wait_for(Allocated, req_id="b")
        mesh.to(p, Prefill(req_id="b", token_ids=prompt(2), decode_id=d1.instance_id,
                           decode_block_ids=alloc.block_ids))
        (rej,) = mesh.wait_for(Rejected, req_id="b")
        assert rej.error == (f"prefill instance {p.instance_id} is not paired with decode "
                             f"instance {d1.instance_id!r} (paired: {[d0.instance_id]})")
        assert list(p.connector.links) == [d0.instance_id] and list(p.lease_links) == [d0.instance_id]
        assert len(p.sockets) == 3  # router + d0's link + d0's lease link
        if connector == "ipc-push":
            assert list(p.connector.peers) == [d0.instance_id]
        if p.connector.layerwise_enabled and connector != "ipc-push":
            assert list(p.connector.layerwise.socks) == [d0.instance_id]
        from kvflow.serve.protocol import Abort
        mesh.to(d1, Abort(req_id="b", prefill_sent=False))   # the router's clean-up
        mesh.pair(p, d1)                                      # d1 registered again: paired anew
        assert all(r.ok for r in mesh.wait_for(PairResult, 2))
        mesh.submit("c", prompt(3), p, d1)
        assert mesh.collect("c")[0] == colocated(d1.model, prompt(3))
        assert mesh.blocks_back() == mesh.free0
    finally:
        mesh.close()


# ---- the router's choice of (P, D) ----------------------------------------------------------
def _controller(n_p: int, n_d: int, free: list[int], refused=()):
    """A Controller holding ``n_p`` P's and ``n_d`` D's (D ``j`` with ``free[j]`` free blocks),
    every pair accepted by both sides except ``refused`` ((p index, d index) pairs)."""
    from kvflow.serve.router.control import Controller, InstanceInfo
    ctl = Controller()
    def info(iid, role, nfree):
        reg = Register(instance_id=iid, role=role, spec={}, num_blocks=40, free_blocks=nfree,
                       max_model_len=256, kv_connector="ipc-pull", pid=1)
        return InstanceInfo(reg, iid.encode(), 0.0, nfree)
    ps = [info(f"p-{i}", "prefill", 40) for i in range(n_p)]
    ds = [info(f"d-{j}", "decode", free[j]) for j in range(n_d)]
    for (i, p), (j, d) in itertools.product(enumerate(ps), enumerate(ds)):
        if (i, j) not in refused:
            p.pair_ok.add(d.id)
            d.pair_ok.add(p.id)
    ctl.instances = {x.id: x for x in ps + ds}
    return ctl


def _picks(ctl, n: int) -> list[tuple[str, str]]:
    return [(p.id, d.id) for p, d in (ctl.pick() for _ in range(n))]


def test_router_spreads_over_every_p_and_d_and_prefers_free_blocks():
    import asyncio

    from kvflow.serve.router.control import ReqState
    ctl = _controller(2, 2, [40, 40])
    try:
        assert sorted(set(_picks(ctl, 4))) == [("p-0", "d-0"), ("p-0", "d-1"), ("p-1", "d-0"),
                                               ("p-1", "d-1")]
        ctl.instances["d-0"].free_blocks = 30  # d-1 has more room: every request goes there,
        picks = _picks(ctl, 4)                 # still spread over both P's
        assert {d for _, d in picks} == {"d-1"} and sorted({p for p, _ in picks}) == ["p-0", "p-1"]
        ctl.instances["d-0"].free_blocks = 40  # equal room: the D with fewer requests in flight,
        ctl.requests["x"] = ReqState(asyncio.Queue(), prefill_id="p-1", decode_id="d-0",
                                     stage="prefilling")  # and the P with fewer prefills
        assert _picks(ctl, 2) == [("p-0", "d-1")] * 2
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()


def test_router_picks_only_pairs_both_sides_accepted():
    ctl = _controller(2, 2, [40, 40], refused={(1, 1)})
    try:
        picks = _picks(ctl, 8)
        assert ("p-1", "d-1") not in picks and {d for _, d in picks} == {"d-0", "d-1"}
        assert {p for p, d in picks if d == "d-1"} == {"p-0"}
    finally:
        ctl.sock.close(0)
        ctl.ctx.term()
