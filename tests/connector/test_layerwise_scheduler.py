"""Layerwise scheduler: which blocks of which layers are sent when, exactly once."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.context import forward_context
from kvflow.kernels import copy_blocks
from kvflow.connector.layerwise import LayerwiseScheduler

from tests.conftest import assert_bytes_equal, cache_bytes, random_cache


class Recorder:
    def __init__(self):
        self.calls = []
        self.done = []

    def __call__(self, rid, layers, src, dst):
        self.calls.append((rid, (layers.start, layers.stop), list(src), list(dst)))


def sched(L=3, bs=4, **kw) -> tuple[LayerwiseScheduler, Recorder]:
    rec = Recorder()
    s = LayerwiseScheduler(L, bs, rec, on_done=rec.done.append, **kw)
    return s, rec


def test_one_chunk_sends_each_layer_once_with_partial_last_block():
    s, rec = sched()
    assert s.add_request("a", 10, [7, 8, 9]) is None
    s.set_dst_blocks("a", [0, 1, 2])
    s.add_chunk("a", step=1, end_token=10)
    for layer in range(3):
        assert s.on_layer_signal(layer, 1) == 1
    assert rec.calls == [("a", (l, l + 1), [7, 8, 9], [0, 1, 2]) for l in range(3)]
    assert rec.done == ["a"] and s.pending_requests() == []
    assert (s.stats.sends, s.stats.block_layers, s.stats.signals) == (3, 9, 3)


def test_chunked_prefill_sends_full_blocks_then_the_rest():
    s, rec = sched(L=2)
    s.add_request("a", 10, [5, 6, 7])
    s.set_dst_blocks("a", [1, 2, 3])
    s.add_chunk("a", step=1, end_token=6)  # block 0 full, block 1 half
    s.on_layer_signal(0, 1)
    s.add_chunk("a", step=2, end_token=10)
    s.on_layer_signal(1, 1)
    s.on_layer_signal(0, 2)
    s.on_layer_signal(1, 2)
    assert rec.calls == [("a", (0, 1), [5], [1]), ("a", (1, 2), [5], [1]),
                         ("a", (0, 1), [6, 7], [2, 3]), ("a", (1, 2), [6, 7], [2, 3])]
    assert rec.done == ["a"]


def test_signal_that_skips_steps_covers_the_steps_before():
    s, rec = sched(L=1)
    s.add_request("a", 12, [0, 1, 2])
    s.set_dst_blocks("a", [3, 4, 5])
    s.add_chunk("a", 1, 4)
    s.add_chunk("a", 2, 8)
    s.add_chunk("a", 3, 12)
    s.on_layer_signal(0, 3)  # the reader saw only the latest step
    assert rec.calls == [("a", (0, 1), [0, 1, 2], [3, 4, 5])]


def test_early_signals_are_buffered_and_replayed_in_one_send():
    s, rec = sched()
    s.add_request("a", 8, [4, 5])
    s.add_chunk("a", 3, 8)
    for layer in (2, 0, 1):
        assert s.on_layer_signal(layer, 3) == 0
    assert rec.calls == [] and s.stats.buffered == 3
    s.set_dst_blocks("a", [0, 1])
    assert rec.calls == [("a", (0, 3), [4, 5], [0, 1])]
    assert s.stats.replayed == 1 and rec.done == ["a"]


def test_signal_before_chunk_registration_counts_when_chunk_arrives():
    s, rec = sched(L=1)
    s.add_request("a", 4, [9])
    s.set_dst_blocks("a", [2])
    s.on_layer_signal(0, 5)
    assert rec.calls == [] and s.stats.unmatched == 1
    s.add_chunk("a", 5, 4)
    assert rec.calls == [("a", (0, 1), [9], [2])]


def test_out_of_order_duplicate_and_stale_signals():
    s, rec = sched()
    s.add_request("a", 8, [4, 5])
    s.set_dst_blocks("a", [0, 1])
    s.add_chunk("a", 2, 8)
    assert s.on_layer_signal(2, 2) == 1
    assert s.on_layer_signal(2, 2) == 0  # duplicate
    assert s.on_layer_signal(2, 1) == 0  # stale
    assert s.on_layer_signal(0, 2) == 1
    assert s.on_layer_signal(1, 2) == 1
    assert [c[1] for c in rec.calls] == [(2, 3), (0, 1), (1, 2)]
    assert (s.stats.duplicate, s.stats.stale, s.stats.sends) == (1, 1, 3)


def test_signals_of_finished_or_aborted_requests_are_dropped():
    s, rec = sched(L=2)
    s.add_request("a", 8, [4, 5])
    s.add_chunk("a", 1, 8)
    s.set_dst_blocks("a", [0, 1])
    s.on_layer_signal(0, 1)
    assert s.abort("a") is True and s.abort("a") is False
    assert s.on_layer_signal(1, 1) == 0
    assert len(rec.calls) == 1 and s.stats.unmatched == 1 and rec.done == []
    with pytest.raises(KeyError, match="request_id='a' is not registered"):
        s.add_chunk("a", 2, 8)


def test_two_requests_in_one_step():
    s, rec = sched(L=1)
    s.add_request("a", 4, [1])
    s.add_request("b", 8, [2, 3])
    s.set_dst_blocks("b", [6, 7])
    s.add_chunk("a", 1, 4)
    s.add_chunk("b", 1, 8)
    assert s.on_layer_signal(0, 1) == 1  # b; a waits for its ids
    s.set_dst_blocks("a", [5])
    assert sorted(rec.calls) == [("a", (0, 1), [1], [5]), ("b", (0, 1), [2, 3], [6, 7])]


def test_nothing_sent_inside_a_dummy_run():
    s, rec = sched(L=1)
    s.add_request("a", 4, [1])
    s.add_chunk("a", 1, 4)
    with forward_context(is_dummy_or_profile_run=True):
        assert s.on_layer_signal(0, 1) == 0
        s.set_dst_blocks("a", [0])
    assert rec.calls == [] and s.stats.suppressed == 1
    s.on_layer_signal(0, 1)  # the real signal afterwards still works
    assert rec.calls == [("a", (0, 1), [1], [0])]


def test_send_error_aborts_the_request():
    errors = []

    def bad_send(*a):
        raise ConnectionError("peer gone")

    s = LayerwiseScheduler(2, 4, bad_send, on_error=lambda rid, e: errors.append((rid, str(e))))
    s.add_request("a", 4, [1])
    s.set_dst_blocks("a", [0])
    s.add_chunk("a", 1, 4)
    assert s.on_layer_signal(0, 1) == 0
    assert errors == [("a", "peer gone")] and s.pending_requests() == [] and s.stats.errors == 1
    s2 = LayerwiseScheduler(1, 4, bad_send)
    s2.add_request("b", 4, [1])
    s2.set_dst_blocks("b", [0])
    s2.add_chunk("b", 1, 4)
    with pytest.raises(ConnectionError, match="peer gone"):
        s2.on_layer_signal(0, 1)


@pytest.mark.parametrize("call, message", [
    (lambda s: s.add_request("a", 9, [1, 2]), "src_block_ids has 2 blocks; 9 tokens in blocks of 4 need 3"),
    (lambda s: s.add_request("a", 0, []), "num_tokens must be a positive int, got 0"),
    (lambda s: s.add_request("a", 4, [-1]), "src_block_ids must be non-negative block ids, got [-1]"),
    (lambda s: (s.add_request("a", 4, [1]), s.add_request("a", 4, [1])), "request_id='a' is already registered"),
    (lambda s: (s.add_request("a", 8, [1, 2]), s.set_dst_blocks("a", [3])),
     "dst_block_ids has 1 blocks; request 'a' has 2 on P"),
    (lambda s: (s.add_request("a", 8, [1, 2]), s.set_dst_blocks("a", [3, 3])),
     "dst_block_ids repeats a block: [3, 3]"),
    (lambda s: (s.add_request("a", 8, [1, 2]), s.add_chunk("a", 1, 9)), "end_token must be in (0, 8], got 9"),
    (lambda s: (s.add_request("a", 8, [1, 2]), s.add_chunk("a", 1, 4), s.add_chunk("a", 1, 8)),
     "step must be an int after the previous chunk's step 1, got 1"),
    (lambda s: s.on_layer_signal(3, 0), "layer must be an int in [0, 3), got 3"),
])
def test_bad_input_messages(call, message):
    s, _ = sched()
    with pytest.raises(ValueError) as e:
        call(s)
    assert str(e.value) == message


def test_constructor_messages():
    with pytest.raises(ValueError, match=r"^num_layers must be a positive int, got True$"):
        LayerwiseScheduler(True, 4, print)
    with pytest.raises(ValueError, match=r"^block_size must be a positive int, got 0$"):
        LayerwiseScheduler(2, 0, print)
    with pytest.raises(TypeError, match=r"^send must be callable, got 3$"):
        LayerwiseScheduler(2, 4, 3)


def _transfer(order_seed: int):
    """Chunked prefill of two requests on P (random bytes), layer signals in a shuffled order,
    D's ids arriving midway; copy_blocks as the send. Returns (D cache, P cache, sends)."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.bfloat16, layout="HND")
    p, d = random_cache(spec, 16, seed=3), PagedKVCache(spec, 16)
    sent = []

    def send(rid, layers, src, dst):
        sent.append((rid, layers))
        copy_blocks(p, d, src, dst, layers=layers, backend="torch")

    s = LayerwiseScheduler(4, 4, send)
    s.add_request("a", 14, [3, 9, 1, 12])
    s.add_request("b", 5, [0, 7])
    rng = random.Random(order_seed)
    plan = {1: [("a", 6), ("b", 5)], 2: [("a", 11)], 3: [("a", 14)]}
    for step, chunks in plan.items():
        for rid, end in chunks:
            s.add_chunk(rid, step, end)
        layers = list(range(4))
        rng.shuffle(layers)
        for layer in layers:
            s.on_layer_signal(layer, step)
        if step == 2:
            s.set_dst_blocks("a", [15, 2, 8, 4])
            s.set_dst_blocks("b", [5, 6])
    assert s.pending_requests() == []
    return d, p, sent


def test_two_signal_orders_give_byte_identical_decode_caches():
    d1, p, sent1 = _transfer(1)
    d2, _, sent2 = _transfer(2)
    assert_bytes_equal(cache_bytes(d2), cache_bytes(d1), "two orders of the layer signals")
    for src, dst in zip([3, 9, 1, 12, 0, 7], [15, 2, 8, 4, 5, 6]):
        for tp, td in zip(p.tensors(), d1.tensors()):
            assert_bytes_equal(td[dst], tp[src], f"block {src}->{dst}")
    untouched = [i for i in range(16) if i not in (15, 2, 8, 4, 5, 6)]
    assert all(int(t[untouched].view(torch.uint8).abs().sum()) == 0 for t in d1.tensors())
    for sent in (sent1, sent2):  # layer by layer: every (request, layer) sent, none twice at once
        assert {(rid, layer) for rid, layers in sent for layer in layers} == \
            {(rid, layer) for rid in "ab" for layer in range(4)}
        assert len(sent) > 2
