"""The ``native`` backend (C++ host extension ``kvflow._native``) against the torch reference.

Every destination byte is compared: destinations start as random non-zero bytes, so a write to
a padded slot, a block outside the ids or a layer outside the range shows. Sizes cover both the
single-thread path (small copies) and the thread-pool path (> 512 KiB), merged runs
(consecutive ids), block-major caches (``src_stride`` / ``dst_stride``), int32 ids, and ids
outside the cache with ``validate=False`` (skipped).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import available_backends, copy_blocks, gather_blocks, scatter_blocks
from kvflow.kernels import native

from tests.conftest import DTYPES, LAYOUTS, assert_bytes_equal, cache_bytes, make_spec, random_bytes_, random_cache

NB = 16
SRC_IDS = [15, -1, 3, 4, 5, -1, 0, 9]          # padding, a consecutive run 3,4,5, first/last block
DST_IDS = [2, 7, -1, 11, 12, 13, 0, 15]        # distinct; 11,12,13 continues with 4,5 -> merged


def _both(spec, seed):
    return random_cache(spec, NB, seed=seed), random_cache(spec, NB, seed=seed + 50)


def _clone(cache):
    out = PagedKVCache(cache.spec, cache.num_blocks)
    out.buffer.copy_(cache.buffer)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layers", [None, (1, 3), 2], ids=["all", "1-3", "2"])
def test_three_ops_match_torch_bytes(layout, dtype, layers):
    spec = make_spec(layout, dtype)
    src, dst = _both(spec, seed=hash((layout, str(dtype))) % 1000)
    ids = torch.tensor(SRC_IDS)
    # gather: the staging buffer's padded slots stay as they were
    out_n = random_bytes_(staging_buffer(spec, len(SRC_IDS), layers), 7)
    out_t = out_n.clone()
    gather_blocks(src, ids, out_n, layers, backend="native")
    gather_blocks(src, ids, out_t, layers, backend="torch")
    assert_bytes_equal(out_n, out_t, "gather")
    # scatter: blocks outside the ids and layers outside the range untouched
    d_n, d_t = dst, _clone(dst)
    scatter_blocks(out_t, d_n, torch.tensor(DST_IDS), layers, backend="native")
    scatter_blocks(out_t, d_t, torch.tensor(DST_IDS), layers, backend="torch")
    assert_bytes_equal(cache_bytes(d_n), cache_bytes(d_t), "scatter")
    # copy_blocks between two caches
    c_n, c_t = _clone(dst), _clone(dst)
    copy_blocks(src, c_n, ids, torch.tensor(DST_IDS), layers, backend="native")
    copy_blocks(src, c_t, ids, torch.tensor(DST_IDS), layers, backend="torch")
    assert_bytes_equal(cache_bytes(c_n), cache_bytes(c_t), "copy_blocks")


def test_reference_semantics_directly():
    """Against direct indexing, not only against the torch backend: block 3 of layer 1's V lands
    in slot 2; slot 1 (padding) keeps its bytes."""
    spec = make_spec("NHD", torch.float16)
    src = random_cache(spec, NB, seed=3)
    out = random_bytes_(staging_buffer(spec, len(SRC_IDS)), 9)
    before = out.clone()
    gather_blocks(src, torch.tensor(SRC_IDS), out, backend="native")
    assert torch.equal(out[1, 1, 2].view(torch.uint8), src.layer(1)[1][3].view(torch.uint8))
    assert torch.equal(out[3, 0, 0].view(torch.uint8), src.layer(3)[0][15].view(torch.uint8))
    assert torch.equal(out[:, :, 1].view(torch.uint8), before[:, :, 1].view(torch.uint8))


@pytest.mark.parametrize("threads", ["1", "2", "0"])
def test_thread_pool_path_large_copy(threads, monkeypatch):
    """4 layers x 2 x 32 KiB blocks x 24 ids = 6 MiB: split over the pool (unless 1 thread)."""
    monkeypatch.setenv("KVFLOW_NATIVE_THREADS", threads)
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.float16, layout="HND")
    src, dst = random_cache(spec, 40, seed=1), random_cache(spec, 40, seed=2)
    g = torch.Generator().manual_seed(5)
    s = torch.randperm(40, generator=g)[:24]
    s[10:16] = torch.arange(20, 26)  # a long consecutive run on both sides: one merged memcpy
    rest = torch.tensor([i for i in torch.randperm(40, generator=g).tolist() if not 30 <= i < 36])
    d = torch.cat([rest[:10], torch.arange(30, 36), rest[10:18]])
    s[3], d[7] = -1, -1
    ref = PagedKVCache(spec, 40)
    ref.buffer.copy_(dst.buffer)
    copy_blocks(src, dst, s, d, backend="native")
    copy_blocks(src, ref, s, d, backend="torch")
    assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), f"copy_blocks threads={threads}")
    out_n, out_t = staging_buffer(spec, 24), staging_buffer(spec, 24)
    out_n.zero_(), out_t.zero_()
    gather_blocks(src, s.to(torch.int32), out_n, backend="native")
    gather_blocks(src, s, out_t, backend="torch")
    assert_bytes_equal(out_n, out_t, "gather int32 ids")


def test_out_of_range_ids_skipped_without_validation():
    spec = make_spec("MLA", torch.bfloat16)
    src, dst = _both(spec, seed=11)
    before = cache_bytes(dst)
    copy_blocks(src, dst, torch.tensor([NB, -7, 2]), torch.tensor([1, 2, NB + 3]),
                backend="native", validate=False)
    assert_bytes_equal(cache_bytes(dst), before, "ids outside the cache must be skipped")


def test_pointer_level_copy_runs():
    a = np.arange(4 * 6, dtype=np.uint8).reshape(2, 12)  # 2 tensors x 3 runs of 4 bytes
    b = np.full((2, 8), 255, dtype=np.uint8)              # 2 tensors x 2 runs
    n = native.copy_runs_ptr([a[0].ctypes.data, a[1].ctypes.data], [b[0].ctypes.data, b[1].ctypes.data],
                             [2, -1], None, src_n=3, dst_n=2, run_bytes=4)
    assert n == 2
    assert b[0].tolist() == [8, 9, 10, 11] + [255] * 4
    assert b[1].tolist() == [20, 21, 22, 23] + [255] * 4


def test_native_argument_errors_name_the_argument():
    from kvflow import _native
    with pytest.raises(ValueError, match=r"^run_bytes must be positive, got 0$"):
        _native.copy_blocks(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                            np.zeros(1, np.int64), 1, 1, 0)
    with pytest.raises(ValueError, match=r"^dst_ptrs has 1 entries; expected 2$"):
        _native.copy_blocks(np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                            np.zeros(1, np.int64), 1, 1, 8)
    with pytest.raises(ValueError, match=r"^device='xpu' was not compiled into kvflow._native"):
        _native.copy_blocks(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([-1]),
                            np.array([-1]), 1, 1, 8, device="xpu")
    with pytest.raises(ValueError, match="KVFLOW_NATIVE_THREADS must be a non-negative int, got 'x'"):
        os.environ["KVFLOW_NATIVE_THREADS"] = "x"
        try:
            spec = make_spec("NHD", torch.float32)
            gather_blocks(random_cache(spec, NB), [1], staging_buffer(spec, 1), backend="native")
        finally:
            del os.environ["KVFLOW_NATIVE_THREADS"]


@pytest.mark.skipif(bool(os.environ.get("KVFLOW_XPU_SDK")), reason="built with the Kunlun SDK")
def test_available_backends_say_host_only():
    from kvflow import _native
    assert _native.available_backends() == ["host"]
    assert _native.build_info()["cxx_standard"] >= 201703
    state = available_backends()
    assert state["native"] == "available"
    assert state["xpu"] == ("kvflow._native was built without the xpu backend (compiled: ['host']); "
                            "set KVFLOW_XPU_SDK and reinstall")
    spec = make_spec("NHD", torch.float32)
    with pytest.raises(RuntimeError, match=r"^backend='xpu' is unavailable: kvflow._native was built"):
        gather_blocks(random_cache(spec, NB), [1], staging_buffer(spec, 1), backend="xpu")


def test_peer_mem_addr_host_is_the_pointer():
    t = torch.zeros(64, dtype=torch.uint8)
    assert native.get_peer_mem_addr(t) == t.data_ptr()
    assert native.get_peer_mem_addr(12345) == 12345
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor or an int address, got str"):
        native.get_peer_mem_addr("0x10")


def test_pointer_level_block_strides():
    """Block-major addressing: 2 tensors interleaved per block (runs of 4 bytes, stride 8).
    Consecutive ids are not adjacent then, so they must not merge into one 8-byte memcpy."""
    a = np.arange(24, dtype=np.uint8)                     # 3 blocks x 2 tensors x 4 bytes
    b = np.full(16, 255, dtype=np.uint8)                  # 2 blocks x 2 tensors x 4 bytes
    pa, pb = a.ctypes.data, b.ctypes.data
    n = native.copy_runs_ptr([pa, pa + 4], [pb, pb + 4], [2, 0], [0, 1], src_n=3, dst_n=2,
                             run_bytes=4, src_stride=8, dst_stride=8)
    assert n == 4
    assert b.tolist() == list(range(16, 24)) + list(range(0, 8))
    b[:] = 255
    assert native.copy_runs_ptr([pa], [pb], [0, 1], [0, 1], src_n=3, dst_n=2, run_bytes=4,
                                src_stride=8, dst_stride=8) == 2
    assert b.tolist() == [0, 1, 2, 3] + [255] * 4 + [8, 9, 10, 11] + [255] * 4
    b[:] = 255  # strided source into a staging side (stride run_bytes, the default)
    assert native.copy_runs_ptr([pa + 4], [pb], [1, 2], None, src_n=3, dst_n=2, run_bytes=4,
                                src_stride=8) == 2
    assert b.tolist() == [12, 13, 14, 15, 20, 21, 22, 23] + [255] * 8


def test_native_stride_errors_name_the_argument():
    from kvflow import _native
    one, ids = np.zeros(1, np.int64), np.array([-1])
    with pytest.raises(ValueError, match=r"^src_stride must be positive, got 0$"):
        _native.copy_blocks(one, one, ids, ids, 1, 1, 8, src_stride=0)
    with pytest.raises(ValueError, match=r"^dst_stride must be >= run_bytes \(8\), got 4$"):
        _native.copy_blocks(one, one, ids, ids, 1, 1, 8, dst_stride=4)
    with pytest.raises(ValueError, match=r"^src_stride must be positive, got -16$"):
        _native.gather_blocks(one, ids, 0, 1, 8, src_stride=-16)
    with pytest.raises(ValueError, match=r"^dst_stride must be >= run_bytes \(8\), got 7$"):
        _native.scatter_blocks(0, one, ids, 1, 8, dst_stride=7)
    with pytest.raises(ValueError, match=r"^src_stride must be >= run_bytes \(8\), got 1$"):
        _native.copy_runs(one, one, ids, None, 1, 1, 1, 8, src_stride=1)
    with pytest.raises(TypeError):  # a staging side has no stride
        _native.gather_blocks(one, ids, 0, 1, 8, dst_stride=8)
    with pytest.raises(TypeError):  # keyword-only: old positional calls keep their meaning
        _native.copy_blocks(one, one, ids, ids, 1, 1, 8, 0, "host", 0, 16)
    assert _native.copy_blocks(one, one, ids, ids, 1, 1, 8, src_stride=8, dst_stride=64) == 0
    with pytest.raises(ValueError, match=r"^src_stride must be >= run_bytes \(4\), got 2$"):
        native.copy_runs_ptr([0], [0], [-1], None, src_n=1, dst_n=1, run_bytes=4, src_stride=2)


def test_block_major_cache_merged_and_strided_runs():
    """BM_NHD (stride 8 * block_bytes) on the thread-pool path (> 512 KiB): consecutive ids,
    padding, first and last block; all layers and a range."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.float16, layout="BM_NHD")
    assert spec.block_stride_bytes == 8 * spec.block_bytes
    src, dst = random_cache(spec, 40, seed=4), random_cache(spec, 40, seed=6)
    s = torch.tensor([3, 4, 5, 6, -1, 20, 0, 39])
    d = torch.tensor([10, 11, 12, 13, 14, -1, 39, 0])
    ref = _clone(dst)
    copy_blocks(src, dst, s, d, backend="native")
    copy_blocks(src, ref, s, d, backend="torch")
    assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), "block-major copy_blocks")
    for layers in (None, (1, 3)):
        out_n = random_bytes_(staging_buffer(spec, len(s), layers), 3)
        out_t = out_n.clone()
        gather_blocks(src, s, out_n, layers, backend="native")
        gather_blocks(src, s, out_t, layers, backend="torch")
        assert_bytes_equal(out_n, out_t, f"block-major gather layers={layers}")
        scatter_blocks(out_t, dst, d, layers, backend="native")
        scatter_blocks(out_t, ref, d, layers, backend="torch")
        assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), f"block-major scatter layers={layers}")
