"""Issue 26: P and D of different block sizes that are no multiple of each other (P 16 tokens,
D 24), prompts whose length is a multiple of neither, and D prefix hits, on an in-process pair
(tests/reliability_harness.py): greedy tokens equal a colocated engine's, the hit moves nothing
of what D holds, every block comes back."""

from __future__ import annotations

import pytest
import torch


from tests.reliability_harness import PD, every_block_back, greedy_tokens
from tests.serve.test_reliability_pd import tokens_of

PROMPT = list(range(30, 180))          # 150 tokens: 9.4 of P's blocks, 6.25 of D's
HIT = PROMPT[:130] + [7] * 9           # 139 tokens; shares D's first 5 full blocks (120 tokens)


@pytest.fixture(scope="module", params=["ipc-pull", "ipc-push"])
def pd(request):
    h = PD(kv_connector=request.param, prefix=True, decode_block_size=24)
    yield h
    h.close()


@pytest.fixture(autouse=True)
def blocks_come_back(pd):
    yield from every_block_back(pd)


def colocated(pd, token_ids, max_tokens=8):
    """Greedy tokens of one engine with P's spec (16-token blocks) doing prefill and decode."""
    return greedy_tokens(pd.p.model, pd.p.spec, token_ids, max_tokens)


def test_block_sizes_16_and_24_with_a_d_prefix_hit_are_token_identical(pd):
    assert (pd.p.spec.block_size, pd.d.spec.block_size) == (16, 24)
    first, _, header, toks = pd.run(PROMPT)
    assert first.num_cached_blocks == 0 and len(first.block_ids) == 7  # ceil((150 + 8) / 24)
    assert tokens_of(toks) == colocated(pd, PROMPT)
    held = [t[first.block_ids[:5]].clone() for t in pd.d.cache.tensors()]
    again, _, _, toks = pd.run(HIT)
    assert again.num_cached_blocks == 5 and again.block_ids[:5] == first.block_ids[:5]
    assert len(again.block_ids) == 7  # ceil((139 + 8 new tokens) / 24)
    assert all(torch.equal(t[first.block_ids[:5]], h) for t, h in zip(pd.d.cache.tensors(), held))
    assert tokens_of(toks) == colocated(pd, HIT)
