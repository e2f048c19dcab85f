"""copy_sequence between caches of different specs (issue #19), torch reference: exact values
of the token map (block_size, NHD<->HND, head slices, num_tokens, -1 padding), fp8 conversion
with per-tensor and per-block-per-head scales, the argument checks' exact messages, and a
property test against a loop-by-loop expectation over random geometry pairs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_sequence
from kvflow.kernels.reblock import make_mapping, side_strides

from tests.conftest import assert_bytes_equal, cache_bytes
from tests.reblock_cases import expect_copy, finite_cache, poisoned_cache

F32 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
                  layout="NHD")


def _numbered(spec, num_blocks):
    """Tensor j holds 1000 * j + its flat element index."""
    cache = PagedKVCache(spec, num_blocks)
    for j, t in enumerate(cache.tensors()):
        t.copy_((torch.arange(t.numel()) + 1000 * j).reshape(t.shape).to(spec.dtype))
    return cache


def test_strides_are_the_layouts():
    assert side_strides(F32) == (32, 8, 4)
    assert side_strides(F32.with_(layout="HND")) == (32, 4, 16)
    assert side_strides(F32.with_(layout="MLA", num_kv_heads=1)) == (16, 4, 0)


def test_worked_example_bs4_nhd_to_bs8_hnd():
    # docs/layouts.md: 10 tokens, P's blocks [7, 2, 5] of 4 tokens -> D's blocks [3, 1] of 8
    src = _numbered(F32, 8)
    dst = PagedKVCache(F32.with_(block_size=8, layout="HND"), 4)
    copy_sequence(src, dst, torch.tensor([7, 2, 5]), torch.tensor([3, 1]), num_tokens=10,
                  backend="torch")
    k = dst.tensors()[0]                     # layer 0 K, [blocks, heads, 8 slots, 4]
    # D block 3 = tokens 0..7 = P block 7 slots 0..3, then P block 2 slots 0..3 (dim 0, head 0)
    assert k[3, 0, :, 0].tolist() == [224, 232, 240, 248, 64, 72, 80, 88]
    assert k[3, 1, :, 0].tolist() == [228, 236, 244, 252, 68, 76, 84, 92]
    # D block 1 = tokens 8, 9 = P block 5 slots 0, 1; slots 2..7 untouched (still 0)
    assert k[1, 0, :, 0].tolist() == [160, 168, 0, 0, 0, 0, 0, 0]
    assert dst.tensors()[3][1, 1, 1].tolist() == [3172, 3173, 3174, 3175]  # layer 1 V, token 9
    assert not dst.tensors()[0][0].any() and not dst.tensors()[0][2].any()


def test_padding_and_partial_block_leave_slots_untouched():
    src = _numbered(F32, 8)
    dst = poisoned_cache(F32.with_(block_size=2), 8, seed=1)
    before = [t.clone() for t in dst.tensors()]
    # bs 4 -> 2: tokens 0..3 from P block 1 (-> D 0, 5), tokens 4..7 padded on P, 8..9 -> D 6
    copy_sequence(src, dst, torch.tensor([1, -1, 3]), torch.tensor([0, 5, 2, -1, 6, 7]),
                  num_tokens=9, backend="torch")
    v1 = dst.tensors()[3]                    # layer 1 V, NHD [blocks, 2 slots, heads, dim]
    assert v1[0, :, 0, 0].tolist() == [3032, 3040]
    assert v1[5, :, 1, 3].tolist() == [3055, 3063]
    assert v1[6, 0, 0, 0].item() == 3096                     # token 8 = P block 3 slot 0
    assert_bytes_equal(v1[6, 1], before[3][6, 1], "slot past num_tokens")
    assert_bytes_equal(v1[2], before[3][2], "source block -1")
    assert_bytes_equal(v1[7], before[3][7], "block past num_tokens")


def test_head_slices_fan_out_and_fan_in():
    full = finite_cache(F32.with_(num_kv_heads=4, layout="HND"), 6, seed=3)
    ids = torch.tensor([4, 0, 2])
    halves = []
    for start in (0, 2):                      # a TP=2 decode: each D holds 2 of the 4 heads
        half = PagedKVCache(F32.with_(num_kv_heads=2, block_size=8), 3)
        copy_sequence(full, half, ids, torch.tensor([2, 0]), head_start=start, backend="torch")
        for j, t in enumerate(half.tensors()):    # 12 tokens: D block 2 = P blocks 4, 0; ...
            p = full.tensors()[j][:, start:start + 2].transpose(1, 2)    # P as NHD, 2 heads
            assert torch.equal(t[2], torch.cat([p[4], p[0]]))
            assert torch.equal(t[0, :4], p[2]) and not t[0, 4:].any()   # ... D block 0 = P 2
        halves.append(half)
    back = PagedKVCache(full.spec, 6)            # fan-in: both halves into one full cache
    for start, half in zip((0, 2), halves):
        copy_sequence(half, back, torch.tensor([2, 0]), torch.tensor([1, 3, 5]), head_start=start,
                      backend="torch")
    for j, t in enumerate(back.tensors()):
        assert torch.equal(t[[1, 3, 5]], full.tensors()[j][[4, 0, 2]])


def test_fp8_per_tensor_scale_values():
    src = PagedKVCache(F32.with_(dtype=torch.bfloat16, num_layers=1), 2)
    src.tensors()[0][0, 0, 0] = torch.tensor([1.0, -2.5, 1000.0, 0.0])
    dst = PagedKVCache(F32.with_(dtype=torch.float8_e4m3fn, num_layers=1), 2)
    dst.scales.copy_(torch.tensor([0.5, 4.0]))          # K scale 0.5, V scale 4
    copy_sequence(src, dst, [0], [1], backend="torch")
    q = dst.tensors()[0][1, 0, 0]
    # 1/0.5 = 2: 2.0 -> 0x40, -5.0 -> 0xCA, 2000 saturates to 448 -> 0x7E, 0 -> 0
    assert q.view(torch.uint8).tolist() == [0x40, 0xCA, 0x7E, 0x00]
    assert dst.scales.tolist() == [0.5, 4.0]             # per-tensor scales are only read
    back = PagedKVCache(src.spec, 2)
    copy_sequence(dst, back, [1], [0], backend="torch")   # dequantize: q * 0.5
    assert back.tensors()[0][0, 0, 0].tolist() == [1.0, -2.5, 224.0, 0.0]


def test_fp8_block_head_scales_from_amax():
    spec = F32.with_(num_layers=1, block_size=2)
    src = PagedKVCache(spec, 2)
    src.tensors()[0][0, :, 0] = torch.tensor([[1.0, 2.0, 3.0, -7.0], [0.5, 0.0, 0.0, 0.0]])
    src.tensors()[0][1, 0, 0] = torch.tensor([0.25, 0.0, 0.0, 0.0])   # head 0, token 2
    dst = PagedKVCache(spec.with_(dtype=torch.float8_e4m3fn, scales="block_head",
                                  block_size=4), 2)
    copy_sequence(src, dst, [0, 1], [1], num_tokens=3, backend="torch")
    s = dst.scales[0]                                     # K: [blocks, heads]
    assert s[1, 0].item() == 7.0 / 448                   # amax 7 of head 0 over 3 tokens
    assert s[1, 1] == torch.tensor(2.0 ** -100) / 448    # head 1 all zero: MIN_AMAX / 448
    assert s[0].tolist() == [1.0, 1.0]                   # block 0 not written: unchanged
    q = dst.tensors()[0][1, :3, 0].float() * s[1, 0]     # dequantized head 0 rows
    assert q[0].tolist() == [1.0, 2.0, 3.0, -7.0]        # 64, 128, 192, -448 exactly
    assert q[2, 0].item() == 0.25


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_convert_matches_loop_expectation(dst_dtype):
    src = finite_cache(F32.with_(dtype=torch.float8_e4m3fn, scales="block_head"), 5, seed=4)
    dst = poisoned_cache(F32.with_(dtype=dst_dtype, block_size=8, layout="HND"), 4, seed=5)
    out, scales = expect_copy(src, dst, [3, 0, -1, 4], [2, 0], 14, (0, 2))
    copy_sequence(src, dst, [3, 0, -1, 4], [2, 0], num_tokens=14, backend="torch")
    for j, t in enumerate(dst.tensors()):
        assert_bytes_equal(t, out[j], f"tensor {j}")
    if scales is not None:
        assert torch.equal(dst.scales, scales)


# ---- argument checks: exact messages, nothing written ------------------------------------

BAD = [
    (dict(layout="MLA", num_kv_heads=1), {}, ValueError,
     "layout: src_cache has 'NHD', dst_cache has 'MLA'; an MLA cache maps only to an MLA cache"),
    (dict(num_layers=3), {}, ValueError,
     "num_layers: src_cache has 2, dst_cache has 3; layer l maps to layer l, so they must be "
     "equal"),
    (dict(head_dim=8), {}, ValueError,
     "head_dim: src_cache has 4, dst_cache has 8; a head moves whole, so head_dim must be equal"),
    (dict(dtype=torch.uint8), {}, ValueError,
     "dtype: src_cache has torch.float32, dst_cache has torch.uint8; only bfloat16, float16, "
     "float32, float8_e4m3fn, float8_e5m2 convert"),
    (dict(num_kv_heads=1), {}, ValueError,
     "num_kv_heads: src_cache has 2, dst_cache has 1; pass head_start (the 1 heads are "
     "[head_start, head_start + 1) of the 2)"),
    (dict(num_kv_heads=1), dict(head_start=2), ValueError,
     "head_start=2 is out of range: src_cache has 2 KV heads, dst_cache has 1 (need "
     "0 <= head_start <= 1)"),
    ({}, dict(head_start=1), ValueError,
     "head_start=1 but src_cache and dst_cache both hold 2 KV heads; head_start must be None "
     "or 0"),
    (dict(num_kv_heads=1), dict(head_start=0.5), TypeError,
     "head_start must be None or an int, got 0.5"),
    (dict(block_size=8), dict(num_tokens=17), ValueError,
     "num_tokens=17 is more than the block tables hold: src_ids has 3 blocks of 4 tokens (12), "
     "dst_ids 2 blocks of 8 (16)"),
    (dict(block_size=8), dict(num_tokens=-1), ValueError, "num_tokens must be >= 0, got -1"),
    (dict(block_size=8), dict(num_tokens="4"), TypeError,
     "num_tokens must be None or an int, got '4'"),
    (dict(block_size=8), dict(backend="native"), ValueError,
     "backend 'native' cannot move blocks between different specs (block_size, layout, dtype, "
     "heads) or a partial block (num_tokens); use 'torch', 'numba' or 'triton'"),
]


@pytest.mark.parametrize("change,kw,exc,msg", BAD, ids=[m[:24] for *_, m in BAD])
def test_bad_arguments_exact_message(change, kw, exc, msg):
    src = finite_cache(F32, 8, seed=1)
    dst = poisoned_cache(F32.with_(**change), 4, seed=2)
    before = cache_bytes(dst)
    if kw.get("backend") == "native":
        pytest.importorskip("kvflow._native")
    with pytest.raises(exc) as e:
        copy_sequence(src, dst, torch.tensor([1, 2, 3]), torch.tensor([0, 1]),
                      **{"backend": "torch", **kw})
    assert str(e.value) == msg
    assert_bytes_equal(cache_bytes(dst), before, "a refused call wrote")


def test_bad_ids_exact_message():
    src, dst = finite_cache(F32, 8, seed=1), poisoned_cache(F32.with_(block_size=8), 4, seed=2)
    with pytest.raises(ValueError) as e:
        copy_sequence(src, dst, [1, 8], [0], backend="torch")
    assert str(e.value) == ("src_ids[1]=8 is out of range for a cache of 8 blocks (valid: 0..7, "
                            "or -1 for padding)")
    with pytest.raises(ValueError) as e:
        copy_sequence(src, dst, [1, 2, 3, 4], [3, 3], backend="torch")
    assert str(e.value) == ("dst_ids repeats destination block 3; destination ids must be "
                            "distinct (only -1 padding may repeat)")


def test_same_spec_partial_block_within_one_cache():
    cache = _numbered(F32, 4)
    before = [t.clone() for t in cache.tensors()]
    copy_sequence(cache, cache, [1], [2], num_tokens=3, backend="torch")   # copy-on-write fork
    for j, t in enumerate(cache.tensors()):
        assert torch.equal(t[2, :3], before[j][1, :3]) and torch.equal(t[2, 3], before[j][2, 3])
    with pytest.raises(ValueError, match="src_ids and dst_ids share block 1 of one cache"):
        copy_sequence(cache, cache, [1], [1], num_tokens=3, backend="torch")


# ---- properties over random geometry pairs -------------------------------------------------

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


@st.composite
def spec_pairs(draw):
    """(src spec, dst spec, head_start): any layouts (MLA with MLA), block sizes, dtypes, scale
    modes and head counts of one model."""
    mla = draw(st.booleans()) and draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    base = dict(num_layers=draw(st.integers(1, 2)), head_dim=draw(st.integers(1, 9)))
    specs = []
    for _ in range(2):
        dt = draw(st.sampled_from(DTYPES))
        fp8 = dt in (torch.float8_e4m3fn, torch.float8_e5m2)
        specs.append(KVCacheSpec(
            **base, dtype=dt, block_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
            layout="MLA" if mla else draw(st.sampled_from(["NHD", "HND"])),
            num_kv_heads=1 if mla else draw(st.sampled_from([h for h in (1, 2, 4) if h <= heads])),
            scales=draw(st.sampled_from(["tensor", "block_head"])) if fp8 else "tensor"))
    if not mla:
        specs[draw(st.integers(0, 1))] = specs[0].with_(num_kv_heads=heads) \
            if draw(st.booleans()) else specs[1].with_(num_kv_heads=heads)
    hs, hd = specs[0].num_kv_heads, specs[1].num_kv_heads
    head_start = None if hs == hd else draw(st.integers(0, max(hs, hd) - min(hs, hd)))
    return specs[0], specs[1], head_start


@st.composite
def problems(draw):
    src, dst, head_start = draw(spec_pairs())
    tokens = draw(st.integers(0, 20))
    ns, nd = -(-tokens // src.block_size), -(-tokens // dst.block_size)
    nbs, nbd = draw(st.integers(max(ns, 1), ns + 3)), draw(st.integers(max(nd, 1), nd + 3))
    src_ids = [draw(st.integers(-1, nbs - 1)) for _ in range(ns)]
    dst_ids = draw(st.permutations(list(range(nbd)) + [-1] * nd))[:nd]
    num_tokens = draw(st.sampled_from([None, tokens]))
    return src, dst, head_start, nbs, nbd, src_ids, dst_ids, num_tokens, draw(st.integers(0, 999))


@SETTINGS
@given(problems())
def test_reference_matches_loop_expectation(problem):
    src_spec, dst_spec, head_start, nbs, nbd, s_ids, d_ids, num_tokens, seed = problem
    src = finite_cache(src_spec, nbs, seed)
    dst = poisoned_cache(dst_spec, nbd, seed + 1)
    T = min(len(s_ids) * src_spec.block_size, len(d_ids) * dst_spec.block_size) \
        if num_tokens is None else num_tokens
    out, scales = expect_copy(src, dst, s_ids, d_ids, T, (0, src_spec.num_layers),
                              head_start or 0)
    src_before = cache_bytes(src)
    copy_sequence(src, dst, torch.tensor(s_ids, dtype=torch.int64),
                  torch.tensor(d_ids, dtype=torch.int32), num_tokens=num_tokens,
                  head_start=head_start, backend="torch")
    for j, t in enumerate(dst.tensors()):
        assert_bytes_equal(t, out[j], f"tensor {j}")
    if scales is not None:
        assert torch.equal(dst.scales, scales)
    assert_bytes_equal(cache_bytes(src), src_before, "the source was written")


def test_mapping_of_equal_specs_moves_bytes():
    mp = make_mapping(F32, F32.with_(block_size=16, layout="HND"))
    assert not mp.convert and mp.heads == 2 and mp.src.head0 == mp.dst.head0 == 0
    assert make_mapping(F32.with_(dtype=torch.float8_e4m3fn), F32.with_(
        dtype=torch.float8_e4m3fn)).convert          # fp8 -> fp8 rescales
