"""Property tests over random geometries, layouts, dtypes, layer ranges and id sets (with -1
padding): gather then scatter round-trips, and every CPU backend equals the torch reference
byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVCacheSpec, staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks

from tests.conftest import (DTYPES, LAYER_MAJOR, assert_bytes_equal, backends_for, cache_bytes,
                       random_bytes_, random_cache, takes_block_major)

BACKENDS = [b for b in backends_for("cpu") if b != "torch"]
BLOCK_MAJOR = [b for b in BACKENDS if takes_block_major(b)]  # BM_NHD: block_strides backends
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw, layouts=LAYER_MAJOR):
    layout = draw(st.sampled_from(layouts))
    return KVCacheSpec(num_layers=draw(st.integers(1, 4)),
                       num_kv_heads=1 if layout == "MLA" else draw(st.integers(1, 3)),
                       head_dim=draw(st.integers(1, 12)), block_size=draw(st.integers(1, 6)),
                       dtype=draw(st.sampled_from(DTYPES)), layout=layout)


@st.composite
def layer_ranges(draw, num_layers):
    start = draw(st.integers(0, num_layers - 1))
    stop = draw(st.integers(start + 1, num_layers))
    return draw(st.sampled_from([None, (start, stop), range(start, stop), start]))


@st.composite
def problems(draw, layouts=LAYER_MAJOR):
    """(spec, num_blocks, layers, source ids, distinct destination ids, id dtype, seed)."""
    spec = draw(specs(layouts))
    nb = draw(st.integers(1, 10))
    n = draw(st.integers(0, 12))
    src = draw(st.lists(st.integers(-1, nb - 1), min_size=n, max_size=n))
    dst = draw(st.permutations(list(range(nb)) + [-1] * n))[:n]
    return (spec, nb, draw(layer_ranges(spec.num_layers)), src, dst,
            draw(st.sampled_from([torch.int32, torch.int64])), draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@SETTINGS
@given(problems())
def test_gather_scatter_round_trip(backend, problem):
    _round_trip(backend, problem)


def _round_trip(backend, problem):
    spec, nb, layers, _, ids, id_dtype, seed = problem
    ids_t = torch.tensor(ids, dtype=id_dtype)
    a, b = random_cache(spec, nb, seed=seed), random_cache(spec, nb, seed=seed + 1)
    buf = random_bytes_(staging_buffer(spec, len(ids), layers), seed)
    gather_blocks(a, ids_t, buf, layers, backend=backend)
    scatter_blocks(buf, b, ids_t, layers, backend=backend)
    back = gather_blocks(b, ids_t, buf.clone(), layers, backend=backend)
    assert_bytes_equal(back, buf, "gather(scatter(gather(a)))")
    # b now holds a's bytes exactly at (layer in range, id in ids), and its own bytes elsewhere
    start = 0 if layers is None else (layers if isinstance(layers, int) else layers[0])
    count = buf.shape[0]
    T = spec.tensors_per_layer
    expect = [t.clone() for t in b.tensors()]
    for j in range(start * T, (start + count) * T):
        for i in ids:
            if i >= 0:
                expect[j][i] = a.tensors()[j][i]
    assert_bytes_equal(cache_bytes(b), torch.cat([e.reshape(-1).view(torch.uint8) for e in expect]),
                       "scattered cache")



@pytest.mark.skipif(not BACKENDS, reason="no CPU backend besides torch")
@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problems())
def test_backend_equals_torch(backend, problem):
    _equals_torch(backend, problem)


@pytest.mark.skipif(not BLOCK_MAJOR, reason="no CPU backend besides torch takes block strides")
@pytest.mark.parametrize("backend", BLOCK_MAJOR)
@SETTINGS
@given(problems(layouts=("BM_NHD",)))
def test_block_major_round_trip_and_equals_torch(backend, problem):
    """Both properties above on block-major BM_NHD caches (backends with ``block_strides``)."""
    _round_trip(backend, problem)
    _equals_torch(backend, problem)


def _equals_torch(backend, problem):
    spec, nb, layers, src_ids, dst_ids, id_dtype, seed = problem
    s, d = torch.tensor(src_ids, dtype=id_dtype), torch.tensor(dst_ids, dtype=id_dtype)
    src = random_cache(spec, nb, seed=seed)
    poison = random_bytes_(staging_buffer(spec, len(src_ids), layers), seed + 2)
    ref = gather_blocks(src, s, poison.clone(), layers, backend="torch")
    out = gather_blocks(src, s, poison.clone(), layers, backend=backend)
    assert_bytes_equal(out, ref, f"{backend} gather")
    x, y = random_cache(spec, nb, seed=seed + 3), random_cache(spec, nb, seed=seed + 3)
    scatter_blocks(poison, x, d, layers, backend="torch")
    scatter_blocks(poison, y, d, layers, backend=backend)
    assert_bytes_equal(cache_bytes(y), cache_bytes(x), f"{backend} scatter")
    copy_blocks(src, x, s, d, layers, backend="torch")
    copy_blocks(src, y, s, d, layers, backend=backend)
    assert_bytes_equal(cache_bytes(y), cache_bytes(x), f"{backend} copy_blocks")
