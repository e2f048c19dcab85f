"""P's fixed points of the connector contract (issue 27, kvflow/connector/base.py): serve calls
``hook = sender.begin(job)``, ``Engine.prefill(..., on_chunk=hook)``, ``sender.finish(job,
first_token)``; ``begin`` alone decides whether the KV moves layer by layer, and a kind only
gives its hook and its sends."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import Kept, PrefillJob, TransferError
from kvflow.connector.base import KVSender
from kvflow.context import forward_context

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)


class Plain(KVSender):
    """A kind that moves the KV after the prefill only: all a minimal kind implements."""

    name = "plain"

    def __init__(self, **kw) -> None:
        super().__init__(SPEC, **kw)
        self.links["d"] = object()  # attached to D "d"
        self.sent: list[tuple] = []
        self.calls: list = []

    def send_prefilled(self, job, first_token, *, prefill_ms=0.0):
        self.sent.append(("after", job.req_id, first_token))
        return Kept(list(job.blocks))


class Layered(Plain):
    """A kind that moves layers during the prefill: records its hook's calls."""

    layerwise_ready = True

    def __init__(self, reblock: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.reblock = reblock

    def reblocks(self, decode_id):
        return self.reblock

    def chunk_hook(self, job, state):
        def on_chunk(start, end):
            self.calls.append((start, end))
            return self.calls.append
        return on_chunk

    def send_layerwise(self, job, first_token, state, *, prefill_ms=0.0):
        self.sent.append(("layerwise", job.req_id, first_token))

    def cancel(self, req_id, rec):
        self.calls.append(("cancel", req_id, rec.layerwise))


class FakeEngine:
    """Engine.prefill's chunk loop over a two-layer model (no compute)."""

    def prefill(self, token_ids, blocks, *, chunk_size=None, on_chunk=None):
        step = chunk_size or len(token_ids)
        for start in range(0, len(token_ids), step):
            on_layer = on_chunk(start, min(start + step, len(token_ids))) if on_chunk else None
            for layer in range(SPEC.num_layers):
                if on_layer is not None:
                    on_layer(layer)
        return torch.zeros(8)


def job(n: int, req_id: str = "r", decode_id: str = "d") -> PrefillJob:
    nb = SPEC.num_blocks_for(n)
    return PrefillJob(req_id, [1] * n, list(range(nb)), decode_id, list(range(nb)))


def serve(tx: KVSender, j: PrefillJob, chunk_size: int = 4):
    """What P's serve does for one request."""
    hook = tx.begin(j)
    FakeEngine().prefill(j.token_ids, j.blocks, chunk_size=chunk_size, on_chunk=hook)
    return hook, tx.finish(j, 7)


def test_begin_decides_by_threshold_and_finish_sends_by_that_decision():
    tx = Layered(layerwise_min_tokens=8)
    hook, kept = serve(tx, job(7, "short"))
    assert hook is None and tx.calls == [] and kept == Kept([0, 1])
    hook, kept = serve(tx, job(8, "long"))
    assert hook is not None and kept is None
    assert tx.calls == [(0, 4), 0, 1, (4, 8), 0, 1]
    assert tx.sent == [("after", "short", 7), ("layerwise", "long", 7)]
    assert tx.prefilling == {}


def test_begin_moves_after_the_prefill_for_a_reblocking_d_or_a_kind_without_layers():
    for tx in (Layered(reblock=True, layerwise_min_tokens=0), Plain(layerwise_min_tokens=0)):
        hook, _ = serve(tx, job(12))
        assert hook is None and tx.calls == [] and tx.sent == [("after", "r", 7)]


def test_a_dummy_run_takes_the_layerwise_path_at_any_length_and_sends_nothing():
    tx = Layered(layerwise_min_tokens=4096, max_model_len=2048)  # nothing real goes layerwise
    assert not tx.layerwise_enabled and tx.begin(job(32, "real")) is None
    tx.make_cache(8)
    tx.dummy_run(FakeEngine(), chunk_size=16, num_tokens=32)
    assert tx.calls == [(0, 16), 0, 1, (16, 32), 0, 1]
    assert tx.sent == [] and list(tx.prefilling) == ["real"]
    plain = Plain()
    plain.make_cache(8)
    plain.dummy_run(FakeEngine(), chunk_size=16)  # no layerwise path: a plain prefill
    assert plain.sent == [] and plain.prefilling == {}


def test_begin_refuses_before_compute_and_keeps_nothing():
    tx = Layered(layerwise_min_tokens=0)
    with pytest.raises(TransferError) as e:
        tx.begin(job(8, decode_id="x"))
    assert str(e.value) == ("decode instance 'x' is not paired with this prefill instance "
                            "(paired: ['d'])")
    assert tx.prefilling == {} and tx.calls == [("cancel", "r", True)]


def test_begin_twice_finish_unbegun_and_fail_are_named():
    tx = Layered(layerwise_min_tokens=0)
    tx.begin(job(8))
    with pytest.raises(TransferError) as e:
        tx.begin(job(8))
    assert str(e.value) == "request 'r' was begun already and is not finished or failed"
    tx.fail("r", "d", "the prefill raised")
    assert tx.calls == [("cancel", "r", True)] and tx.prefilling == {}
    with pytest.raises(TransferError) as e:
        tx.finish(job(8), 7)
    assert str(e.value) == "finish of request 'r', which was not begun or failed"
    assert tx.sent == []
