"""gather_blocks / scatter_blocks with a staging buffer of another spec (issue #19): every
backend equals the torch reference (scales included); a gather into D's spec then a scatter
into D equals copy_sequence from P to D; argument checks name the argument."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import copy_sequence, gather_blocks, scatter_blocks

from tests.conftest import assert_bytes_equal, backends_for, cache_bytes
from tests.reblock_cases import finite_cache, finite_, poisoned_cache

BACKENDS = ["torch"] + [b for b in backends_for("cpu") if b in ("numba", "triton")]
P = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=2, dtype=torch.bfloat16,
                layout="NHD")
STAGES = {"bs4 hnd": P.with_(block_size=4, layout="HND"),
          "fp8 block_head": P.with_(block_size=8, dtype=torch.float8_e4m3fn, scales="block_head"),
          "fp8 tensor": P.with_(dtype=torch.float8_e5m2)}
IDS = [5, 0, -1, 3, 7, 2]                       # 12 tokens of P in blocks of 2


def _scales(spec, m, nt, seed):
    if not spec.is_fp8:
        return None
    shape = (nt,) if spec.scales == "tensor" else (nt, m, spec.num_kv_heads)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.5


@pytest.mark.parametrize("stage", list(STAGES))
def test_gather_then_scatter_every_backend(stage):
    spec = STAGES[stage]
    cache = finite_cache(P, 8, seed=1)
    m = -(-11 // spec.block_size)
    outs = []
    for be in BACKENDS:
        out = finite_(staging_buffer(spec, m, layers=(1, 3)), seed=3)  # skipped slots: read back
        sc = _scales(spec, m, 4, seed=4)
        gather_blocks(cache, torch.tensor(IDS), out, (1, 3), backend=be, out_spec=spec,
                      out_scales=sc, num_tokens=11)
        dst = poisoned_cache(P.with_(block_size=4), 5, seed=5)
        scatter_blocks(out, dst, [4, 0, 2], (1, 3), backend=be, src_spec=spec, src_scales=sc,
                       num_tokens=11)
        outs.append((out, sc, cache_bytes(dst)))
    for be, (out, sc, dst) in zip(BACKENDS[1:], outs[1:]):
        assert_bytes_equal(out, outs[0][0], f"{be} gather into {stage}")
        if sc is not None:
            assert_bytes_equal(sc, outs[0][1], f"{be} staging scales")
        assert_bytes_equal(dst, outs[0][2], f"{be} scatter from {stage}")


@pytest.mark.parametrize("be", BACKENDS)
def test_staged_transfer_equals_direct_copy(be):
    d_spec = P.with_(block_size=8, layout="HND")
    p = finite_cache(P, 8, seed=1)
    d_direct, d_staged = (poisoned_cache(d_spec, 4, seed=2) for _ in range(2))
    ids = [5, 0, 4, 3, 7, 2]   # no padding: a staging buffer has no -1 to skip a slot with
    copy_sequence(p, d_direct, ids, [3, 1], num_tokens=11, backend=be)
    buf = gather_blocks(p, ids, staging_buffer(d_spec, 2).zero_(), backend=be, out_spec=d_spec,
                        num_tokens=11)                 # P gathers in D's spec ...
    scatter_blocks(buf, d_staged, [3, 1], backend=be, num_tokens=11)   # ... D scatters
    assert_bytes_equal(cache_bytes(d_staged), cache_bytes(d_direct), be)


def test_staged_argument_checks():
    cache = finite_cache(P, 8, seed=1)
    spec = STAGES["fp8 block_head"]
    out = staging_buffer(spec, 2)
    with pytest.raises(ValueError) as e:
        gather_blocks(cache, IDS, out, out_spec=spec, backend="torch")
    assert str(e.value) == ("out_scales must be a contiguous float32 tensor of shape (6, 2, 2) "
                            "on cpu for out_spec.dtype=torch.float8_e4m3fn "
                            "(scales='block_head'), got None")
    with pytest.raises(ValueError) as e:
        gather_blocks(cache, IDS, staging_buffer(STAGES["bs4 hnd"], 2), out_spec=STAGES["bs4 hnd"],
                      num_tokens=9, backend="torch")
    assert str(e.value) == ("num_tokens=9 is more than the block tables hold: src_ids has 6 "
                            "blocks of 2 tokens (12), out.shape[2] 2 blocks of 4 (8)")
    with pytest.raises(ValueError) as e:
        gather_blocks(cache, IDS, torch.zeros(3, 2, 2, 4, 2, 8, dtype=torch.bfloat16),
                      out_spec=STAGES["bs4 hnd"], backend="torch")
    assert str(e.value).startswith("out.shape is (3, 2, 2, 4, 2, 8); expected (3, 2, 2, 2, 4, 8)")
