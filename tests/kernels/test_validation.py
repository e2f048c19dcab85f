"""One test per bad input: the exact error (type and message naming the argument and value),
raised before any work, with every destination byte as it was before the call."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer, staging_shape
from kvflow.kernels import copy_blocks, copy_sequence, gather_blocks, scatter_blocks
from kvflow.kernels import registry

from tests.conftest import backends_for, cache_bytes, random_bytes_, random_cache

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16,
                   layout="NHD")
NB = 16  # blocks per test cache


def _snapshot(x):
    return cache_bytes(x) if isinstance(x, PagedKVCache) else x.reshape(-1).view(torch.uint8).clone()


def rejects(exc, message, fn, *watched):
    """``fn()`` raises ``exc`` with exactly ``message``, and every tensor or cache in ``watched``
    keeps every byte."""
    before = [_snapshot(w) for w in watched]
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        fn()
    for i, (w, b) in enumerate(zip(watched, before)):
        assert torch.equal(_snapshot(w), b), f"watched[{i}] changed by a rejected call"


@pytest.fixture
def caches():
    return random_cache(SPEC, NB, seed=1), random_cache(SPEC, NB, seed=2)


def _out(n, layers=None):
    return random_bytes_(staging_buffer(SPEC, n, layers), seed=3)


# ---- block ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,index", [(16, 1), (1000, 1), (-2, 1), (-100, 1)])
def test_gather_id_out_of_range(caches, bad, index):
    src, _ = caches
    out = _out(3)
    rejects(ValueError, f"block_ids[{index}]={bad} is out of range for a cache of 16 blocks "
            f"(valid: 0..15, or -1 for padding)",
            lambda: gather_blocks(src, torch.tensor([0, bad, -1]), out), out)


def test_scatter_id_out_of_range(caches):
    _, dst = caches
    rejects(ValueError, "block_ids[2]=16 is out of range for a cache of 16 blocks "
            "(valid: 0..15, or -1 for padding)",
            lambda: scatter_blocks(_out(3), dst, torch.tensor([3, 4, 16])), dst)


def test_copy_src_id_out_of_range_of_smaller_source(caches):
    small, dst = random_cache(SPEC, 4, seed=4), caches[1]
    rejects(ValueError, "src_ids[0]=4 is out of range for a cache of 4 blocks "
            "(valid: 0..3, or -1 for padding)",
            lambda: copy_blocks(small, dst, torch.tensor([4]), torch.tensor([10])), dst)


def test_copy_dst_id_below_padding(caches):
    src, dst = caches
    rejects(ValueError, "dst_ids[1]=-3 is out of range for a cache of 16 blocks "
            "(valid: 0..15, or -1 for padding)",
            lambda: copy_blocks(src, dst, torch.tensor([1, 2]), torch.tensor([5, -3])), dst)


def test_scatter_duplicate_destination(caches):
    _, dst = caches
    rejects(ValueError, "block_ids repeats destination block 7; destination ids must be distinct "
            "(only -1 padding may repeat)",
            lambda: scatter_blocks(_out(4), dst, torch.tensor([7, -1, -1, 7])), dst)


def test_copy_duplicate_destination(caches):
    src, dst = caches
    rejects(ValueError, "dst_ids repeats destination block 2; destination ids must be distinct "
            "(only -1 padding may repeat)",
            lambda: copy_blocks(src, dst, torch.tensor([0, 1, 3]), torch.tensor([2, 2, 9])), dst)


def test_gather_may_read_a_block_twice(caches):
    src, _ = caches
    out = gather_blocks(src, torch.tensor([5, 5]), _out(2))
    assert torch.equal(out[:, :, 0].view(torch.uint8), out[:, :, 1].view(torch.uint8))


def test_copy_same_cache_overlapping_ids(caches):
    cache, _ = caches
    rejects(ValueError, "src_ids and dst_ids share block 3 of one cache",
            lambda: copy_blocks(cache, cache, torch.tensor([3, 4]), torch.tensor([5, 3])), cache)


def test_copy_two_objects_over_one_buffer_count_as_one_cache(caches):
    # found by a new-user test: the overlap check compared objects, not memory, and backends
    # then disagreed on chained copies (0->1, 1->2, 2->3)
    cache, _ = caches
    alias = PagedKVCache(SPEC, NB, buffer=cache.buffer)
    rejects(ValueError, "src_ids and dst_ids share block 1 of one cache",
            lambda: copy_blocks(cache, alias, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])),
            cache)
    wrapped = PagedKVCache.from_tensors(SPEC, cache.tensors())
    rejects(ValueError, "src_ids and dst_ids share block 2 of one cache",
            lambda: copy_blocks(wrapped, cache, torch.tensor([2]), torch.tensor([2])), cache)


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_copy_within_one_buffer_with_disjoint_ids_matches_torch(backend):
    ref = random_cache(SPEC, NB, seed=5)
    got = random_cache(SPEC, NB, seed=5)
    for c, be in ((ref, "torch"), (got, backend)):
        copy_blocks(c, PagedKVCache(SPEC, NB, buffer=c.buffer), torch.tensor([0, 1, -1, 2]),
                    torch.tensor([7, 8, 9, 10]), backend=be)
    assert torch.equal(cache_bytes(got), cache_bytes(ref))
    assert not torch.equal(cache_bytes(ref), cache_bytes(random_cache(SPEC, NB, seed=5)))


def _interleaved(num_blocks):
    """Two caches whose tensors alternate in one allocation: address ranges interleave, bytes
    never overlap (as separately allocated per-layer tensors of two engines can)."""
    per = SPEC.tensor_shape(num_blocks)
    raw = random_bytes_(torch.empty(2 * SPEC.num_tensors * num_blocks * SPEC.block_bytes,
                                    dtype=torch.uint8), seed=6)
    parts = raw.view(SPEC.dtype).view(2 * SPEC.num_tensors, *per)
    return (PagedKVCache.from_tensors(SPEC, list(parts[0::2])),
            PagedKVCache.from_tensors(SPEC, list(parts[1::2])), parts)


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_copy_between_caches_of_interleaved_tensors(backend):
    ref_src, ref_dst, _ = _interleaved(NB)
    src, dst, _ = _interleaved(NB)
    ids, dids = torch.tensor([3, -1, 0, 9]), torch.tensor([1, 2, 15, 4])
    copy_blocks(ref_src, ref_dst, ids, dids, backend="torch")
    copy_blocks(src, dst, ids, dids, backend=backend)
    assert torch.equal(cache_bytes(dst), cache_bytes(ref_dst))
    assert torch.equal(cache_bytes(src), cache_bytes(ref_src))


def test_copy_refuses_a_cache_sharing_one_tensor_with_the_other():
    src, _, parts = _interleaved(NB)
    mixed = PagedKVCache.from_tensors(SPEC, [parts[1]] * (SPEC.num_tensors - 1) + [parts[6]])
    rejects(ValueError, "src_cache and dst_cache overlap in memory without being the same cache "
            "(same tensors); copy_blocks needs disjoint caches or one cache",
            lambda: copy_blocks(src, mixed, torch.tensor([0]), torch.tensor([1])), src)


def test_copy_between_partly_overlapping_caches(caches):
    cache, _ = caches
    shifted = PagedKVCache(SPEC, NB - 1, buffer=cache.buffer[SPEC.block_bytes:])
    rejects(ValueError, "src_cache and dst_cache overlap in memory without being the same cache "
            "(same tensors); copy_blocks needs disjoint caches or one cache",
            lambda: copy_blocks(cache, shifted, torch.tensor([0]), torch.tensor([9]),
                                validate=False), cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool], ids=str)
def test_ids_wrong_dtype(caches, dtype):
    src, _ = caches
    out = _out(2)
    rejects(TypeError, f"block_ids must have dtype torch.int32 or torch.int64, got {dtype}",
            lambda: gather_blocks(src, torch.tensor([1, 2]).to(dtype), out), out)


def test_ids_python_floats(caches):
    _, dst = caches
    rejects(TypeError, "block_ids must hold ints, got [1.0, 2.0]",
            lambda: scatter_blocks(_out(2), dst, [1.0, 2.0]), dst)


def test_ids_not_a_tensor(caches):
    src, _ = caches
    rejects(TypeError, "block_ids must be a 1-D int32 or int64 tensor, a numpy array or a list "
            "of ints, got str",
            lambda: gather_blocks(src, "0,1", _out(2)))


def test_ids_two_dimensional(caches):
    src, dst = caches
    rejects(ValueError, "src_ids must be 1-D, got shape (2, 2)",
            lambda: copy_blocks(src, dst, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1])),
            dst)


def test_src_dst_length_mismatch(caches):
    src, dst = caches
    rejects(ValueError, "src_ids has 3 ids but dst_ids has 2; they pair one to one",
            lambda: copy_blocks(src, dst, torch.tensor([0, 1, 2]), torch.tensor([0, 1])), dst)


# ---- caches and buffers ---------------------------------------------------------------------
def test_spec_mismatch_names_both_values(caches):
    # copy_sequence maps block_size, dtype and NHD/HND differences (tests/kernels/test_reblock.py);
    # head_dim does not (copy_blocks refuses any difference: tests/kernels/test_ops.py)
    src = random_cache(SPEC.with_(head_dim=16, block_size=8), NB, seed=5)
    dst = caches[1]
    rejects(ValueError, "head_dim: src_cache has 16, dst_cache has 8; a head moves whole, so "
            "head_dim must be equal",
            lambda: copy_sequence(src, dst, torch.tensor([0]), torch.tensor([0])), dst)


def test_spec_mismatch_layout(caches):
    src = random_cache(SPEC.with_(layout="MLA", num_kv_heads=1, head_dim=16), NB, seed=6)
    rejects(ValueError, "layout: src_cache has 'MLA', dst_cache has 'NHD'; an MLA cache maps "
            "only to an MLA cache",
            lambda: copy_sequence(src, caches[1], torch.tensor([0]), torch.tensor([0])), caches[1])


def test_cache_not_a_cache(caches):
    rejects(TypeError, "cache must be a kvflow.PagedKVCache, got Tensor",
            lambda: gather_blocks(torch.zeros(4), torch.tensor([0]), _out(1)))
    rejects(TypeError, "dst_cache must be a kvflow.PagedKVCache, got list",
            lambda: copy_blocks(caches[0], [], torch.tensor([0]), torch.tensor([0])))


def test_out_wrong_shape(caches):
    src, _ = caches
    out = random_bytes_(torch.empty(4, 2, 3, 4, 2, 8, dtype=torch.bfloat16), seed=7)
    rejects(ValueError, "out.shape is (4, 2, 3, 4, 2, 8); expected (4, 2, 2, 4, 2, 8) "
            "(layers, tensors per layer, blocks, *block_shape)",
            lambda: gather_blocks(src, torch.tensor([0, 1]), out), out)


def test_out_shape_of_other_layer_range(caches):
    src, _ = caches
    out = _out(2)  # all 4 layers, but only (1, 3) requested
    rejects(ValueError, "out.shape is (4, 2, 2, 4, 2, 8); expected (2, 2, 2, 4, 2, 8) "
            "(layers, tensors per layer, blocks, *block_shape)",
            lambda: gather_blocks(src, torch.tensor([0, 1]), out, (1, 3)), out)


def test_out_wrong_dtype(caches):
    src, _ = caches
    out = torch.zeros(staging_shape(SPEC, 2), dtype=torch.float16)
    rejects(TypeError, "out.dtype is torch.float16; the cache holds torch.bfloat16",
            lambda: gather_blocks(src, torch.tensor([0, 1]), out), out)


def test_out_not_contiguous(caches):
    src, _ = caches
    wide = random_bytes_(torch.empty(4, 2, 2, 4, 2, 16, dtype=torch.bfloat16), seed=8)
    out = wide[..., ::2]
    rejects(ValueError, f"out must be contiguous, got strides {out.stride()}",
            lambda: gather_blocks(src, torch.tensor([0, 1]), out), wide)


def test_scatter_src_wrong_shape(caches):
    _, dst = caches
    rejects(ValueError, "src.shape is (4, 2, 3, 4, 2, 8); expected (4, 2, 2, 4, 2, 8) "
            "(layers, tensors per layer, blocks, *block_shape)",
            lambda: scatter_blocks(_out(3), dst, torch.tensor([0, 1])), dst)


def test_scatter_src_not_a_tensor(caches):
    _, dst = caches
    rejects(TypeError, "src must be a torch.Tensor, got list",
            lambda: scatter_blocks([0.0], dst, torch.tensor([0])), dst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_wrong_device(caches):
    src, dst = caches
    out = _out(1)
    rejects(ValueError, "block_ids is on cuda:0; the cache is on cpu",
            lambda: gather_blocks(src, torch.tensor([0], device="cuda"), out), out)
    out_gpu = staging_buffer(SPEC, 1, device="cuda")
    rejects(ValueError, "out is on cuda:0; the cache is on cpu",
            lambda: gather_blocks(src, torch.tensor([0]), out_gpu))
    gpu = PagedKVCache(SPEC, NB, "cuda")
    rejects(ValueError, "src_cache is on cpu and dst_cache on cuda:0; copy_blocks moves between "
            "caches of one device type",
            lambda: copy_blocks(src, gpu, torch.tensor([0]), torch.tensor([0])), gpu)


# ---- layers and options ---------------------------------------------------------------------
@pytest.mark.parametrize("layers", [4, -1, (3, 5), range(0, 5), slice(1, 9)], ids=repr)
def test_layers_out_of_range(caches, layers):
    _, dst = caches
    rejects(ValueError, f"layers={layers!r} is outside the cache's 4 layers "
            f"(need 0 <= start < stop <= 4)",
            lambda: scatter_blocks(_out(1, None), dst, torch.tensor([0]), layers), dst)


@pytest.mark.parametrize("layers,start,stop", [((2, 2), 2, 2), ((1, 0), 1, 0),
                                                (range(3, 1), 3, 1)], ids=repr)
def test_layers_empty_or_reversed(caches, layers, start, stop):
    _, dst = caches
    rejects(ValueError, f"layers={layers!r} is empty or reversed: start {start} must be below "
            f"stop {stop}",
            lambda: scatter_blocks(_out(1, None), dst, torch.tensor([0]), layers), dst)


@pytest.mark.parametrize("layers", [range(0, 4, 2), slice(0, 4, 2)], ids=repr)
def test_layers_step_not_one(caches, layers):
    src, dst = caches
    rejects(ValueError, f"layers must be a contiguous range (step 1), got {layers!r}",
            lambda: copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1]), layers), dst)


@pytest.mark.parametrize("layers", [1.5, "0:2", [0, 2], (0, 1, 2), True], ids=repr)
def test_layers_wrong_type(caches, layers):
    src, _ = caches
    out = _out(1)
    rejects(TypeError, f"layers must be None, an int, a range, a slice or (start, stop), "
            f"got {layers!r}", lambda: gather_blocks(src, torch.tensor([0]), out, layers), out)


@pytest.mark.parametrize("max_ctas,exc", [(0, ValueError), (-4, ValueError),
                                          (np.int64(0), ValueError), (2.0, TypeError),
                                          (2.5, TypeError), ("8", TypeError), (True, TypeError)],
                         ids=repr)
def test_max_ctas_invalid(caches, max_ctas, exc):
    src, dst = caches
    rejects(exc, f"max_ctas must be None or a positive int, got {max_ctas!r}",
            lambda: copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1]),
                                max_ctas=max_ctas), dst)


def test_numpy_integers_for_max_ctas_and_layers(caches):
    src, _ = caches
    a, b = _out(2, 1), _out(2, 1)
    gather_blocks(src, torch.tensor([1, 3]), a, np.int64(1), max_ctas=np.int64(8))
    gather_blocks(src, torch.tensor([1, 3]), b, 1, max_ctas=8)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    c = _out(2, (1, 3))
    gather_blocks(src, torch.tensor([1, 3]), c, (np.int32(1), np.int64(3)))
    assert torch.equal(c[0].view(torch.uint8), a[0].view(torch.uint8))


@pytest.mark.parametrize("layers", [slice(0.5, 2), slice(0, "2")], ids=repr)
def test_layers_slice_of_non_ints(caches, layers):
    src, _ = caches
    out = _out(1)
    rejects(TypeError, f"layers must be None, an int, a range, a slice or (start, stop) of ints, "
            f"got {layers!r}", lambda: gather_blocks(src, torch.tensor([0]), out, layers), out)


@pytest.mark.parametrize("validate", ["no", 0, None], ids=repr)
def test_validate_must_be_a_bool(caches, validate):
    src, dst = caches
    rejects(TypeError, f"validate must be True or False, got {validate!r}",
            lambda: copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1]),
                                validate=validate), dst)
    rejects(TypeError, f"validate must be True or False, got {validate!r}",
            lambda: scatter_blocks(_out(1), dst, torch.tensor([1]), validate=validate), dst)


def test_numpy_ids_with_a_negative_stride(caches):
    # found by a new-user test: torch's from_dlpack aborted the process on these
    src, dst = caches
    rejects(TypeError, "src_ids has a negative stride ((-8,)); pass a copy with positive "
            "strides (e.g. numpy.ascontiguousarray)",
            lambda: copy_blocks(src, dst, np.arange(2)[::-1], np.arange(2)), dst)
    out = _out(2)
    rejects(TypeError, "block_ids has a negative stride ((-4,)); pass a copy with positive "
            "strides (e.g. numpy.ascontiguousarray)",
            lambda: gather_blocks(src, np.arange(2, dtype=np.int32)[::-1], out), out)
    good = gather_blocks(src, np.ascontiguousarray(np.arange(2)[::-1]), _out(2))
    assert torch.equal(good.view(torch.uint8), gather_blocks(src, [1, 0], out).view(torch.uint8))


def test_staging_buffer_inside_the_cache(caches):
    src, dst = caches
    shape = staging_shape(SPEC, 2)
    nbytes = torch.Size(shape).numel() * 2
    inside = dst.buffer[SPEC.block_bytes:SPEC.block_bytes + nbytes].view(SPEC.dtype).view(shape)
    rejects(ValueError, "out lies in the cache's memory; the staging buffer must be separate "
            "memory", lambda: gather_blocks(dst, torch.tensor([0, 1]), inside), dst)
    rejects(ValueError, "src lies in the cache's memory; the staging buffer must be separate "
            "memory", lambda: scatter_blocks(inside, dst, torch.tensor([5, 6])), dst)
    gather_blocks(src, torch.tensor([0, 1]), inside)  # another cache's memory is fine


def test_list_id_too_large_for_int64(caches):
    src, _ = caches
    out = _out(3)
    rejects(ValueError, f"block_ids[2]={2 ** 70} is out of range for a cache of 16 blocks "
            f"(valid: 0..15, or -1 for padding)",
            lambda: gather_blocks(src, [0, 1, 2 ** 70], out), out)


# ---- backends -------------------------------------------------------------------------------
class _FakeBackend:
    """A backend that must never run: every op fails the test."""

    def __init__(self, name, devices, reason):
        self.name, self.devices, self._reason = name, devices, reason

    def unavailable_reason(self):
        return self._reason

    def gather(self, *a):
        raise AssertionError("an unavailable backend ran")

    scatter = copy = gather


@pytest.fixture
def fake_backends(monkeypatch):
    monkeypatch.delenv("KVFLOW_BACKEND", raising=False)
    for b in (_FakeBackend("fake_off", {"cpu"}, "needs the fake driver"),
              _FakeBackend("fake_gpu", {"cuda"}, None)):
        monkeypatch.setitem(registry._BACKENDS, b.name, b)


def test_unknown_backend(caches, fake_backends):
    src, _ = caches
    out = _out(1)
    rejects(ValueError, f"backend='cuda_magic' is unknown; known backends: "
            f"{registry.backend_names()}",
            lambda: gather_blocks(src, torch.tensor([0]), out, backend="cuda_magic"), out)


def test_backend_not_a_string(caches):
    src, _ = caches
    rejects(TypeError, "backend must be a str, got None",
            lambda: gather_blocks(src, torch.tensor([0]), _out(1), backend=None))


def test_unavailable_backend_by_argument_raises(caches, fake_backends):
    _, dst = caches
    rejects(RuntimeError, "backend='fake_off' is unavailable: needs the fake driver",
            lambda: scatter_blocks(_out(1), dst, torch.tensor([0]), backend="fake_off"), dst)


def test_unavailable_backend_by_env_raises(caches, fake_backends, monkeypatch):
    src, dst = caches
    monkeypatch.setenv("KVFLOW_BACKEND", "fake_off")
    rejects(RuntimeError, "KVFLOW_BACKEND='fake_off' is unavailable: needs the fake driver",
            lambda: copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1])), dst)
    monkeypatch.setenv("KVFLOW_BACKEND", "no_such_backend")
    rejects(ValueError, f"KVFLOW_BACKEND='no_such_backend' is unknown; known backends: "
            f"{registry.backend_names()}",
            lambda: copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1])), dst)


def test_backend_for_another_device_raises(caches, fake_backends, monkeypatch):
    src, _ = caches
    out = _out(1)
    rejects(ValueError, "backend='fake_gpu' runs on ['cuda'], not on cpu",
            lambda: gather_blocks(src, torch.tensor([0]), out, backend="fake_gpu"), out)
    monkeypatch.setenv("KVFLOW_BACKEND", "fake_gpu")
    rejects(ValueError, "KVFLOW_BACKEND='fake_gpu' runs on ['cuda'], not on cpu",
            lambda: gather_blocks(src, torch.tensor([0]), out), out)


def test_env_backend_is_used_and_argument_wins(caches, fake_backends, monkeypatch):
    src, _ = caches
    monkeypatch.setenv("KVFLOW_BACKEND", "torch")
    assert registry.get_backend("auto", torch.device("cpu")).name == "torch"
    monkeypatch.setenv("KVFLOW_BACKEND", "fake_off")
    gather_blocks(src, torch.tensor([0]), _out(1), backend="torch")  # explicit argument wins


@pytest.mark.parametrize("backend", backends_for("cpu"))
def test_unvalidated_out_of_range_ids_write_nothing(caches, backend):
    """With ``validate=False`` the kernels still skip ids outside the cache: no stray write."""
    src, dst = caches
    out = _out(3)
    ref = out.clone()
    gather_blocks(src, torch.tensor([NB, 0, -7]), out, backend=backend, validate=False)
    assert torch.equal(out[:, :, 1].view(torch.uint8), src_blocks(src, 0))
    assert torch.equal(out[:, :, 0::2].view(torch.uint8), ref[:, :, 0::2].view(torch.uint8))
    before = cache_bytes(dst)
    scatter_blocks(_out(2), dst, torch.tensor([NB + 5, -2]), backend=backend, validate=False)
    copy_blocks(src, dst, torch.tensor([NB, 1]), torch.tensor([2, 10**6]), backend=backend,
                validate=False)
    assert torch.equal(cache_bytes(dst), before)


def src_blocks(cache, block):
    """Block ``block`` of every tensor as the uint8 [layers, tensors, *block_bytes] of a staging slot."""
    return torch.stack([t[block] for t in cache.tensors()]).view(torch.uint8).reshape(
        SPEC.num_layers, SPEC.tensors_per_layer, *SPEC.block_shape[:-1], -1)


def test_user_report_edge_cases():
    """Found by a new-user test: each is refused naming the argument, or accepted consistently."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float16)
    cache = PagedKVCache(spec, 4)
    with pytest.raises(TypeError, match=re.escape("layers must be None, an int, a range, a slice or "
                                                  "(start, stop), got (True, 2)")):
        gather_blocks(cache, torch.tensor([0]), staging_buffer(spec, 1), (True, 2))
    with pytest.raises(ValueError, match=re.escape("num_blocks must be a non-negative int, got -1")):
        staging_buffer(spec, -1)
    out = staging_buffer(spec, 1).zero_().requires_grad_(True)
    with pytest.raises(ValueError, match=re.escape("out requires grad; kvflow's ops run outside "
                                                   "autograd (pass out.detach())")):
        gather_blocks(cache, torch.tensor([0]), out)
    np_ids = [np.int64(1), np.int32(3)]  # numpy integers in a list are ints too
    a, b = staging_buffer(spec, 2), staging_buffer(spec, 2)
    gather_blocks(cache, np_ids, a, backend="torch")
    gather_blocks(cache, torch.tensor([1, 3]), b, backend="torch")
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
