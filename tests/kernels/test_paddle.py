"""Every public op takes paddle tensors (ids, staging buffers, caches from paddle tensors),
zero-copy through DLPack, and moves exactly the torch reference's bytes.

Zero copy is shown two ways: the torch view has the paddle tensor's ``data_ptr``, and the bytes
an op writes are read back *through paddle* (``paddle.Tensor.numpy``), not through the view.
Skipped when paddlepaddle (the ``[paddle]`` extra) is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

paddle = pytest.importorskip("paddle")

from kvflow import KVCacheSpec, PagedKVCache, staging_shape  # noqa: E402
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks  # noqa: E402
from kvflow.dlpack import to_torch  # noqa: E402

from tests.conftest import assert_bytes_equal, backends_for, cache_bytes, random_cache  # noqa: E402

BACKENDS = backends_for("cpu")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}
IDS = [4, -1, 0, 7, 2]
DST = [1, 6, -1, 0, 3]


def _spec(dtype: str) -> KVCacheSpec:
    return KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2,
                       dtype=getattr(paddle, dtype), layout="NHD")


def _paddle_bytes(x) -> np.ndarray:
    """The bytes of a CPU paddle tensor, read by paddle itself."""
    return np.ascontiguousarray(x.view(paddle.uint8).numpy()).reshape(-1) \
        if x.dtype != paddle.uint8 else x.numpy().reshape(-1)


def _paddle_cache(spec: KVCacheSpec, num_blocks: int, seed: int):
    """Paddle tensors holding random bytes, and a PagedKVCache wrapped over them."""
    ref = random_cache(spec, num_blocks, "cpu", seed=seed)
    tensors = []
    for t in ref.tensors():
        p = paddle.to_tensor(t.view(torch.uint8).numpy()).view(getattr(paddle, str(t.dtype)[6:]))
        tensors.append(p)
    return tensors, PagedKVCache.from_tensors(spec, tensors), ref


def test_dtype_names_map():
    assert _spec("float8_e4m3fn").dtype is torch.float8_e4m3fn
    assert _spec("bfloat16").dtype is torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_into_paddle_buffer_with_paddle_ids(backend, dtype):
    spec = _spec(dtype)
    tensors, cache, ref_cache = _paddle_cache(spec, 8, seed=1)
    assert [t.data_ptr() for t in cache.tensors()] == [p.data_ptr() for p in tensors]
    out = paddle.zeros(list(staging_shape(spec, len(IDS), (1, 3))), dtype=getattr(paddle, dtype))
    ref = torch.zeros(staging_shape(spec, len(IDS), (1, 3)), dtype=spec.dtype)
    gather_blocks(ref_cache, torch.tensor(IDS), ref, (1, 3), backend="torch")
    got = gather_blocks(cache, paddle.to_tensor(IDS, dtype="int32"), out, (1, 3), backend=backend)
    assert got.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(_paddle_bytes(out), ref.view(torch.uint8).numpy().reshape(-1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_and_copy_into_paddle_cache(backend, dtype):
    spec = _spec(dtype)
    src_np = np.random.default_rng(0).integers(1, 256, size=int(np.prod(staging_shape(
        spec, len(IDS)))) * spec.itemsize, dtype=np.uint8)
    src = paddle.to_tensor(src_np).view(getattr(paddle, dtype)).reshape(
        list(staging_shape(spec, len(IDS))))
    tensors, cache, ref = _paddle_cache(spec, 8, seed=2)
    scatter_blocks(to_torch(src, "src"), ref, torch.tensor(DST), backend="torch")
    scatter_blocks(src, cache, paddle.to_tensor(DST, dtype="int64"), backend=backend)
    got = np.concatenate([_paddle_bytes(p) for p in tensors])
    np.testing.assert_array_equal(got, cache_bytes(ref).numpy())

    other_tensors, other, other_ref = _paddle_cache(spec, 8, seed=3)
    s, d = paddle.to_tensor([7, 0, -1, 5]), paddle.to_tensor([2, -1, 4, 6])
    copy_blocks(ref, other_ref, torch.tensor([7, 0, -1, 5]), torch.tensor([2, -1, 4, 6]),
                (0, 2), backend="torch")
    copy_blocks(cache, other, s, d, (0, 2), backend=backend)
    got = np.concatenate([_paddle_bytes(p) for p in other_tensors])
    np.testing.assert_array_equal(got, cache_bytes(other_ref).numpy())
    assert_bytes_equal(cache_bytes(other), cache_bytes(other_ref), f"{backend} copy (torch view)")


def test_paddle_tensor_of_wrong_dtype_is_named():
    spec = _spec("bfloat16")
    tensors, _, _ = _paddle_cache(spec, 4, seed=1)
    tensors[3] = paddle.zeros(tensors[3].shape, dtype="float16")
    with pytest.raises(TypeError, match=r"^tensors\[3\]\.dtype is torch\.float16; "
                                        r"spec\.dtype is torch\.bfloat16$"):
        PagedKVCache.from_tensors(spec, tensors)


def test_paddle_float_ids_are_refused():
    spec = _spec("float32")
    _, cache, _ = _paddle_cache(spec, 4, seed=1)
    out = paddle.zeros(list(staging_shape(spec, 2)), dtype="float32")
    with pytest.raises(TypeError, match=r"^block_ids must have dtype torch\.int32 or torch\.int64, "
                                        r"got torch\.float32$"):
        gather_blocks(cache, paddle.to_tensor([0.0, 1.0]), out)
