"""Issue 26: the first token streamed, then the transfer failing (ipc-push on an in-process pair,
tests/reliability_harness.py), with prefix caching on D and with max_tokens 1. The request ends
in an error (P's first token is all that went out), D's failed blocks never enter its prefix
cache (a later hit would read them: other tokens), and every block comes back."""

from __future__ import annotations

import pytest
import torch

from kvflow.connector.messages import KVPushed
from kvflow.serve.protocol import Tokens

from tests.reliability_harness import PD, every_block_back
from tests.serve.test_reliability_pd import TEXT, colocated, tokens_of


@pytest.fixture(scope="module")
def pd():
    h = PD(kv_connector="ipc-push", prefix=True)
    yield h
    h.close()


@pytest.fixture(autouse=True)
def blocks_come_back(pd):
    yield from every_block_back(pd)


def _fail_after_first_token(pd, prompt, max_tokens=8):
    """P prefills and writes D's blocks, its first token goes out, then its KVPushed says the
    write failed; D's blocks get noise (a write that broke half-way). Returns (P's tokens, D's
    last message, D's block ids)."""
    req, alloc = pd.allocate(prompt, max_tokens)
    pd.prefill(req, prompt, alloc)
    first = [m for m in pd.own(pd.p, Tokens) if m.req_id == req]
    g = torch.Generator().manual_seed(26)
    for t in pd.d.cache.tensors():
        new = alloc.block_ids[alloc.num_cached_blocks:]
        t[new] = torch.randn(t[new].shape, generator=g).to(t.dtype)
    pd.deliver(KVPushed(req_id=req, ok=False, error="link down"))
    (end,) = [m for m in pd.own(pd.d, Tokens) if m.req_id == req]
    return first, end, alloc


def test_failed_transfer_after_the_first_token_is_an_error_and_never_a_prefix_hit(pd):
    prompt = TEXT[:40]
    first, end, _ = _fail_after_first_token(pd, prompt)
    assert [t for m in first for t in m.token_ids] == colocated(pd, prompt)[:1]
    assert end.finished and end.finish_reason == "error" and end.token_ids == []
    assert end.error == "KV transfer failed: prefill could not push the KV: link down"
    alloc, _, _, toks = pd.run(prompt)
    assert alloc.num_cached_blocks == 0  # the noisy blocks were not cached
    assert tokens_of(toks) == colocated(pd, prompt)


def test_failed_transfer_on_a_prefix_hit_keeps_only_the_good_prefix(pd):
    base = TEXT[:32]
    pd.run(base)  # two full blocks in D's prefix cache
    prompt = base + TEXT[100:148]
    first, end, alloc = _fail_after_first_token(pd, prompt)
    assert alloc.num_cached_blocks == 2
    assert end.finish_reason == "error" and "link down" in end.error
    again, _, _, toks = pd.run(prompt)
    assert again.num_cached_blocks == 2  # the hit survives, the failed blocks are not added
    assert tokens_of(toks) == colocated(pd, prompt)


def test_max_tokens_1_answers_with_ps_token_and_d_frees_on_the_failure(pd):
    prompt = TEXT[:40]
    first, end, _ = _fail_after_first_token(pd, prompt, max_tokens=1)
    assert [t for m in first for t in m.token_ids] == colocated(pd, prompt, 1)
    assert end.finish_reason == "error" and end.token_ids == []
    assert not pd.d.seqs and pd.d.free_blocks() == pd.d.num_blocks - len(pd.d.prefix)
