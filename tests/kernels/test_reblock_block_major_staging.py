"""A staging buffer gathered from a block-major (BM_NHD) cache is packed per tensor like an NHD
one, so re-blocking scatters that name the BM_NHD spec as the staging side's (what tcp's D does
for a BM_NHD P) read it as NHD: D's NHD / HND cache then holds P's bytes exactly, token for
token (before, the block-major strides read past the buffer: D crashed)."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.cache import staging_buffer
from kvflow.kernels import gather_blocks, scatter_blocks

BM = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
                 layout="BM_NHD")


@pytest.mark.parametrize("d_layout", ["NHD", "HND"])
def test_scatter_from_block_major_staging_lands_token_for_token(d_layout):
    torch.manual_seed(0)
    p = PagedKVCache(BM, 8)
    p.buffer.copy_(torch.randint(0, 256, p.buffer.shape, dtype=torch.uint8))
    src_ids, dst_ids, tokens = [5, 1, 6], [2, 7, 0], 10
    stage = gather_blocks(p, torch.tensor(src_ids), staging_buffer(BM, 3))
    d_spec = BM.with_(layout=d_layout)
    d = PagedKVCache(d_spec, 8)
    for layer in range(BM.num_layers):
        scatter_blocks(stage[layer:layer + 1], d, torch.tensor(dst_ids), layer, src_spec=BM,
                       num_tokens=tokens)
    for t_p, t_d in zip(p.tensors(), d.tensors()):
        for tok in range(tokens):
            sb, db, slot = src_ids[tok // 4], dst_ids[tok // 4], tok % 4
            want = t_p[sb, slot]
            got = t_d[db, slot] if d_layout == "NHD" else t_d[db, :, slot]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (layer, tok)
