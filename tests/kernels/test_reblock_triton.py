"""Triton-specific checks of the re-blocking kernel: compiled for sm_90 (offline, no GPU
needed), its data path uses 16-byte vector loads and stores in every case of the issue's
benchmark, the hardware's round-to-nearest-even fp8 conversion, IEEE-rounded divisions, no
fused multiply-adds and no flush-to-zero; grid caps give the reference's bytes. Byte equality
with the reference: tests/kernels/test_reblock_backends.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.kernels import copy_sequence

from tests.conftest import assert_bytes_equal, backends_for, cache_bytes
from tests.reblock_cases import finite_cache, poisoned_cache

pytestmark = pytest.mark.skipif("triton" not in backends_for("cpu") + backends_for("cuda"),
                                reason="the triton backend is unavailable here")


def test_sm90_ptx_moves_16_byte_vectors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.reblock_ptx"], capture_output=True,
                         text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert len(rows) == 6
    for name, r in rows.items():
        wide = {"ld.global.v2.b64", "ld.global.v4.b32"}
        assert wide & set(r["ld"]), f"{name}: no 16-byte load in {r['ld']}"
        assert {"st.global.v2.b64", "st.global.v4.b32"} & set(r["st"]), \
            f"{name}: no 16-byte store in {r['st']}"
    assert "cvt.rn.satfinite.e4m3x2.f32" in rows["bf16->fp8"]["cvt"]
    assert "cvt.rn.bf16x2.f32" in rows["fp8 block_head->bf16"]["cvt"]
    # scales divide like the reference (IEEE div.rn, not div.full/div.approx/rcp.approx), and
    # no multiply-add is contracted into an fma (one rounding fewer than torch)
    for name, r in rows.items():
        assert set(r["div"]) <= {"div.rn.f32"}, f"{name}: {r['div']}"
        assert r["fma"] == [], f"{name}: {r['fma']}"
        assert r["ftz"] == [], f"{name}: {r['ftz']}"           # subnormals kept, like torch
    assert rows["bf16->fp8 block_head"]["div"] == ["div.rn.f32"]
    assert rows["bf16->fp8"]["div"] == ["div.rn.f32"]


@pytest.mark.parametrize("max_ctas", [1, 3])
def test_grid_cap_gives_reference_bytes(max_ctas):
    dev = "cpu" if "triton" in backends_for("cpu") else "cuda"
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=2,
                       dtype=torch.bfloat16, layout="NHD")
    dspec = spec.with_(block_size=8, layout="HND", dtype=torch.float8_e4m3fn,
                       scales="block_head")
    src = finite_cache(spec, 12, seed=1, device=dev)
    s_ids = torch.tensor([3, 1, -1, 7, 0, 11, 5, 2, 9, 4], device=dev)
    d_ids = torch.tensor([2, -1, 0], device=dev)
    got = []
    for be, cap in (("torch", None), ("triton", max_ctas)):
        dst = poisoned_cache(dspec, 3, seed=2, device=dev)
        copy_sequence(src, dst, s_ids, d_ids, num_tokens=19, backend=be, max_ctas=cap)
        got.append((cache_bytes(dst), dst.scales.cpu()))
    assert_bytes_equal(got[1][0], got[0][0], f"max_ctas={max_ctas}")
    assert_bytes_equal(got[1][1], got[0][1], "scales")


def test_block_major_reblock_refused_before_it_runs():
    """The re-blocking kernel steps layer-major strides only: a block-major (BM_NHD) side is
    refused naming the backend, and the destination is untouched (torch and numba take it)."""
    dev = "cpu" if "triton" in backends_for("cpu") else "cuda"
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=2,
                       dtype=torch.bfloat16, layout="BM_NHD")
    src = finite_cache(spec, 4, seed=1, device=dev)
    dst = poisoned_cache(spec.with_(block_size=4, layout="NHD"), 2, seed=2, device=dev)
    before = cache_bytes(dst).clone()
    with pytest.raises(ValueError) as e:
        copy_sequence(src, dst, torch.tensor([0, 1], device=dev), torch.tensor([1], device=dev),
                      num_tokens=4, backend="triton")
    assert str(e.value) == ("backend 'triton' does not re-block block-major caches "
                            "(layout='BM_NHD'); use backend='torch' or 'numba'")
    assert_bytes_equal(cache_bytes(dst), before, "destination")
