"""KVCacheSpec geometry, dtype names, serialisation; PagedKVCache tensor order, views and
wrapping; staging shapes; a cheap ``import kvflow``; and bad spec / cache input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer, staging_shape
from kvflow.kernels import gather_blocks
from kvflow.layout import as_torch_dtype

from tests.conftest import DTYPES, LAYOUTS, assert_bytes_equal, random_cache

LLAMA3_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64,
                        dtype=torch.bfloat16, layout="NHD")
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16,
                   layout="NHD")
GOOD = dict(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16", layout="NHD")


def test_llama3_8b_geometry():
    s = LLAMA3_8B
    assert s.block_shape == (64, 8, 128)
    assert (s.tensors_per_layer, s.num_tensors) == (2, 64)
    assert s.itemsize == 2
    assert s.block_numel == 64 * 8 * 128
    assert s.block_bytes == 128 * 1024  # one block of one tensor: 128 KiB
    assert s.bytes_per_block == 8 * 2**20  # one block over 32 layers x (K, V): 8 MiB
    assert s.bytes_per_token == 128 * 1024  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    assert s.tensor_shape(256) == (256, 64, 8, 128)
    assert s.num_blocks_for(4096) == 64 and s.num_blocks_for(4097) == 65
    assert s.latent_dim == 1024


@pytest.mark.parametrize("layout,shape,tpl", [
    ("NHD", (16, 4, 32), 2), ("HND", (4, 16, 32), 2), ("MLA", (16, 32), 1),
    ("LBHNC", (4, 16, 64), 1), ("LBNHC", (16, 4, 64), 1)])
def test_block_shape_per_layout(layout, shape, tpl):
    heads = 1 if layout == "MLA" else 4
    s = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=32, block_size=16,
                    dtype=torch.float16, layout=layout)
    assert s.block_shape == shape
    assert s.tensors_per_layer == tpl and s.num_tensors == 3 * tpl
    assert s.block_bytes == 2 * int(np.prod(shape))
    assert s.bytes_per_block == 3 * tpl * s.block_bytes


@pytest.mark.parametrize("name,expect", [
    (torch.float8_e4m3fn, torch.float8_e4m3fn), (np.float16, torch.float16),
    (np.dtype("float32"), torch.float32), (np.dtype("uint8"), torch.uint8),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("half", torch.float16), ("float32", torch.float32),
    ("paddle.bfloat16", torch.bfloat16), ("paddle.float8_e4m3fn", torch.float8_e4m3fn),
    ("VarType.BF16", torch.bfloat16), ("VarType.FP16", torch.float16), ("VarType.FP32", torch.float32),
    ("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("FLOAT16", torch.float16),
], ids=str)
def test_dtype_conversion(name, expect):
    assert as_torch_dtype(name) is expect
    assert KVCacheSpec(**dict(GOOD, dtype=name)).dtype is expect


def test_paddle_like_dtype_object():
    class PaddleDType:  # paddle.bfloat16 prints as 'paddle.bfloat16' and has no .name
        def __str__(self):
            return "paddle.bfloat16"
    assert as_torch_dtype(PaddleDType()) is torch.bfloat16


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_dict_round_trip(layout, dtype):
    s = KVCacheSpec(num_layers=2, num_kv_heads=1 if layout == "MLA" else 4, head_dim=16,
                    block_size=8, dtype=dtype, layout=layout)
    d = s.to_dict()
    assert d["dtype"] == str(dtype).removeprefix("torch.") and d["layout"] == layout
    assert KVCacheSpec.from_dict(json.loads(json.dumps(d))) == s
    assert hash(KVCacheSpec.from_dict(d)) == hash(s)


def test_diff_and_with():
    other = SPEC.with_(block_size=16, dtype=torch.float16)
    assert other.block_size == 16 and SPEC.block_size == 4
    assert SPEC.diff(other) == ["block_size: 4 vs 16", "dtype: torch.bfloat16 vs torch.float16"]
    assert SPEC.diff(SPEC) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_tensor_order_and_views(layout):
    spec = SPEC.with_(layout=layout, num_kv_heads=1 if layout == "MLA" else 2)
    cache = PagedKVCache(spec, 5)
    ts, T = cache.tensors(), spec.tensors_per_layer
    assert len(ts) == spec.num_tensors and cache.nbytes == 5 * spec.bytes_per_block
    per_tensor = 5 * spec.block_bytes
    for i, t in enumerate(ts):
        assert t.shape == (5, *spec.block_shape) and t.dtype == spec.dtype and t.stride() == spec.tensor_strides()
        assert t.data_ptr() == cache.buffer.data_ptr() + spec.tensor_offset(i, 5)  # the spec's offsets
        assert cache.layer(i // T)[i % T] is ts[i]
    assert cache.ptr_table().tolist() == [t.data_ptr() for t in ts]
    assert cache.ptr_table() is cache.ptr_table()  # built once
    # a write to layer 2's last tensor (V, or the MLA latent) block 3 lands at its bytes
    cache.layer(2)[-1][3].view(torch.uint8).fill_(7)
    off = spec.tensor_offset(3 * T - 1, 5) + 3 * spec.block_stride_bytes
    assert int(cache.buffer.ne(0).sum()) == spec.block_bytes
    assert bool((cache.buffer[off:off + spec.block_bytes] == 7).all())


def test_buffer_backed_cache_shares_memory():
    need = 6 * SPEC.bytes_per_block
    buf = torch.zeros(need + 100, dtype=torch.uint8)
    cache = PagedKVCache(SPEC, 6, buffer=buf)
    assert cache.buffer is buf and cache.device == buf.device
    cache.tensors()[0][0, 0, 0, 0] = 1.0
    assert buf[:2].view(torch.bfloat16).item() == 1.0
    assert bool((buf[need:] == 0).all())


def test_from_tensors_wraps_without_copy():
    src = random_cache(SPEC, 6, seed=1)
    tensors = [t.clone() for t in src.tensors()]
    wrapped = PagedKVCache.from_tensors(SPEC, tensors)
    assert wrapped.buffer is None and wrapped.num_blocks == 6
    assert [t.data_ptr() for t in wrapped.tensors()] == [t.data_ptr() for t in tensors]
    ids = torch.tensor([4, -1, 0])
    for backend in ("torch", "numba"):
        a = gather_blocks(src, ids, torch.zeros(staging_shape(SPEC, 3), dtype=SPEC.dtype),
                          backend=backend)
        b = gather_blocks(wrapped, ids, torch.zeros(staging_shape(SPEC, 3), dtype=SPEC.dtype),
                          backend=backend)
        assert_bytes_equal(b, a, f"{backend} gather from wrapped tensors")


@pytest.mark.parametrize("layers,first", [(None, 4), ((1, 3), 2), (2, 1), (range(0, 3), 3),
                                          (slice(1, None), 3)], ids=str)
def test_staging_shape(layers, first):
    assert staging_shape(SPEC, 5, layers) == (first, 2, 5, 4, 2, 8)
    mla = SPEC.with_(layout="MLA", num_kv_heads=1)
    assert staging_shape(mla, 5, layers) == (first, 1, 5, 4, 8)
    buf = staging_buffer(SPEC, 5, layers)
    assert buf.shape == (first, 2, 5, 4, 2, 8) and buf.dtype == torch.bfloat16
    assert buf.is_contiguous() and buf.device.type == "cpu"


def test_import_is_cheap_and_compiles_nothing():
    code = ("import sys, time; t = time.perf_counter(); import kvflow; "
            "dt = time.perf_counter() - t; spec = kvflow.KVCacheSpec; "
            "from kvflow.kernels import gather_blocks; "
            "print(dt, sorted(m for m in ('numba', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split(maxsplit=1)
    assert float(out[0]) < 1.0, f"import kvflow took {out[0]} s"
    assert out[1].strip() == "[]", f"import kvflow and its ops loaded {out[1].strip()}"


# ---- bad KVCacheSpec / PagedKVCache input -----------------------------------------------------------


@pytest.mark.parametrize("field,value,exc,message", [
    ("num_layers", -1, ValueError, "num_layers must be positive, got -1"),
    ("num_kv_heads", 0, ValueError, "num_kv_heads must be positive, got 0"),
    ("head_dim", 8.0, TypeError, "head_dim must be an int, got 8.0"),
    ("block_size", "16", TypeError, "block_size must be an int, got '16'"),
    ("block_size", True, TypeError, "block_size must be an int, got True"),
    ("layout", "NDH", ValueError, "layout must be one of ('NHD', 'HND', 'MLA', 'LBHNC', 'LBNHC', 'BM_NHD'), got 'NDH'"),
    ("layout", "nhd", ValueError, "layout must be one of ('NHD', 'HND', 'MLA', 'LBHNC', 'LBNHC', 'BM_NHD'), got 'nhd'"),
    ("num_kv_heads", 2, ValueError, None),  # with layout MLA, below
], ids=lambda v: v if isinstance(v, str) else None)
def test_spec_bad_field(field, value, exc, message):
    kw = dict(GOOD, **{field: value})
    if message is None:
        kw["layout"] = "MLA"
        message = "layout='MLA' stores one latent per token: num_kv_heads must be 1, got 2"
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        KVCacheSpec(**kw)


@pytest.mark.parametrize("dtype", ["complex64", "float64x", torch.nn.Module, 3])
def test_spec_unknown_dtype(dtype):
    with pytest.raises(TypeError, match="^" + re.escape(f"dtype={dtype!r} is not a dtype kvflow "
                                                         f"can store; use a torch.dtype or one of "
                                                         f"the names [")):
        KVCacheSpec(**dict(GOOD, dtype=dtype))


def test_spec_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        KVCacheSpec(4, 2, 8, 4, torch.bfloat16)
    with pytest.raises(AttributeError):
        SPEC.num_layers = 8


@pytest.mark.parametrize("num_blocks,exc,message", [
    (0, ValueError, "num_blocks must be positive, got 0"),
    (-3, ValueError, "num_blocks must be positive, got -3"),
    (2.5, TypeError, "num_blocks must be an int, got 2.5"),
    (True, TypeError, "num_blocks must be an int, got True"),
    ("8", TypeError, "num_blocks must be an int, got '8'"),
], ids=repr)
def test_cache_bad_num_blocks(num_blocks, exc, message):
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        PagedKVCache(SPEC, num_blocks)


def test_cache_bad_spec():
    with pytest.raises(TypeError, match="^spec must be a KVCacheSpec, got dict$"):
        PagedKVCache(GOOD, 4)


@pytest.mark.parametrize("buffer,shape", [
    (torch.zeros(2048, dtype=torch.float32), "torch.float32 of shape (2048,)"),
    (torch.zeros(2, 8192, dtype=torch.uint8), "torch.uint8 of shape (2, 8192)"),
    (torch.zeros(16384, dtype=torch.uint8)[::2], "torch.uint8 of shape (8192,)"),
    (bytearray(8192), "<class 'bytearray'> of shape ()"),
], ids=["float32", "2-D", "strided", "bytearray"])
def test_cache_bad_buffer_type(buffer, shape):
    with pytest.raises(TypeError, match="^" + re.escape(
            f"buffer must be a flat contiguous uint8 tensor, got {shape}") + "$"):
        PagedKVCache(SPEC, 2, buffer=buffer)


def test_cache_buffer_too_small():
    need = 2 * SPEC.bytes_per_block
    with pytest.raises(ValueError, match=f"^buffer holds {need - 1} bytes; the cache needs {need}$"):
        PagedKVCache(SPEC, 2, buffer=torch.zeros(need - 1, dtype=torch.uint8))


def test_from_tensors_bad_entries():
    good = [torch.zeros(SPEC.tensor_shape(3), dtype=SPEC.dtype) for _ in range(SPEC.num_tensors)]
    cases = [
        (good[:-1], ValueError, "tensors has 7 entries; spec needs 8 (4 layers x 2)"),
        (good[:2] + [good[2].half()] + good[3:], TypeError,
         "tensors[2].dtype is torch.float16; spec.dtype is torch.bfloat16"),
        (good[:7] + [good[7][:2]], ValueError, "tensors[7].shape is (2, 4, 2, 8); expected (3, 4, 2, 8)"),
        (good[:1] + [good[1].transpose(1, 2).contiguous().transpose(1, 2)] + good[2:], ValueError,
         "tensors[1] must be contiguous, got strides (64, 8, 32, 1)"),
        (good[:3] + [good[3].clone().requires_grad_(True)] + good[4:], ValueError,
         "tensors[3] requires grad; a KV cache is written in place outside autograd "
         "(pass tensors[3].detach())"),
        ([t[:0] for t in good], ValueError,
         "tensors hold 0 blocks (tensors[0].shape is (0, 4, 2, 8)); num_blocks must be positive"),
    ]
    for tensors, exc, message in cases:
        with pytest.raises(exc, match="^" + re.escape(message) + "$"):
            PagedKVCache.from_tensors(SPEC, tensors)
    flipped = [np.zeros((3, 4, 2, 8), dtype=np.float32)[::-1] for _ in range(SPEC.num_tensors)]
    with pytest.raises(TypeError, match="^" + re.escape(
            "tensors[0] has a negative stride ((-256, 64, 32, 4)); pass a copy with positive "
            "strides (e.g. numpy.ascontiguousarray)") + "$"):
        PagedKVCache.from_tensors(SPEC.with_(dtype=torch.float32), flipped)


def test_buffer_at_an_address_the_dtype_cannot_start_at():
    raw = torch.zeros(2 * SPEC.bytes_per_block + 16, dtype=torch.uint8)
    off = 1 if raw.data_ptr() % 2 == 0 else 0
    buf = raw[off:]
    with pytest.raises(ValueError, match="^" + re.escape(
            f"buffer starts at address {buf.data_ptr():#x}, not a multiple of 2 bytes "
            f"(torch.bfloat16); lay the cache over an aligned slice") + "$"):
        PagedKVCache(SPEC, 2, buffer=buf)


def test_staging_buffer_bad_layers():
    with pytest.raises(ValueError, match=re.escape("layers=(0, 9) is outside the cache's 4 layers")):
        staging_buffer(SPEC, 2, (0, 9))
