"""Equal-spec ops move the per-block scales of an fp8 ``block_head`` cache with its blocks
(issue #19): copy_blocks, and gather / scatter through a staging buffer's ``out_scales`` /
``src_scales``, on every backend; ids of -1 (and, unvalidated, out of range) skip the pair;
``layers=`` limits the tensors; a block_head gather / scatter without the scales is refused."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks

from tests.conftest import DEVICES, backends_for
from tests.reblock_cases import finite_cache, poisoned_cache

BH = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                 dtype=torch.float8_e4m3fn, layout="NHD", scales="block_head")
CASES = [(dev, be) for dev in DEVICES for be in backends_for(dev)]
SRC, DST = [3, -1, 5, 0, 7], [1, 4, -1, 6, 2]   # valid pairs: 3->1, 0->6, 7->2
LAYERS = (1, 3)                                  # tensors 2..5 of 6


def expected(src: PagedKVCache, dst: PagedKVCache, pairs, tensors) -> tuple[list, torch.Tensor]:
    """dst's tensors and scales after moving ``pairs`` of blocks in ``tensors``, by hand."""
    blocks = [t.cpu().clone() for t in dst.tensors()]
    scales = dst.scales.cpu().clone()
    for j in tensors:
        for s, d in pairs:
            blocks[j][d] = src.tensors()[j][s].cpu()
            scales[j, d] = src.scales[j, s].cpu()
    return blocks, scales


def check(cache: PagedKVCache, want: tuple[list, torch.Tensor]) -> None:
    for j, (t, w) in enumerate(zip(cache.tensors(), want[0])):
        assert torch.equal(t.cpu().view(torch.uint8), w.view(torch.uint8)), f"tensor {j}"
    assert torch.equal(cache.scales.cpu().view(torch.int32), want[1].view(torch.int32))


@pytest.mark.parametrize("device,backend", CASES)
def test_copy_blocks_moves_the_blocks_scales(device, backend):
    a = finite_cache(BH, 8, seed=1, device=device)
    b = poisoned_cache(BH, 8, seed=2, device=device)
    want = expected(a, b, [(3, 1), (0, 6), (7, 2)], range(2, 6))
    copy_blocks(a, b, torch.tensor(SRC), torch.tensor(DST), LAYERS, backend=backend)
    check(b, want)


@pytest.mark.parametrize("device,backend", CASES)
def test_copy_blocks_value_survives_with_its_scale(device, backend):
    """The issue's case: a's scales 0.5, b's 1.0; b's block 1 must mean a's block 0."""
    a = finite_cache(BH, 2, seed=3, device=device)
    a.scales.fill_(0.5)
    b = PagedKVCache(BH, 2, device=device)
    copy_blocks(a, b, [0], [1], backend=backend)
    for j, (x, y) in enumerate(zip(a.tensors(), b.tensors())):
        assert torch.equal(y[1].float() * b.scales[j, 1, None, :, None],
                           x[0].float() * 0.5), j
    assert b.scales[:, 0].eq(1.0).all() and b.scales[:, 1].eq(0.5).all()


@pytest.mark.parametrize("device,backend", CASES)
def test_copy_within_one_cache_and_unvalidated_ids(device, backend):
    c = finite_cache(BH, 8, seed=4, device=device)
    want = expected(c, c, [(0, 5), (2, 7)], range(6))
    copy_blocks(c, c, torch.tensor([0, 2, -1]), torch.tensor([5, 7, 3]), backend=backend)
    check(c, want)
    d = poisoned_cache(BH, 4, seed=5, device=device)
    want = expected(c, d, [(1, 2)], range(6))
    copy_blocks(c, d, torch.tensor([99, 1, 4]), torch.tensor([0, 2, 77]), backend=backend,
                validate=False)  # out-of-range ids skip the pair, as for the bytes
    check(d, want)


@pytest.mark.parametrize("device,backend", CASES)
def test_gather_scatter_carry_the_scales(device, backend):
    a = finite_cache(BH, 8, seed=6, device=device)
    out = staging_buffer(BH, 5, LAYERS, device=device).fill_(1.0)
    out_scales = torch.full((4, 5, 2), 7.0, device=device)
    gather_blocks(a, torch.tensor(SRC), out, LAYERS, backend=backend, out_scales=out_scales)
    want = torch.full((4, 5, 2), 7.0)
    for i, s in enumerate(SRC):
        if s >= 0:
            want[:, i] = a.scales[2:6, s].cpu()
    assert torch.equal(out_scales.cpu(), want)          # slot 1 (id -1) untouched
    b = poisoned_cache(BH, 8, seed=7, device=device)
    blocks, scales = [t.cpu().clone() for t in b.tensors()], b.scales.cpu().clone()
    for i, d in enumerate(DST):  # slot i -> block DST[i] (slot 1 holds what gather left)
        for j in range(2, 6):
            if d >= 0:
                blocks[j][d] = out[j // 2 - 1, j % 2, i].cpu()
                scales[j, d] = out_scales[j - 2, i].cpu()
    scatter_blocks(out, b, torch.tensor(DST), LAYERS, backend=backend, src_scales=out_scales)
    check(b, (blocks, scales))


def test_block_head_gather_scatter_need_the_scales():
    a = finite_cache(BH, 4, seed=8)
    out = staging_buffer(BH, 2)
    with pytest.raises(ValueError) as e:
        gather_blocks(a, [0, 1], out, backend="torch")
    assert str(e.value) == (
        "out_scales must be a contiguous float32 tensor of shape (6, 2, 2) on cpu: the cache is "
        "fp8 with scales='block_head' and each block's scales move with its bytes, got None")
    with pytest.raises(ValueError) as e:
        scatter_blocks(staging_buffer(BH, 2, 1), a, [2, 3], layers=1, backend="torch",
                       src_scales=torch.ones(6, 2, 2))
    assert str(e.value) == (
        "src_scales must be a contiguous float32 tensor of shape (2, 2, 2) on cpu: the cache is "
        "fp8 with scales='block_head' and each block's scales move with its bytes, got "
        "torch.float32 of shape (6, 2, 2) on cpu")
    t = finite_cache(BH.with_(scales="tensor"), 4, seed=9)
    with pytest.raises(ValueError) as e:
        gather_blocks(t, [0], staging_buffer(t.spec, 1), out_scales=torch.ones(6))
    assert str(e.value) == (
        "out_scales given for a staging buffer of the cache's spec (dtype=torch.float8_e4m3fn, "
        "scales='tensor'), which carries no per-block scales (only fp8 with "
        "scales='block_head' does)")
