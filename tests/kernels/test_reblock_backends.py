"""Every backend's copy_sequence equals the torch reference byte for byte (scales
included): a matrix of the issue's cases (block_size 16<->64 scaled down, NHD<->HND, bf16<->fp8
with per-tensor and per-block-per-head scales, head slices both ways, num_tokens, -1 padding,
a layer range) and a property test over random geometry pairs. The reference itself is checked
against a loop-by-loop expectation in tests/kernels/test_reblock.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_sequence

from tests.conftest import DEVICES, assert_bytes_equal, backends_for, cache_bytes
from tests.reblock_cases import finite_cache, poisoned_cache
from tests.kernels.test_reblock import problems

CASES = [(dev, be) for dev in ("cpu", "cuda") for be in backends_for(dev)
         if be in ("numba", "triton")]
BASE = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=2, dtype=torch.bfloat16,
                   layout="NHD")
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (src changes, dst changes, head_start): each a case the issue names, at small sizes
PAIRS = {
    "bs2->8": (dict(), dict(block_size=8), None),
    "bs8->2": (dict(block_size=8), dict(), None),
    "nhd->hnd": (dict(), dict(layout="HND"), None),
    "hnd->nhd bs8->4": (dict(layout="HND", block_size=8), dict(block_size=4), None),
    "bf16->fp8 tensor": (dict(), dict(dtype=E4), None),
    "bf16->fp8 block_head": (dict(), dict(dtype=E4, scales="block_head", block_size=4), None),
    "fp8 block_head->bf16": (dict(dtype=E4, scales="block_head"), dict(block_size=8), None),
    "fp8->fp8 e5m2": (dict(dtype=E4), dict(dtype=E5, layout="HND"), None),
    "fp32->fp16": (dict(dtype=torch.float32), dict(dtype=torch.float16), None),
    "heads 4->2 slice": (dict(num_kv_heads=4), dict(block_size=4), 2),
    "heads 1->2 fan-in": (dict(num_kv_heads=1, layout="HND"), dict(dtype=E4,
                                                                   scales="block_head"), 1),
    "mla bs2->4 fp8": (dict(layout="MLA", num_kv_heads=1, head_dim=24),
                       dict(layout="MLA", num_kv_heads=1, head_dim=24, block_size=4, dtype=E4), None),
}


def _ids(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("layers,num_tokens", [(None, None), ((1, 3), 13)])
def test_backend_matches_reference(device, backend, pair, layers, num_tokens):
    sc, dc, head_start = PAIRS[pair]
    src_spec, dst_spec = BASE.with_(**sc), BASE.with_(**dc)
    n_src = -(-16 // src_spec.block_size)
    n_dst = -(-16 // dst_spec.block_size)
    src = finite_cache(src_spec, n_src + 2, seed=1, device=device)
    s_ids = [(i * 5 + 3) % (n_src + 2) for i in range(n_src)]
    s_ids[1 % n_src] = -1                                    # padding on P's side
    d_ids = list(range(n_dst + 2))[::-1][:n_dst]
    if n_dst > 2:
        d_ids[2] = -1                                        # and on D's side
    results = []
    for be in ("torch", backend):
        dst = poisoned_cache(dst_spec, n_dst + 2, seed=2, device=device)
        copy_sequence(src, dst, _ids(s_ids, device), _ids(d_ids, device, torch.int32), layers,
                      num_tokens=num_tokens, head_start=head_start, backend=be)
        results.append((cache_bytes(dst), None if dst.scales is None else dst.scales.cpu()))
    assert_bytes_equal(results[1][0], results[0][0], f"{backend} {pair}")
    if results[0][1] is not None:
        assert_bytes_equal(results[1][1], results[0][1], f"{backend} {pair} scales")


SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("backend", [be for dev, be in CASES if dev == "cpu"])
@SETTINGS
@given(problems())
def test_backend_property_random_pairs(backend, problem):
    src_spec, dst_spec, head_start, nbs, nbd, s_ids, d_ids, num_tokens, seed = problem
    src = finite_cache(src_spec, nbs, seed)
    results = []
    for be in ("torch", backend):
        dst = poisoned_cache(dst_spec, nbd, seed + 1)
        copy_sequence(src, dst, torch.tensor(s_ids, dtype=torch.int64),
                      torch.tensor(d_ids, dtype=torch.int64), num_tokens=num_tokens,
                      head_start=head_start, backend=be)
        results.append((cache_bytes(dst), dst.scales))
    assert_bytes_equal(results[1][0], results[0][0], backend)
    if results[0][1] is not None:
        assert_bytes_equal(results[1][1], results[0][1], f"{backend} scales")


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_convert_like_the_reference_on_every_backend(device):
    """fp32 -> fp8 e4m3fn (per-tensor scale), bf16 and fp16: inf saturates to the fp8 range,
    NaN stays NaN (it once became a finite 1.5 on numba), byte for byte with the torch
    reference on every backend that re-blocks."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1,
                       dtype=torch.float32, layout="NHD")
    src = PagedKVCache(spec, 2, device=device)
    row = torch.tensor([1000.0, -1000.0, float("inf"), float("-inf"), float("nan"), 448.0,
                        -float("nan"), 2.0 ** -12])
    for t in src.tensors():
        t[0, 0, 0] = row.to(device)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
        want = PagedKVCache(spec.with_(dtype=dtype), 2, device=device)
        copy_sequence(src, want, [0], [1], backend="torch", num_tokens=1)
        for backend in [b for b in backends_for(device) if b not in ("torch", "native")]:
            got = PagedKVCache(spec.with_(dtype=dtype), 2, device=device)
            copy_sequence(src, got, [0], [1], backend=backend, num_tokens=1)
            for w, g in zip(want.tensors(), got.tensors()):
                assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), (backend, dtype)
            assert got.tensors()[0][1, 0, 0].float().isnan().tolist() == \
                [False, False, False, False, True, False, True, False], (backend, dtype)
