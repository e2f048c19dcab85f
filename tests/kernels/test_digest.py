"""``digest=`` of gather / scatter / copy_blocks (``--kv-verify``): every backend writes the bits
of the torch reference :func:`kvflow.kernels.block_digest`, which is itself checked against a
plain-Python evaluation of the formula; the moved bytes stay those of the reference; a changed,
swapped or misplaced word changes the digest; bad ``digest`` arguments are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import block_digest, copy_blocks, gather_blocks, scatter_blocks
from kvflow.kernels.digest import digest_blocks

from tests.conftest import (DEVICES, DTYPES, GEOMETRY, LAYOUTS, assert_bytes_equal, backends_for,
                       cache_bytes, make_spec, random_bytes_, random_cache, takes_block_major)

CASES = [(dev, be) for dev in DEVICES for be in backends_for(dev)]
DT_NAMES = {d: str(d).removeprefix("torch.") for d in DTYPES}


def _skip_block_major(device, backend, layout):
    if layout == "BM_NHD" and not takes_block_major(backend, device):
        pytest.skip("backend without block_strides: refused with a ValueError")


def _python_digest(cache: PagedKVCache, block: int, start: int, stop: int) -> int:
    """The formula of :mod:`kvflow.kernels.digest`, word by word in Python ints."""
    T = cache.spec.tensors_per_layer
    words = np.concatenate([t[block].reshape(-1).view(torch.uint8).cpu().numpy().view("<u4")
                            for t in cache.tensors()[start * T:stop * T]])
    first = start * T * cache.spec.block_bytes // 4  # positions count from layer 0
    total = sum(int(w) * ((((first + p) * 0x9E3779B1) % 2**32) | 1)
                for p, w in enumerate(words)) % 2**32
    return total - 2**32 if total >= 2**31 else total  # the int32 of those 32 bits


def test_reference_is_the_formula():
    spec = make_spec("NHD", torch.bfloat16)
    cache = random_cache(spec, 5, seed=3)
    got = block_digest(cache, [4, -1, 0], (1, 3))
    assert got.dtype == torch.int32
    assert got.tolist() == [_python_digest(cache, 4, 1, 3), 0, _python_digest(cache, 0, 1, 3)]
    assert block_digest(cache, []).tolist() == []
    # a range's digest is the sum of its layers' (mod 2**32)
    assert (int(got[0]) - int(block_digest(cache, [4], 1)[0])
            - int(block_digest(cache, [4], 2)[0])) % 2**32 == 0


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_NAMES.get)
def test_ops_digest_matches_reference(device, backend, layout, dtype):
    _skip_block_major(device, backend, layout)
    spec, g = make_spec(layout, dtype), GEOMETRY
    cache = random_cache(spec, g.num_blocks, device, seed=1)
    ids = [g.num_blocks - 1, -1, 3, 0, 3, -1, 7][:g.num_ids]
    layers = (1, 3)
    want = block_digest(cache, ids, layers)
    assert int((want != 0).sum()) == sum(i >= 0 for i in ids)
    t_ids = torch.tensor(ids, device=device)
    poison = random_bytes_(staging_buffer(spec, len(ids), layers, device), seed=2)
    out, ref = poison.clone(), poison.clone()
    d = torch.full((len(ids),), 7, dtype=torch.int32, device=device)  # overwritten
    gather_blocks(cache, t_ids, out, layers, backend=backend, digest=d)
    gather_blocks(cache, t_ids, ref, layers, backend="torch")
    assert_bytes_equal(out, ref, f"{backend} gather with digest")
    assert d.tolist() == want.tolist(), f"{backend} gather digest"
    dst_ids = [5, 2, -1, 9, 11, 4, 1][:len(ids)]
    a, b = random_cache(spec, g.num_blocks, device, 4), random_cache(spec, g.num_blocks, device, 4)
    scatter_blocks(out, a, torch.tensor(dst_ids, device=device), layers, backend="torch")
    scatter_blocks(out, b, torch.tensor(dst_ids, device=device), layers, backend=backend,
                   digest=d)
    assert_bytes_equal(cache_bytes(b), cache_bytes(a), f"{backend} scatter with digest")
    # the digest of what the scatter wrote; slot 2 is skipped (-1): 0
    assert d.tolist() == block_digest(a, dst_ids, layers).tolist()
    assert [d[i] == want[i] for i in (0, 3, 4)] == [True] * 3
    copy_blocks(cache, a, t_ids, torch.tensor(dst_ids, device=device), backend="torch")
    copy_blocks(cache, b, t_ids, torch.tensor(dst_ids, device=device), backend=backend, digest=d)
    assert_bytes_equal(cache_bytes(b), cache_bytes(a), f"{backend} copy with digest")
    full = block_digest(cache, ids)
    assert d.tolist() == [0 if j < 0 else w for w, j in zip(full.tolist(), dst_ids)]


@pytest.mark.parametrize("device,backend", CASES)
def test_four_byte_runs(device, backend):
    """12-byte blocks (not a multiple of 8) take the 32-bit word path."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=3,
                       dtype=torch.float16, layout="HND")
    assert spec.block_bytes == 12
    cache = random_cache(spec, 4, device, seed=5)
    out = staging_buffer(spec, 3, device=device)
    d = torch.empty(3, dtype=torch.int32, device=device)
    gather_blocks(cache, torch.tensor([2, -1, 1], device=device), out, backend=backend, digest=d)
    assert d.tolist() == block_digest(cache, [2, -1, 1]).tolist()


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_digest_blocks_matches_reference(device, backend, layout):
    """The read-only digest launch (ipc-pull's P): the reference's bits, over all layers and a
    range, -1 and repeated ids included; the cache is left as it was; 12-byte runs too."""
    _skip_block_major(device, backend, layout)
    spec, g = make_spec(layout, torch.bfloat16), GEOMETRY
    cache = random_cache(spec, g.num_blocks, device, seed=9)
    before = cache_bytes(cache).clone()
    ids = [3, -1, g.num_blocks - 1, 3, 0]
    for layers in (None, (1, 3), 2):
        got = digest_blocks(cache, ids, layers, backend=backend)
        want = block_digest(cache, ids, layers)
        assert got.dtype == torch.int32 and got.device == cache.device
        assert got.tolist() == want.tolist(), (backend, layers)
        assert got[1] == 0 and got[0] == got[3] and got[0] != got[2]
    t_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    assert digest_blocks(cache, t_ids, backend=backend).tolist() == block_digest(cache, ids).tolist()
    assert_bytes_equal(cache_bytes(cache), before, f"{backend} digest_blocks wrote the cache")
    assert digest_blocks(cache, [], backend=backend).tolist() == []
    odd = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=3,
                      dtype=torch.float16, layout="HND")  # 12-byte runs: 32-bit words
    small = random_cache(odd, 4, device, seed=10)
    assert digest_blocks(small, [2, -1, 1], backend=backend).tolist() == \
        block_digest(small, [2, -1, 1]).tolist()


def test_digest_blocks_bad_arguments():
    spec = make_spec("NHD", torch.float32)
    cache = random_cache(spec, 4, seed=11)
    with pytest.raises(ValueError) as e:
        digest_blocks(cache, [0, 4])
    assert str(e.value) == ("block_ids[1]=4 is out of range for a cache of 4 blocks (valid: "
                            "0..3, or -1 for padding)")
    with pytest.raises(TypeError, match=r"^cache must be a kvflow.PagedKVCache, got list$"):
        digest_blocks([], [0])
    odd = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=3, block_size=3,
                      dtype=torch.float16, layout="HND")
    with pytest.raises(ValueError, match=r"^digest needs block_bytes to be a multiple of 4, "
                                         r"got 18 "):
        digest_blocks(PagedKVCache(odd, 2), [0])


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_corruption_changes_the_digest(backend):
    """One flipped bit, two swapped words, or K and V swapped: the slot's digest differs (the
    others do not)."""
    spec = make_spec("NHD", torch.bfloat16)
    cache = random_cache(spec, 6, seed=6)
    ids = torch.tensor([1, 4, 2])
    out = staging_buffer(spec, 3)
    sent = torch.empty(3, dtype=torch.int32)
    gather_blocks(cache, ids, out, backend=backend, digest=sent)
    words = out.view(-1).view(torch.uint8).view(out.shape[0], 2, 3, -1)
    bad = out.clone()
    bad.view(-1).view(torch.uint8).view(out.shape[0], 2, 3, -1)[3, 1, 2, 5] ^= 0x10
    swapped = out.clone()
    sw = swapped.view(-1).view(torch.uint8).view(out.shape[0], 2, 3, -1)
    sw[0, 0, 0, 0:4], sw[0, 0, 0, 4:8] = words[0, 0, 0, 4:8].clone(), words[0, 0, 0, 0:4].clone()
    kv = out.clone()
    kv[2, 0, 1], kv[2, 1, 1] = out[2, 1, 1].clone(), out[2, 0, 1].clone()
    for corrupt, slot in ((bad, 2), (swapped, 0), (kv, 1)):
        got = torch.empty(3, dtype=torch.int32)
        scatter_blocks(corrupt, PagedKVCache(spec, 6), torch.tensor([0, 3, 5]), backend=backend,
                       digest=got)
        assert [g != s for g, s in zip(got.tolist(), sent.tolist())] == \
            [i == slot for i in range(3)], (backend, slot)


def test_bad_digest_arguments():
    spec = make_spec("NHD", torch.float32)
    cache = random_cache(spec, 4, seed=7)
    out = staging_buffer(spec, 2)
    ids = torch.tensor([0, 1])
    cases = [([0, 0], TypeError, "digest must be None or an int32 torch.Tensor of shape [2], "
                                 "got list"),
             (torch.zeros(2, dtype=torch.int64), TypeError,
              "digest must have dtype torch.int32, got torch.int64"),
             (torch.zeros(3, dtype=torch.int32), ValueError,
              "digest must have shape [2] (one per id), got [3]"),
             (torch.zeros(4, dtype=torch.int32)[::2], ValueError, "digest must be contiguous")]
    for bad, exc, msg in cases:
        with pytest.raises(exc) as e:
            gather_blocks(cache, ids, out, digest=bad)
        assert str(e.value) == msg
    with pytest.raises(ValueError, match=r"^digest= is not supported for re-blocked moves"):
        gather_blocks(cache, ids, staging_buffer(spec, 2), num_tokens=3,
                      digest=torch.zeros(2, dtype=torch.int32))
    odd = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=3, block_size=3,
                      dtype=torch.float16, layout="HND")
    with pytest.raises(ValueError, match=r"^digest needs block_bytes to be a multiple of 4, "
                                         r"got 18 "):
        gather_blocks(PagedKVCache(odd, 2), [0], staging_buffer(odd, 1),
                      digest=torch.zeros(1, dtype=torch.int32))


def test_kernels_bench_times_the_digest_ops():
    """``python -m kvflow.bench kernels --ops ...+digest``: rows for the digest variants, each
    verified (bytes and digest) against the torch reference, beside the plain ops."""
    from kvflow.bench.kernels import run_kernels
    from kvflow.bench.schema import env_info
    opts = dict(device="cpu", seed=0, num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                mla_dim=64, layouts=["NHD"], dtypes=["bfloat16"], tokens=[64], num_blocks=16,
                ops=["gather", "gather+digest", "scatter+digest", "copy+digest"],
                backends=["torch", "numba"], warmup=1, reps=2, max_ctas=[None], max_rotations=2)
    rows, skipped = run_kernels(opts, env_info("cpu"), progress=False)
    assert skipped == []
    assert [(r["op"], r["backend"], r["verified"]) for r in rows] == [
        (op, be, True) for op in opts["ops"] for be in ("torch", "numba")]
    with pytest.raises(SystemExit, match="--ops: unknown gather\\+crc"):
        run_kernels(dict(opts, ops=["gather+crc"]), {}, progress=False)
