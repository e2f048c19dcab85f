"""ipc-push between a P and a D of different KV cache specs (issue #19), in process on CPU: P
writes the whole prompt into D's mapped cache with one re-blocked copy after the prefill
(never layer by layer), byte for byte what the torch reference writes, skipping D's prefix
hit; D decodes the same tokens as with equal specs."""

from __future__ import annotations

import pytest
import torch

from kvflow.cache import PagedKVCache
from kvflow.kernels import copy_sequence, payload_bytes
from kvflow.serve.protocol import Tokens

from tests.reliability_harness import PD

PROMPT = list(range(30, 180))  # 150 tokens: 10 of P's 16-token blocks, 3 of D's 64-token ones
SETUPS = {"bs16->64": {"decode_block_size": 64}, "nhd->hnd": {"decode_kv_layout": "HND"}}


def reference(pd: PD, p_table, d_ids, num_tokens: int) -> PagedKVCache:
    """What the torch reference writes into D's blocks ``d_ids`` (-1: left as zeros)."""
    want = PagedKVCache(pd.d.spec, pd.d.num_blocks)
    copy_sequence(pd.p.cache, want, torch.tensor(p_table[:pd.p.spec.num_blocks_for(num_tokens)]),
                  torch.tensor(d_ids), num_tokens=num_tokens, backend="torch")
    return want


def blocks_of(cache: PagedKVCache, ids) -> list[torch.Tensor]:
    return [t[ids].view(torch.uint8).clone() for t in cache.tensors()]


@pytest.mark.parametrize("setup", SETUPS, ids=list(SETUPS))
def test_push_reblocks_the_whole_prompt_exactly_after_the_prefill(setup):
    pd = PD(kv_connector="ipc-push", prefix=True, layerwise_min_tokens=1, **SETUPS[setup])
    same = PD(kv_connector="ipc-push", prefix=False)
    try:
        assert pd.p.connector.reblocks(pd.d.instance_id)
        req, alloc = pd.allocate(PROMPT)
        p_table, header, frames = pd.prefill(req, PROMPT, alloc)
        nd = pd.d.spec.num_blocks_for(len(PROMPT))
        assert (header.ok, header.num_blocks, header.layerwise, frames) == (True, nd, False, [])
        assert header.payload_bytes == payload_bytes(pd.d.spec, nd)  # in D's blocks
        d_ids = alloc.block_ids[:nd]
        want = reference(pd, p_table, d_ids, len(PROMPT))
        for got, exp in zip(blocks_of(pd.d.cache, d_ids), blocks_of(want, d_ids)):
            assert torch.equal(got, exp)
        pd.deliver(header, frames)
        pd.decode_all()
        got = [m.token_ids for m in pd.take(pd.d, Tokens)]
        want_tokens = [m.token_ids for m in same.run(PROMPT)[3]]
        assert got == want_tokens and sum(len(t) for t in got) == 8
    finally:
        pd.close()
        same.close()


def test_push_reblocked_skips_d_prefix_hit():
    pd = PD(kv_connector="ipc-push", prefix=True, decode_block_size=64)
    try:
        first, *_ = pd.run(PROMPT)
        again = PROMPT[:140] + [7] * 10  # shares 2 full 64-token blocks of D's
        req, alloc = pd.allocate(again)
        assert alloc.num_cached_blocks == 2 and alloc.block_ids[:2] == first.block_ids[:2]
        hit = blocks_of(pd.d.cache, alloc.block_ids[:2])
        p_table, header, frames = pd.prefill(req, again, alloc)
        assert (header.num_blocks, header.payload_bytes) == (1, payload_bytes(pd.d.spec, 1))
        want = reference(pd, p_table, [-1, -1, alloc.block_ids[2]], len(again))
        got = blocks_of(pd.d.cache, [alloc.block_ids[2]])
        assert all(torch.equal(g, w) for g, w in zip(got, blocks_of(want, [alloc.block_ids[2]])))
        assert all(torch.equal(g, h) for g, h in zip(blocks_of(pd.d.cache, alloc.block_ids[:2]), hit))
        pd.deliver(header, frames)
        pd.decode_all()
    finally:
        pd.close()
