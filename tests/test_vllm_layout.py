"""``from_vllm``: vLLM's per-layer ``[B, H, N, C]`` views read as kvflow layouts, without copying;
every op moves their bytes exactly (against indexing vLLM's view by hand); what cannot be read
is refused with the shape and stride named. The last tests build the views with vLLM's own
``create_kv_cache_views`` (skipped without vLLM)."""

from __future__ import annotations

import re

import pytest
import torch

from kvflow import staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
from kvflow.vllm_layout import from_vllm, vllm_like

from tests.conftest import backends_for, random_bytes_

SHAPE = (8, 2, 32, 64)  # B blocks, H kv heads, N tokens per block, C = 2 * head_dim 32
LAYER0 = "model.layers.0.self_attn.attn"


def _block(view: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    """Block ``b`` of vLLM's view in memory order (what kvflow moves as one run)."""
    return view[b] if layout == "LBHNC" else view[b].permute(1, 0, 2)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_reads_layout_geometry_and_aliases_memory(layout):
    kv = vllm_like(layout, 3, SHAPE)
    cache = from_vllm(kv)
    s = cache.spec
    assert (s.layout, s.num_layers, s.num_kv_heads, s.block_size, s.head_dim, s.dtype) == \
        (layout, 3, 2, 32, 32, torch.bfloat16)
    assert s.tensors_per_layer == 1 and s.block_bytes == 2 * 32 * 64 * 2
    views = list(kv.values())
    for t, v in zip(cache.tensors(), views):
        assert t.data_ptr() == v.data_ptr() and t.is_contiguous()
    cache.tensors()[1][5].fill_(7)  # a write through kvflow lands in vLLM's view
    assert (views[1][5] == 7).all() and not views[1][4].any() and not views[0][5].any()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_ops_move_vllm_blocks_exactly(layout, backend):
    p_kv, d_kv = vllm_like(layout, 2, SHAPE), vllm_like(layout, 2, SHAPE)
    for i, v in enumerate(p_kv.values()):
        random_bytes_(v, seed=i)
    p, d = from_vllm(p_kv), from_vllm(d_kv)
    ids = [6, -1, 0, 3]
    buf = gather_blocks(p, torch.tensor(ids), staging_buffer(p.spec, 4).zero_(), backend=backend)
    for layer, v in enumerate(p_kv.values()):
        for i, b in enumerate(ids):
            expect = torch.zeros_like(buf[layer, 0, i]) if b < 0 else _block(v, layout, b)
            assert torch.equal(buf[layer, 0, i].view(torch.uint8), expect.view(torch.uint8))
    scatter_blocks(buf, d, torch.tensor([1, 2, -1, 7]), backend=backend)
    copy_blocks(p, d, torch.tensor([6]), torch.tensor([4]), backend=backend)
    for src_v, dst_v in zip(p_kv.values(), d_kv.values()):
        for s_b, d_b in ((6, 1), (3, 7), (6, 4)):
            assert torch.equal(dst_v[d_b].view(torch.uint8), src_v[s_b].view(torch.uint8))
        for untouched in (0, 2, 3, 5, 6):
            assert not dst_v[untouched].view(torch.uint8).any()


def test_latent_reads_mla_and_kv_sharing_is_kept_once():
    kv = vllm_like("LBHNC", 2, (8, 1, 32, 576))
    kv["model.layers.2.self_attn.attn"] = kv[LAYER0]  # layer 2 reuses layer 0's cache
    cache = from_vllm(kv, latent=True)
    assert (cache.spec.layout, cache.spec.num_layers, cache.spec.head_dim) == ("MLA", 2, 576)
    assert cache.tensors()[0].shape == (8, 32, 576)
    assert from_vllm(list(kv.values())[:2]).spec.head_dim == 288  # K|V reading


def test_refuses_cross_layer_layout_naming_shape_and_stride():
    buf = torch.zeros(3 * 8 * 2 * 32 * 64, dtype=torch.bfloat16)
    page = 2 * 32 * 64  # BLHNC: block b of layer l at (b * 3 + l) * page
    kv = {f"l{i}": torch.as_strided(buf, SHAPE, (3 * page, 32 * 64, 64, 1), i * page)
          for i in range(3)}
    with pytest.raises(ValueError, match="^" + re.escape(
            "kv_caches['l0'] has shape (8, 2, 32, 64) and stride (12288, 2048, 64, 1): block "
            "stride 12288 elements but a page holds 4096: blocks of one layer are not adjacent "
            "(a cross-layer layout such as BLHNC/BLNHC, or padded pages); kvflow reads the "
            "layer-compact layouts LBHNC and LBNHC (VLLM_KV_CACHE_LAYOUT)") + "$"):
        from_vllm(kv)


def test_refuses_heads_outside_the_block_and_other_ranks():
    buf = torch.zeros(8 * 2 * 32 * 64, dtype=torch.float16)
    lhbnc = torch.as_strided(buf, SHAPE, (32 * 64, 8 * 32 * 64, 64, 1))
    with pytest.raises(ValueError, match=re.escape(
            "kv_caches['0'] has shape (8, 2, 32, 64) and stride (2048, 16384, 64, 1): one block "
            "is not one contiguous run (heads outside the block, e.g. LHBNC/BHLNC)")):
        from_vllm([lhbnc])
    with pytest.raises(ValueError, match=re.escape(
            "kv_caches['k'] has shape (2, 8, 32, 2, 32) and stride (16384, 2048, 64, 32, 1): "
            "expected vLLM's 4-D per-layer view")):
        from_vllm({"k": torch.zeros(2, 8, 32, 2, 32)})


def test_refuses_mixed_geometry_odd_content_and_empty():
    kv = vllm_like("LBHNC", 2, SHAPE)
    kv["x"] = torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(
            "kv_caches['x'] has shape (4, 2, 32, 64); kv_caches['model.layers.0.self_attn.attn'] "
            "has (8, 2, 32, 64); kvflow moves layers of one geometry")):
        from_vllm(kv)
    with pytest.raises(ValueError, match=re.escape("content C=63 is odd")):
        from_vllm([torch.zeros(4, 2, 32, 63)])
    with pytest.raises(ValueError, match=re.escape("latent=True needs one head (H == 1), got 2")):
        from_vllm([torch.zeros(4, 2, 32, 64)], latent=True)
    with pytest.raises(ValueError, match="^kv_caches is empty"):
        from_vllm({})
    with pytest.raises(TypeError, match=re.escape("kv_caches['a'] must be a torch.Tensor, got list")):
        from_vllm({"a": [1, 2]})


def _vllm_views(layout_name: str, num_layers: int = 3):
    """Per-layer views made by vLLM's own allocator code for ``layout_name``."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor,
                                            compute_layout_strides, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    strides = compute_layout_strides(spec, 8, num_layers, layout)
    raw = torch.zeros(num_layers * 8 * spec.page_size_bytes, dtype=torch.int8)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    tensor = KVCacheTensor(size=raw.numel(), layers=names, layer_stride=strides[0],
                           block_stride=strides[1], offset=0)
    return dict(zip(names, create_kv_cache_views(raw, spec, 8, layout, tensor)))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_vllm_allocator_views_are_read(layout):
    kv = _vllm_views(layout)
    for i, v in enumerate(kv.values()):
        random_bytes_(v, seed=10 + i)
    cache = from_vllm(kv)
    assert (cache.spec.layout, cache.spec.block_size, cache.spec.num_kv_heads,
            cache.spec.head_dim) == (layout, 32, 2, 32)
    buf = gather_blocks(cache, torch.tensor([7, 2]), staging_buffer(cache.spec, 2))
    for layer, v in enumerate(kv.values()):
        assert torch.equal(buf[layer, 0, 1].view(torch.uint8), _block(v, layout, 2).view(torch.uint8))


@pytest.mark.parametrize("layout,why", [("BLHNC", "blocks of one layer are not adjacent"),
                                        ("BLNHC", "blocks of one layer are not adjacent"),
                                        ("LHBNC", "one block is not one contiguous run"),
                                        ("BHLNC", "one block is not one contiguous run")])
def test_vllm_allocator_views_refused(layout, why):
    kv = _vllm_views(layout)
    with pytest.raises(ValueError, match=re.escape(why)):
        from_vllm(kv)
