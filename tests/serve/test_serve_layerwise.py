"""Layerwise transfer in the served path, in process: a real PrefillInstance (P) and
DecodeInstance (D) driven by a hand-run event loop, with this test as the router.

For prompts of 1..300 tokens, chunked prefill (64-token chunks: up to 5 per prompt), both
transfers (ipc, tcp) and both modes (layerwise, request): greedy tokens equal a colocated
engine's; D's prompt KV is byte-identical to the colocated engine's (so the two modes fill D's
cache identically); payload bytes = blocks x bytes_per_block. Profile/dummy gating: no channel
before pairing, no signal and no message from the profile run, the warm-up or a dummy run after
real traffic. A layer that is never signalled fails the request with a TimeoutError message and
both sides get their blocks back.
"""

from __future__ import annotations

import time

import pytest
import torch

import kvflow.engine
from kvflow.context import forward_context
from kvflow.engine import Engine
from kvflow.model import load_model
from kvflow.serve.protocol import (Abort, Allocate, Allocated, PairResult, Prefill, Register,
                                   Rejected, Tokens)
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.launch.config import ServeConfig
from kvflow.serve.instance.sampling import sample_token
from kvflow.serve.instance.prefill import PrefillInstance
from kvflow.signal import STATS

from tests.fake_router import FakeRouter

LENGTHS = [1, 15, 16, 17, 65, 150, 300]
CHUNK, BLOCK, MAX_TOKENS = 64, 16, 5
ALWAYS, NEVER = 0, 10**9  # layerwise_min_tokens: every prompt layerwise / every prompt request


def prompt(n: int) -> list[int]:
    return [(37 * i + 11) % 256 for i in range(n)]


class Harness(FakeRouter):
    """P + D + a router socket; :meth:`pump` runs one iteration of both instances' loops."""

    def __init__(self, connector: str, profile_hook=None, **extra) -> None:
        super().__init__()
        extra.setdefault("layerwise_min_tokens", ALWAYS)

        def cfg(role, **kw):
            return ServeConfig(role=role, router_url=self.addr, kv_connector=connector,
                               block_size=BLOCK, max_model_len=512, memory_budget_mb=24,
                               max_num_batched_tokens=CHUNK, **extra, **kw)

        self.p, self.d = PrefillInstance(cfg("prefill")), DecodeInstance(cfg("decode", num_blocks=96))
        self.p.startup()
        if profile_hook:
            profile_hook(self)
        self.d.startup()
        self.regs = {m.instance_id: m for m in self.wait_for(Register, 2)}
        self.pair(self.p, self.d)
        assert all(r.ok for r in self.wait_for(PairResult, 2))
        self.free0 = (self.p.allocator.num_free, self.d.allocator.num_free)

    def instances(self) -> list:
        return [self.p, self.d]

    def request(self, rid: str, tokens: list[int], min_tokens: int = ALWAYS):
        """(generated token ids, kvflow dict of D's first Tokens, D's prompt KV bytes)."""
        self.p.connector.layerwise_min_tokens = min_tokens
        self.to(self.d, Allocate(req_id=rid, token_ids=tokens, max_tokens=MAX_TOKENS, ignore_eos=True))
        (alloc,) = self.wait_for((Allocated, Rejected), req_id=rid)
        assert isinstance(alloc, Allocated), alloc
        self.to(self.p, Prefill(req_id=rid, token_ids=tokens, decode_id=self.d.instance_id,
                                decode_block_ids=alloc.block_ids))
        out, first, kv = [], None, None
        while True:
            (msg,) = self.wait_for((Tokens, Rejected), req_id=rid)
            if isinstance(msg, Rejected) or msg.error:
                return msg, None, None
            if first is None and "blocks" in msg.kvflow:  # D's (P's token carries no blocks)
                first, kv = msg.kvflow, prompt_kv(self.d.cache, alloc.block_ids, len(tokens))
            out.append((msg.index, msg.token_ids))  # P's token and D's, either way round
            if msg.finished and len(out) > 1:
                return [t for _, ids in sorted(out) for t in ids], first, kv

    def blocks_back(self, timeout: float = 10.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while (self.p.allocator.num_free, self.d.allocator.num_free) != self.free0 \
                and time.monotonic() < deadline:
            self.pump()
        return self.p.allocator.num_free, self.d.allocator.num_free




def prompt_kv(cache, table: list[int], n: int) -> list[torch.Tensor]:
    """Bytes of the prompt's K/V (token positions 0..n-1 only) of every layer, NHD."""
    nb = cache.spec.num_blocks_for(n)
    return [t[table[:nb]].flatten(0, 1)[:n].view(torch.uint8).clone() for t in cache.tensors()]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """P, D and the reference share this process: one BLAS thread each is 10x faster on a busy
    2-core machine than two threads fighting (and every engine here computes alike)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def colocated():
    """Greedy tokens and prompt KV of one engine doing prefill (same chunks) + decode."""
    from kvflow import PagedKVCache
    model, _ = load_model("kvflow-tiny")
    spec = model.kv_spec(BLOCK)
    eng = Engine(model, PagedKVCache(spec, 32))
    out = {}
    for n in LENGTHS:
        toks, table = prompt(n), list(range(spec.num_blocks_for(n + MAX_TOKENS)))
        logits = eng.prefill(toks, table, chunk_size=CHUNK)
        kv = prompt_kv(eng.cache, table, n)
        gen = [sample_token(logits, 0.0, 0, 0)]
        for i in range(1, MAX_TOKENS):
            gen.append(sample_token(eng.decode([(gen[-1], n + i - 1, table)])[0], 0.0, 0, i))
        out[n] = (gen, kv)
    return out


@pytest.fixture(scope="module", params=["ipc-pull", "tcp"])
def harness(request):
    h = Harness(request.param)
    yield h
    h.close()


def test_layerwise_and_request_token_and_byte_identical_to_colocated(harness, colocated):
    h, spec = harness, harness.p.spec
    for mode, min_tokens in (("layerwise", ALWAYS), ("request", NEVER)):
        parts0 = h.p.connector.layerwise.messages_sent
        for n in LENGTHS:
            got, kv, d_kv = h.request(f"{mode}-{n}", prompt(n), min_tokens)
            want, want_kv = colocated[n]
            assert got == want, (mode, n)
            assert kv["layerwise"] == (mode == "layerwise") and kv["kv_connector"] == h.p.cfg.kv_connector
            blocks = spec.num_blocks_for(n)
            assert (kv["blocks"], kv["payload_bytes"]) == (blocks, blocks * spec.bytes_per_block)
            for layer, (a, b) in enumerate(zip(d_kv, want_kv)):
                assert torch.equal(a, b), f"{mode} n={n}: D's prompt KV tensor {layer} differs"
        parts = h.p.connector.layerwise.messages_sent - parts0
        if mode == "request":
            assert parts == 0
        else:  # >= one part + the last message per request; chunked prompts send more parts
            assert parts > 2 * len(LENGTHS)
        assert h.blocks_back() == h.free0
    stats = h.p.connector.layerwise.scheduler.stats
    assert (stats.errors, stats.duplicate, stats.stale) == (0, 0, 0)
    assert h.p.connector.layerwise.scheduler.pending_requests() == [] and len(h.d.receiver.parts) == 0


def test_every_block_layer_goes_exactly_once_in_full_blocks_per_chunk(harness):
    """A 150-token prompt in 64-token chunks: parts are [0,4) after chunk 1, [4,8) after chunk
    2, then [8,10) (8 full + the partial last block) after the last; each layer once."""
    h = harness
    sent = []
    real = h.p.connector.send_part

    def spy(link, cache, src, layers, **fields):
        sent.append((fields["block_offset"], len(src), layers))
        return real(link, cache, src, layers, **fields)

    h.p.connector.send_part = spy
    try:
        got, kv, _ = h.request("exact-once", prompt(150))
    finally:
        del h.p.connector.send_part
    assert kv["layerwise"] is True
    L = h.p.spec.num_layers
    seen = torch.zeros(L, 10, dtype=torch.int32)
    for off, k, layers in sent:
        seen[layers.start:layers.stop, off:off + k] += 1
    assert torch.equal(seen, torch.ones(L, 10, dtype=torch.int32))
    assert sorted({(off, k) for off, k, _ in sent}) == [(0, 4), (4, 4), (8, 2)]
    assert h.blocks_back() == h.free0


def test_missing_layer_signal_fails_the_request_and_frees_blocks_on_both_sides(harness):
    h = harness
    lw = h.p.connector.layerwise
    lw.worker.signal_timeout_s = 0.5
    real = lw.signaller.signal
    lw.signaller.signal = lambda layer, step: False if layer == 1 else real(layer, step)
    t0 = time.monotonic()
    try:
        msg, _, _ = h.request("lost-signal", prompt(40))
    finally:
        lw.signaller.signal = real
        lw.worker.signal_timeout_s = 30.0
    assert time.monotonic() - t0 < 10
    assert isinstance(msg, Rejected) and msg.kind == "transfer"
    assert msg.error.startswith(f"layerwise KV transfer of lost-signal from {h.p.instance_id} "
                                f"failed: request 'lost-signal': no signal for layer 1 of step ")
    assert msg.error.endswith(f"on segment '{lw.signaller.channel.name}' within 0.5 s; aborted")
    h.to(h.d, Abort(req_id="lost-signal", reason="router ended the request"))
    h.to(h.p, Abort(req_id="lost-signal", reason="router ended the request"))
    assert h.blocks_back() == h.free0
    assert len(h.d.receiver.parts) == 0 and lw.scheduler.pending_requests() == []
    got, kv, _ = h.request("after-failure", prompt(40))  # the instance serves on
    assert kv["layerwise"] is True and len(got) == MAX_TOKENS
    assert h.blocks_back() == h.free0


def test_profile_warmup_and_dummy_runs_signal_and_send_nothing(monkeypatch):
    seen = {}
    real_dnb = kvflow.engine.determine_num_blocks

    def profiled(*a, **k):
        before = (STATS.written, STATS.suppressed)
        n = real_dnb(*a, **k)
        seen["profile"] = (STATS.written - before[0], STATS.suppressed - before[1])
        return n

    def after_p_startup(h):
        lw = h.p.connector.layerwise
        # the profile run sized P (no --num-blocks); the warm-up dummy prefill ran its hooks
        seen["startup"] = (lw.signaller.channel, lw.signaller.stats.written,
                           lw.signaller.stats.suppressed, lw.messages_sent, lw.worker)

    monkeypatch.setattr(kvflow.engine, "determine_num_blocks", profiled)
    w0 = STATS.written
    h = Harness("tcp", profile_hook=after_p_startup)
    try:
        lw = h.p.connector.layerwise
        assert seen["profile"] == (0, 0)
        channel, written, suppressed, sent, worker = seen["startup"]
        layers = h.p.spec.num_layers
        assert channel is None and worker is None and written == 0 and sent == 0
        assert suppressed == 2 * layers  # warm-up: 32 tokens in two chunks, every layer refused
        assert lw.signaller.channel is not None  # created at pairing
        got, kv, _ = h.request("real", prompt(100))
        assert kv["layerwise"] is True
        assert lw.signaller.stats.written == 2 * layers  # 2 chunks x layers
        steps, p_sent = lw.signaller.channel.steps().tolist(), lw.messages_sent
        arrived = []
        monkeypatch.setattr(h.d, "on_data", lambda msg, *a: arrived.append(type(msg).__name__))
        h.p.connector.dummy_run(h.p.engine, CHUNK, 48)  # a dummy run after real traffic
        for _ in range(20):
            h.pump()
        assert lw.signaller.channel.steps().tolist() == steps
        assert lw.signaller.stats.written == 2 * layers and STATS.written - w0 == 2 * layers
        assert lw.signaller.stats.suppressed == suppressed + 2 * layers  # 48 tokens, 2 chunks
        assert lw.messages_sent == p_sent and lw.scheduler.pending_requests() == []
        assert arrived == [] and h.d.seqs == {}
        monkeypatch.undo()
        with forward_context(is_dummy_or_profile_run=True):
            assert lw.open(h.ctx, "tcp://127.0.0.1:1", "d-x") is False  # refused in a dummy run
        assert h.blocks_back() == h.free0
    finally:
        h.close()
    assert lw.signaller.channel is None  # segment removed at close


def test_a_threshold_past_every_prompt_reaches_the_instances():
    from kvflow.serve.__main__ import parse_args
    from kvflow.serve.launch.server import instance_config
    args = parse_args(["--layerwise-min-tokens", str(NEVER)])
    assert instance_config(args, "prefill", "tcp://127.0.0.1:1").layerwise_min_tokens == NEVER
    assert parse_args([]).layerwise_min_tokens is None


@pytest.mark.parametrize("connector", ["ipc-pull", "tcp"])
def test_threshold_above_max_model_len_creates_nothing_layerwise(connector):
    """Default threshold (16384) > max_model_len (512): no signal segment, no worker thread,
    no layerwise socket, yet requests are served (after the prefill)."""
    import os
    import threading

    from kvflow.segments import SHM_DIR
    segs, threads = set(os.listdir(SHM_DIR)), set(threading.enumerate())
    h = Harness(connector, layerwise_min_tokens=None)
    try:
        assert h.p.connector.layerwise_min_tokens == 16384 and h.p.connector.layerwise is None
        assert not [t for t in set(threading.enumerate()) - threads if t.name == "kvflow-layerwise"]
        assert not [s for s in set(os.listdir(SHM_DIR)) - segs if s.startswith("kvflow-sig-")]
        # the router's, D's link and D's lease link: no layerwise socket
        assert sorted(h.p.sockets.values()) == ["decode " + h.d.instance_id,
                                                "decode " + h.d.instance_id + " leases", "router"]
        got, kv, _ = h.request("after", prompt(100), 16384)
        assert kv["layerwise"] is False and len(got) == MAX_TOKENS
        assert h.blocks_back() == h.free0
    finally:
        h.close()
