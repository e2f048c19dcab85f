"""Every backend matches the torch reference byte for byte, for every op x layout x dtype x layer
range, with -1 padding, and leaves every byte it must not touch as it was.

Destinations are poisoned with random bytes first, and every byte of them is compared, so a
backend that writes a padded slot, a block outside the ids, or a layer outside the range fails.
The reference itself is checked against direct indexing (``_expect_*``), so a wrong reference
cannot hide a wrong backend.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import copy_blocks, copy_sequence, gather_blocks, payload_bytes, registry, scatter_blocks
from kvflow.layout import normalize_layers

from tests.conftest import (DEVICES, DTYPES, GEOMETRY, LAYOUTS, assert_bytes_equal, backends_for,
                       cache_bytes, make_spec, random_bytes_, random_cache, takes_block_major)

LAYER_RANGES = (None, (1, 3), 2)  # all layers, a partial range, a single layer (as an int)
ID_DTYPES = (torch.int32, torch.int64)
CASES = [(dev, be) for dev in DEVICES for be in backends_for(dev) if be != "torch"]
DT_NAMES = {d: str(d).removeprefix("torch.") for d in DTYPES}


def _ids(values: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _src_ids(n_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` ids: first and last block, random others (repeats allowed for a source), -1 at 1 and 4."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n_blocks, (n,), generator=g).tolist()
    ids[0], ids[-1] = n_blocks - 1, 0
    for p in (1, 4):
        if p < n - 1:
            ids[p] = -1
    return ids


def _dst_ids(n_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` distinct destination ids (first and last block included), -1 at 2 and 5."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(n_blocks, generator=g)[:n].tolist()
    if 0 not in ids:
        ids[-1] = 0
    if n_blocks - 1 not in ids:
        ids[0] = n_blocks - 1
    for p in (2, 5):
        if p < n - 1:
            ids[p] = -1
    return ids


def _expect_gather(cache: PagedKVCache, ids: list[int], poison: torch.Tensor, layers) -> torch.Tensor:
    start, stop = normalize_layers(layers, cache.spec.num_layers)
    T, tensors = cache.spec.tensors_per_layer, cache.tensors()
    out = poison.clone()
    for li in range(stop - start):
        for t in range(T):
            for i, b in enumerate(ids):
                if b >= 0:
                    out[li, t, i] = tensors[(start + li) * T + t][b]
    return out


param_lt = pytest.mark.parametrize("layout", LAYOUTS)
param_dt = pytest.mark.parametrize("dtype", DTYPES, ids=DT_NAMES.get)
param_case = pytest.mark.parametrize("device,backend", CASES)


@param_case
@param_lt
@param_dt
def test_gather_matches_reference(device, backend, layout, dtype):
    spec, g = make_spec(layout, dtype), GEOMETRY
    cache = random_cache(spec, g.num_blocks, device, seed=1)
    before = cache_bytes(cache)
    for k, layers in enumerate(LAYER_RANGES):
        id_list = _src_ids(g.num_blocks, g.num_ids, seed=k)
        ids = _ids(id_list, ID_DTYPES[k % 2], device)
        poison = random_bytes_(staging_buffer(spec, len(id_list), layers, device), seed=10 + k)
        ref, out = poison.clone(), poison.clone()
        gather_blocks(cache, ids, ref, layers, backend="torch")
        assert_bytes_equal(ref, _expect_gather(cache, id_list, poison, layers), f"torch {layers}")
        assert gather_blocks(cache, ids, out, layers, backend=backend) is out
        assert_bytes_equal(out, ref, f"{backend} gather layers={layers}")
    assert_bytes_equal(cache_bytes(cache), before, "gather wrote its source")


@param_case
@param_lt
@param_dt
def test_scatter_matches_reference(device, backend, layout, dtype):
    spec, g = make_spec(layout, dtype), GEOMETRY
    for k, layers in enumerate(LAYER_RANGES):
        id_list = _dst_ids(g.num_blocks, g.num_ids, seed=k)
        ids = _ids(id_list, ID_DTYPES[k % 2], device)
        src = random_bytes_(staging_buffer(spec, len(id_list), layers, device), seed=20 + k)
        src_before = src.clone()
        ref = random_cache(spec, g.num_blocks, device, seed=2)
        dst = random_cache(spec, g.num_blocks, device, seed=2)
        scatter_blocks(src, ref, ids, layers, backend="torch")
        # the reference: valid slots land in their blocks, every other byte keeps its value
        regathered = torch.empty_like(src)
        gather_blocks(ref, ids, random_bytes_(regathered, 3), layers, backend="torch")
        valid = torch.tensor([b >= 0 for b in id_list], device=device)
        assert_bytes_equal(regathered[:, :, valid], src[:, :, valid], "torch scatter")
        n_valid = int(valid.sum())
        changed = int((cache_bytes(ref) != cache_bytes(random_cache(spec, g.num_blocks, device, 2))).sum())
        assert changed <= payload_bytes(spec, n_valid, layers)
        assert scatter_blocks(src, dst, ids, layers, backend=backend) is dst
        assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), f"{backend} scatter layers={layers}")
        assert_bytes_equal(src, src_before, "scatter wrote its source")


@param_case
@param_lt
@param_dt
def test_copy_blocks_matches_reference(device, backend, layout, dtype):
    spec, g = make_spec(layout, dtype), GEOMETRY
    src = random_cache(spec, g.num_blocks, device, seed=4)
    src_before = cache_bytes(src)
    for k, layers in enumerate(LAYER_RANGES):
        s_list = _src_ids(g.num_blocks, g.num_ids, seed=30 + k)
        d_list = _dst_ids(g.num_blocks + 3, g.num_ids, seed=40 + k)  # a larger destination cache
        s, d = _ids(s_list, ID_DTYPES[k % 2], device), _ids(d_list, ID_DTYPES[(k + 1) % 2], device)
        ref = random_cache(spec, g.num_blocks + 3, device, seed=5)
        dst = random_cache(spec, g.num_blocks + 3, device, seed=5)
        copy_blocks(src, ref, s, d, layers, backend="torch")
        assert copy_blocks(src, dst, s, d, layers, backend=backend) is dst
        assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), f"{backend} copy layers={layers}")
    assert_bytes_equal(cache_bytes(src), src_before, "copy_blocks wrote its source")


def test_torch_copy_reference_is_direct_indexing():
    """The reference copy, checked against per-block assignment (padding on either side)."""
    spec = make_spec("NHD", torch.float16)
    src = random_cache(spec, 8, seed=6)
    dst = random_cache(spec, 10, seed=7)
    expect = [t.clone() for t in dst.tensors()]
    pairs = [(7, 9), (-1, 3), (2, -1), (0, 0), (2, 5)]
    for j in range(2 * 1, 2 * 3):  # layers (1, 3)
        for s, d in pairs:
            if s >= 0 and d >= 0:
                expect[j][d] = src.tensors()[j][s]
    copy_blocks(src, dst, [p[0] for p in pairs], [p[1] for p in pairs], (1, 3), backend="torch")
    for j, t in enumerate(dst.tensors()):
        assert_bytes_equal(t, expect[j], f"tensor {j}")


@param_case
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
def test_copy_blocks_same_cache_disjoint_ids(device, backend, id_dtype):
    spec, g = make_spec("HND", torch.bfloat16), GEOMETRY
    s_list, d_list = [0, 3, -1, 5, 9], [1, 2, 4, -1, 15]
    s, d = _ids(s_list, id_dtype, device), _ids(d_list, id_dtype, device)
    ref = random_cache(spec, g.num_blocks, device, seed=8)
    cache = random_cache(spec, g.num_blocks, device, seed=8)
    copy_blocks(ref, ref, s, d, backend="torch")
    copy_blocks(cache, cache, s, d, backend=backend)
    assert_bytes_equal(cache_bytes(cache), cache_bytes(ref), f"{backend} in-cache copy")
    for j, t in enumerate(cache.tensors()):  # block 2 now holds block 3, block 15 block 9
        assert_bytes_equal(t[2], t[3], f"tensor {j} block 2")
        assert_bytes_equal(t[15], t[9], f"tensor {j} block 15")


HINT = ("; copy_blocks moves block pairs between caches of one spec: to move a sequence's "
        "tokens between block tables of different specs, call copy_sequence")


@pytest.mark.parametrize("change,diff", [
    (dict(block_size=8), "block_size: src_cache has 4, dst_cache has 8"),
    (dict(layout="HND", dtype=torch.float16),
     "dtype: src_cache has torch.bfloat16, dst_cache has torch.float16; layout: src_cache has "
     "NHD, dst_cache has HND"),
    (dict(num_kv_heads=1), "num_kv_heads: src_cache has 2, dst_cache has 1"),
])
def test_copy_blocks_refuses_other_specs_naming_them_and_copy_sequence(change, diff):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.bfloat16, layout="NHD")
    src, dst = random_cache(spec, 4, seed=20), random_cache(spec.with_(**change), 4, seed=21)
    before = cache_bytes(dst)
    with pytest.raises(ValueError) as e:
        copy_blocks(src, dst, [0, 1], [2, 3], backend="torch")
    assert str(e.value) == "src_cache.spec and dst_cache.spec differ: " + diff + HINT
    assert_bytes_equal(cache_bytes(dst), before, "a refused copy_blocks wrote")
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_tokens'"):
        copy_blocks(src, src, [0], [1], num_tokens=3)  # a partial block is copy_sequence's


@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])  # vLLM's LBHNC / LBNHC: copy_blocks only
def test_copy_sequence_of_one_spec_equals_copy_blocks_of_its_pairs(layout):
    """Between caches of one spec a sequence's tokens are its blocks' bytes: copy_sequence of
    two block tables writes what copy_blocks of their pairs writes, on every re-blocking
    backend; with num_tokens inside the last block, that block's later slots stay."""
    spec, g = make_spec(layout, torch.bfloat16), GEOMETRY
    src = random_cache(spec, g.num_blocks, seed=22)
    s_list = _src_ids(g.num_blocks, g.num_ids, seed=23)
    d_list = _dst_ids(g.num_blocks + 3, g.num_ids, seed=24)
    want = random_cache(spec, g.num_blocks + 3, seed=25)
    copy_blocks(src, want, s_list, d_list, (1, 3), backend="torch")
    for backend in [b for b in backends_for("cpu") if b in ("torch", "numba", "triton")]:
        got = random_cache(spec, g.num_blocks + 3, seed=25)
        assert copy_sequence(src, got, s_list, d_list, (1, 3), backend=backend) is got
        assert_bytes_equal(cache_bytes(got), cache_bytes(want), f"{backend} {layout}")
    T = (g.num_ids - 1) * spec.block_size + 1   # whole blocks, then one token of the last
    want = random_cache(spec, g.num_blocks + 3, seed=25)
    copy_blocks(src, want, s_list[:-1], d_list[:-1], backend="torch")
    s_last, d_last = s_list[-1], d_list[-1]
    assert s_last >= 0 and d_last >= 0
    slot = 1 if layout == "HND" else 0          # the block's slot dimension
    for w, t in zip(want.tensors(), src.tensors()):
        w[d_last].select(slot, 0).copy_(t[s_last].select(slot, 0))
    got = random_cache(spec, g.num_blocks + 3, seed=25)
    copy_sequence(src, got, s_list, d_list, num_tokens=T, backend="torch")
    assert_bytes_equal(cache_bytes(got), cache_bytes(want), f"{layout} num_tokens={T}")


@param_case
@pytest.mark.parametrize("op", ["gather", "scatter", "copy"])
def test_empty_ids_touch_nothing(device, backend, op):
    spec = make_spec("NHD", torch.float32)
    cache = random_cache(spec, 4, device, seed=9)
    before = cache_bytes(cache)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    buf = staging_buffer(spec, 0, device=device)
    assert buf.shape == (spec.num_layers, 2, 0, *spec.block_shape)
    if op == "gather":
        assert gather_blocks(cache, empty, buf, backend=backend) is buf
    elif op == "scatter":
        scatter_blocks(buf, cache, empty, backend=backend)
    else:
        copy_blocks(random_cache(spec, 4, device, seed=10), cache, empty, empty[:0].int(),
                    backend=backend)
    assert_bytes_equal(cache_bytes(cache), before, f"{backend} {op} with no ids")


@param_case
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16], ids=str)
def test_block_bytes_not_a_multiple_of_8(device, backend, dtype):
    """Odd run lengths (9 or 18 bytes per block) take the kernels' narrow-word path."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=1, head_dim=3, block_size=3, dtype=dtype,
                       layout="HND")
    assert spec.block_bytes % 8 != 0
    cache = random_cache(spec, 6, device, seed=11)
    ids = _ids([5, -1, 0, 3], torch.int64, device)
    poison = random_bytes_(staging_buffer(spec, 4, (1, 3), device), seed=12)
    ref, out = poison.clone(), poison.clone()
    gather_blocks(cache, ids, ref, (1, 3), backend="torch")
    gather_blocks(cache, ids, out, (1, 3), backend=backend)
    assert_bytes_equal(out, ref, f"{backend} gather")
    a, b = random_cache(spec, 6, device, seed=13), random_cache(spec, 6, device, seed=13)
    scatter_blocks(out, a, ids, (1, 3), backend="torch")
    scatter_blocks(out, b, ids, (1, 3), backend=backend)
    assert_bytes_equal(cache_bytes(b), cache_bytes(a), f"{backend} scatter")
    copy_blocks(cache, a, ids, _ids([1, 2, -1, 4], torch.int32, device), backend="torch")
    copy_blocks(cache, b, ids, _ids([1, 2, -1, 4], torch.int32, device), backend=backend)
    assert_bytes_equal(cache_bytes(b), cache_bytes(a), f"{backend} copy")


def test_auto_backend_on_cpu_is_numba_and_matches(monkeypatch):
    """``backend='auto'`` (the default) on CPU runs the numba backend and gives the same bytes."""
    from kvflow.kernels.registry import get_backend
    monkeypatch.delenv("KVFLOW_BACKEND", raising=False)
    assert get_backend("auto", torch.device("cpu")).name == "numba"
    spec = make_spec("MLA", torch.bfloat16)
    cache = random_cache(spec, 8, seed=14)
    ids = torch.tensor([3, -1, 7])
    a = gather_blocks(cache, ids, random_bytes_(staging_buffer(spec, 3), 15))
    b = gather_blocks(cache, ids, random_bytes_(staging_buffer(spec, 3), 15), backend="torch")
    assert_bytes_equal(a, b, "auto gather")


def test_payload_bytes_counts_valid_blocks_layers_and_tensors():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64,
                       dtype=torch.bfloat16, layout="NHD")
    assert payload_bytes(spec, 64) == 512 * 2**20  # a 4K-token request: 512 MiB
    assert payload_bytes(spec, 64, (0, 16)) == 256 * 2**20
    assert payload_bytes(spec, 1, 3) == 2 * 64 * 8 * 128 * 2
    mla = spec.with_(layout="MLA", num_kv_heads=1, head_dim=576)
    assert payload_bytes(mla, 2) == 2 * 32 * 64 * 576 * 2


@pytest.fixture(autouse=True)
def _block_major_backends(request):
    """Block-major caches run on the backends that step ``block_stride_bytes``
    (``block_strides``); the others are refused (see test_block_major_refused_naming_the_backend)."""
    p = getattr(request.node, "callspec", None)
    name = p.params.get("backend") if p else None
    if p and p.params.get("layout") == "BM_NHD" and name is not None \
            and not getattr(registry._load(name), "block_strides", False):
        pytest.skip("backend without block_strides: refused with a ValueError")


def test_block_major_refused_naming_the_backend(monkeypatch):
    """A backend without ``block_strides`` (a plugin) is refused before it runs: the cache and
    the buffer stay as they were."""
    class Plain:
        name, devices, directions = "plain_bm", {"cpu"}, ("pull",)

        def unavailable_reason(self):
            return None

        def gather(self, *a, **k):
            raise AssertionError("ran")

    monkeypatch.setitem(registry._BACKENDS, "plain_bm", Plain())
    spec = make_spec("BM_NHD", torch.float16)
    cache = random_cache(spec, 4, seed=2)
    out = random_bytes_(staging_buffer(spec, 2), 3)
    before, out_before = cache_bytes(cache).clone(), out.clone()
    with pytest.raises(ValueError) as e:
        gather_blocks(cache, torch.tensor([1, 2]), out, backend="plain_bm")
    assert str(e.value) == ("backend 'plain_bm' does not move block-major caches "
                            "(layout='BM_NHD'); use backend='torch' or 'numba'")
    assert_bytes_equal(cache_bytes(cache), before, "cache")
    assert_bytes_equal(out, out_before, "buffer")


def test_check_block_strides_passes_strided_and_layer_major():
    """A backend without ``block_strides`` is refused a block-major cache, naming it; the CPU
    backends (torch, numba, native) all take one."""
    from types import SimpleNamespace

    from kvflow.kernels.validate import check_block_strides
    bm, nhd = make_spec("BM_NHD", torch.float16), make_spec("NHD", torch.float16)
    check_block_strides(SimpleNamespace(name="plain"), nhd, None)
    check_block_strides(SimpleNamespace(name="strided", block_strides=True), bm, nhd)
    with pytest.raises(ValueError, match=r"^backend 'plain' does not move block-major caches "
                                         r"\(layout='BM_NHD'\); use backend='torch' or 'numba'$"):
        check_block_strides(SimpleNamespace(name="plain"), nhd, bm)
    assert all(takes_block_major(b) for b in ("torch", "numba", "native", "triton"))
