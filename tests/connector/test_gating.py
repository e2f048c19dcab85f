"""Profile-mode gating: no channel, no signal, no send inside profile / dummy runs, with the
real engine's profile run and prefill hooked to the signal channel and a worker thread."""

from __future__ import annotations

import glob
import secrets
import threading
import time

import pytest

from kvflow.context import forward_context
from kvflow.kernels import copy_blocks
from kvflow.connector.layerwise import LayerwiseScheduler, LayerwiseWorker
from kvflow.signal import STATS, LayerSignaller, SignalChannel

engine_mod = pytest.importorskip("kvflow.engine")
model_mod = pytest.importorskip("kvflow.model")
from kvflow.model.llama import init_random_  # noqa: E402

from tests.conftest import assert_bytes_equal, cache_bytes  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
           intermediate_size=48, max_position_embeddings=64)


def _segments(iid: str) -> list[str]:
    return glob.glob(f"/dev/shm/kvflow-sig-{iid}-*")


def test_create_and_signal_are_no_ops_inside_a_profile_run():
    iid = "t_" + secrets.token_hex(4)
    before = (STATS.written, STATS.suppressed, STATS.creates_suppressed)
    sig = LayerSignaller(iid, num_layers=2)
    assert sig.signal(0, 1) is False  # before init: a no-op (nothing to write to)
    with forward_context(is_dummy_or_profile_run=True):
        assert SignalChannel.create(iid, 2) is None
        assert sig.init() is None
        assert sig.signal(1, 1) is False
    assert _segments(iid) == []
    assert (sig.stats.written, sig.stats.suppressed, sig.stats.creates_suppressed) == (0, 2, 1)
    assert (STATS.written - before[0], STATS.suppressed - before[1],
            STATS.creates_suppressed - before[2]) == (0, 2, 2)
    ch = sig.init()
    try:
        assert _segments(iid) == [ch.segment.path]
        with forward_context(is_dummy_or_profile_run=True):
            assert ch.signal(0, 3) is False and sig.signal(0, 3) is False
        assert ch.steps().tolist() == [-1, -1] and ch.count(0) == 0
        assert sig.signal(0, 3) is True and ch.steps().tolist() == [3, -1]
    finally:
        sig.close()
    assert _segments(iid) == []


def _engine(num_blocks: int = 16):
    model = init_random_(model_mod.LlamaForCausalLM(model_mod.ModelConfig(**CFG)), seed=5)
    from kvflow import PagedKVCache
    return engine_mod.Engine(model, PagedKVCache(model.kv_spec(block_size=4), num_blocks))


class _PD:
    """P engine + signaller + worker + scheduler sending into D's cache with copy_blocks."""

    def __init__(self):
        self.p, self.d = _engine(), _engine()
        self.iid = "t_" + secrets.token_hex(4)
        self.sig = LayerSignaller(self.iid, num_layers=CFG["num_layers"])
        self.sends, self.done = [], threading.Event()
        self.sched = LayerwiseScheduler(CFG["num_layers"], 4, self._send,
                                        on_done=lambda rid: self.done.set())
        self.step = 0

    def _send(self, rid, layers, src, dst):
        self.sends.append((rid, layers))
        copy_blocks(self.p.cache, self.d.cache, src, dst, layers=layers, backend="torch")

    def start(self):
        ch = self.sig.init()
        self.worker = LayerwiseWorker(self.sched, ch, poll_s=0.02, signal_timeout_s=10).start()

    def prefill(self, rid, tokens, p_table, d_table, chunk):
        self.sched.add_request(rid, len(tokens), p_table)
        for start in range(0, len(tokens), chunk):
            end = min(start + chunk, len(tokens))
            self.step += 1
            self.sched.add_chunk(rid, self.step, end)
            if start == chunk:
                self.sched.set_dst_blocks(rid, d_table)  # D's ids arrive mid-prefill
            hook = self.sig.layer_hook(self.step)
            logits = self.p.prefill(tokens[:end], p_table, num_computed_tokens=start,
                                    on_chunk=lambda s, e, hook=hook: hook)
        return logits

    def close(self):
        assert self.worker.stop(2.0)
        self.sig.close()


def _greedy(engine, first: int, pos: int, table: list[int], n: int) -> list[int]:
    out, tok = [], first
    for i in range(n):
        logits = engine.decode([(tok, pos + i, table)])
        tok = int(logits[0].argmax())
        out.append(tok)
    return out


def _run_pd():
    """Profile run, real chunked prefill transferred to D, D decodes, then a dummy run."""
    pd = _PD()
    t0 = time.perf_counter()
    with forward_context(is_dummy_or_profile_run=True):
        pd.sig.init()  # the server's set-up during start-up: refused
    peak = pd.p.profile_run(32)  # with signalling wired up: bounded, silent
    assert peak > 0 and time.perf_counter() - t0 < 30
    assert pd.sig.channel is None and _segments(pd.iid) == [] and pd.sends == []
    assert pd.sig.stats.written == 0
    pd.start()
    try:
        tokens = [(7 * i + 3) % 64 for i in range(14)]
        p_table, d_table = [3, 9, 1, 12], [15, 2, 8, 4]
        logits = pd.prefill("a", tokens, p_table, d_table, chunk=5)
        assert pd.done.wait(10), f"transfer did not finish: {pd.sched.stats}"
        assert pd.sig.stats.written == 3 * CFG["num_layers"]  # 3 chunks x layers
        for tp, td in zip(pd.p.cache.tensors(), pd.d.cache.tensors()):
            assert_bytes_equal(td[d_table], tp[p_table], "D's blocks vs P's")
        first = int(logits.argmax())
        d_tokens = _greedy(pd.d, first, len(tokens), d_table + [10], 4)
        assert d_tokens == _greedy(pd.p, first, len(tokens), p_table + [11], 4)
        # a dummy run after real traffic: no signal written, nothing sent
        steps, sends = pd.sig.channel.steps().tolist(), list(pd.sends)
        with forward_context(is_dummy_or_profile_run=True):
            hook = pd.sig.layer_hook(pd.step + 1)
            pd.p.prefill(tokens[:8], [5, 6], on_chunk=lambda s, e: hook)
            pd.sched.on_layer_signal(0, pd.step + 1)
        assert pd.sig.channel.steps().tolist() == steps
        assert pd.sig.stats.suppressed == CFG["num_layers"]
        assert pd.sends == sends and pd.worker.errors == []
    finally:
        pd.close()
    return cache_bytes(pd.d.cache), d_tokens, pd.sends


def test_layerwise_transfer_token_identical_on_the_engine():
    _, _, sends = _run_pd()  # D's blocks equal P's, and D decodes P's tokens (in _run_pd)
    assert len(sends) > 1 and {layer for _, layers in sends for layer in layers} == \
        set(range(CFG["num_layers"]))


def test_worker_times_out_a_request_whose_layers_never_come():
    errors = []
    with SignalChannel.create("t_" + secrets.token_hex(4), 2) as ch:
        sched = LayerwiseScheduler(2, 4, lambda *a: None)
        sched.add_request("a", 4, [1])
        sched.add_chunk("a", 7, 4)
        ch.signal(0, 7)  # layer 1 never signalled
        worker = LayerwiseWorker(sched, ch, poll_s=0.02, signal_timeout_s=0.2,
                                 on_error=lambda rid, e: errors.append((rid, e))).start()
        deadline = time.perf_counter() + 10
        while not errors and time.perf_counter() < deadline:
            time.sleep(0.01)
        t0 = time.perf_counter()
        assert worker.stop(2.0) and time.perf_counter() - t0 < 1.0
    assert len(errors) == 1 and isinstance(errors[0][1], TimeoutError)
    assert str(errors[0][1]) == (f"request 'a': no signal for layer 1 of step 7 on segment "
                                 f"'{ch.name}' within 0.2 s; aborted")
    assert sched.pending_requests() == []
