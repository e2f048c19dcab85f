"""Triton-specific behaviour of the ``triton`` backend (the op x layout x dtype byte-equality
matrix over every backend is tests/kernels/test_ops.py).

Checked here: every ``max_ctas`` (1 included) and chunk split gives the reference's bytes; the
pointer table is built once per cache and device; the hot path builds no tensor from a Python
list and never synchronises (``.item()`` / ``.tolist()`` raise inside the call); the constexprs
do not change with the request size; every word width (16/8/4/2/1 bytes) and a misaligned
staging buffer; ``direction="push"``; on sm_90 the body compiles to 128-bit loads and stores.
On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest); on a GPU host the same
tests run on ``cuda`` (and the peer test on two GPUs).
"""

from __future__ import annotations

import re

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
from kvflow.kernels.registry import get_backend
from kvflow.kernels.tables import alignment

from tests.conftest import assert_bytes_equal, backends_for, cache_bytes, random_bytes_, random_cache

DEVICES = [d for d in ("cpu", "cuda") if "triton" in backends_for(d)]
if not DEVICES:
    pytest.skip("the triton backend is unavailable here", allow_module_level=True)

from kvflow.kernels.triton import copy_runs as cr  # noqa: E402

pytestmark = pytest.mark.parametrize("device", DEVICES)
SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16,
                   layout="NHD")  # block_bytes 128
IDS = [5, -1, 0, 9, 3, 11, -1]      # 11 is outside a 10-block cache: skipped like -1
DST = [7, 2, -1, 0, 9, 1, 4]


def _run_all(device, spec=SPEC, layers=(1, 3), backend="triton", max_ctas=None, out=None,
             direction="pull"):
    """gather, scatter, copy_blocks on fixed random data; returns every resulting byte."""
    cache = random_cache(spec, 10, device, seed=1)
    ids = torch.tensor(IDS, device=device)
    if out is None:
        out = staging_buffer(spec, len(IDS), layers, device)
    random_bytes_(out, 2)
    gather_blocks(cache, ids, out, layers, backend=backend, max_ctas=max_ctas, validate=False)
    dst = random_cache(spec, 10, device, seed=3)
    scatter_blocks(out, dst, torch.tensor(DST, device=device), layers, backend=backend,
                   max_ctas=max_ctas)
    copy_blocks(cache, dst, torch.tensor([1, 2, -1, 8], dtype=torch.int32, device=device),
                torch.tensor([3, -1, 5, 6], dtype=torch.int32, device=device), layers,
                backend=backend, max_ctas=max_ctas, direction=direction)
    return out.clone(), cache_bytes(dst)


@pytest.mark.parametrize("max_ctas", [None, 1, 2, 5, 1000])
def test_every_max_ctas_gives_reference_bytes(device, max_ctas):
    ref_out, ref_dst = _run_all(device, backend="torch")
    out, dst = _run_all(device, max_ctas=max_ctas)
    assert_bytes_equal(out, ref_out, f"gather max_ctas={max_ctas}")
    assert_bytes_equal(dst, ref_dst, f"scatter+copy max_ctas={max_ctas}")


@pytest.mark.parametrize("chunk,block", [(64, 32), (96, 32), (32, 32)])
def test_runs_split_into_chunks(device, monkeypatch, chunk, block):
    # 128-byte runs: 64-byte chunks of 2 steps, 96-byte chunks (uneven tail), 1-step chunks
    monkeypatch.setattr(cr, "CONFIG", cr.LaunchConfig(block_bytes=block, chunk_bytes=chunk,
                                                      capped_block_bytes=block))
    ref_out, ref_dst = _run_all(device, backend="torch")
    out, dst = _run_all(device, max_ctas=3)
    assert_bytes_equal(out, ref_out, f"gather chunk={chunk}")
    assert_bytes_equal(dst, ref_dst, f"scatter+copy chunk={chunk}")


@pytest.mark.parametrize("dtype,heads,dim,bs,word", [
    (torch.float8_e4m3fn, 3, 11, 7, 1),   # 231 bytes
    (torch.bfloat16, 3, 9, 5, 2),         # 270 bytes
    (torch.float32, 3, 7, 5, 4),          # 420 bytes
    (torch.float16, 1, 4, 3, 8),          # 24 bytes
    (torch.float32, 2, 33, 16, 16),       # 4224 bytes, several loop steps per run
])
def test_word_widths_and_odd_block_bytes(device, dtype, heads, dim, bs, word):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=dim, block_size=bs,
                       dtype=dtype, layout="HND")
    assert alignment(spec.block_bytes) == word
    ref_out, ref_dst = _run_all(device, spec, backend="torch")
    out, dst = _run_all(device, spec, layers=(1, 3))
    assert_bytes_equal(out, ref_out, f"gather {spec.block_bytes} B")
    assert_bytes_equal(dst, ref_dst, f"scatter+copy {spec.block_bytes} B")


def test_misaligned_staging_buffer(device):
    shape = staging_buffer(SPEC, len(IDS), (0, 2)).shape
    raw = torch.empty(torch.Size(shape).numel() * 2 + 16, dtype=torch.uint8, device=device)
    base = (-raw.data_ptr()) % 16 + 2           # 2 bytes past a 16-byte boundary
    out = raw[base:base + torch.Size(shape).numel() * 2].view(torch.bfloat16).view(shape)
    assert out.data_ptr() % 16 == 2
    ref_out, ref_dst = _run_all(device, layers=(0, 2), backend="torch")
    got_out, got_dst = _run_all(device, layers=(0, 2), out=out)
    assert_bytes_equal(got_out, ref_out, "gather into a 2-byte-aligned buffer")
    assert_bytes_equal(got_dst, ref_dst, "scatter from a 2-byte-aligned buffer")


def test_push_equals_pull(device):
    ref_out, ref_dst = _run_all(device, backend="torch")
    out, dst = _run_all(device, direction="push")
    assert_bytes_equal(dst, ref_dst, "copy_blocks direction='push'")


def test_push_refused_by_a_backend_without_it(device):
    cache = PagedKVCache(SPEC, 4, device)
    with pytest.raises(ValueError, match=r"^direction='push' is not supported by backend 'torch'"):
        copy_blocks(cache, PagedKVCache(SPEC, 4, device), [0], [1], backend="torch",
                    direction="push")
    with pytest.raises(ValueError, match=r"^direction must be 'pull' or 'push', got 'up'$"):
        copy_blocks(cache, PagedKVCache(SPEC, 4, device), [0], [1], direction="up")


def test_pointer_table_built_once_no_sync_no_list_tensors(device, monkeypatch):
    cache = random_cache(SPEC, 10, device, seed=1)
    other = random_cache(SPEC, 10, device, seed=2)
    ids = torch.tensor(IDS, device=device)
    out = staging_buffer(SPEC, len(IDS), None, device)
    gather_blocks(cache, ids, out, backend="triton", validate=False)      # builds the tables
    copy_blocks(cache, other, ids, torch.tensor(DST, device=device), backend="triton",
                validate=False)
    table = cache.backend_state["device_tables"][cache.device][0]
    assert table.data_ptr() == cache.ptr_table().data_ptr()
    assert table.tolist() == [t.data_ptr() for t in cache.tensors()]

    def forbidden(*a, **k):
        raise AssertionError("host sync or per-call table build in the hot path")
    monkeypatch.setattr(PagedKVCache, "ptr_table", forbidden)
    monkeypatch.setattr(torch, "tensor", forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    part = staging_buffer(SPEC, len(IDS), (1, 3), device)
    for layers, buf in ((None, out), ((1, 3), part)):
        gather_blocks(cache, ids, buf, layers, backend="triton", validate=False)
        scatter_blocks(buf, other, ids, layers, backend="triton", validate=False)
        copy_blocks(cache, other, ids, ids, layers, backend="triton", validate=False)
    monkeypatch.undo()
    assert cache.backend_state["device_tables"][cache.device][0] is table


def test_constexprs_fixed_per_cache_grid_capped(device, monkeypatch):
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))
    monkeypatch.setattr(cr, "kernel", lambda: Recorder())
    cache = PagedKVCache(SPEC, 10, device)
    for n, layers, max_ctas in [(3, None, None), (7, (1, 2), None), (64, (0, 2), 1), (5, 1, 2)]:
        ids = torch.zeros(n, dtype=torch.int64, device=device)
        gather_blocks(cache, ids, staging_buffer(SPEC, n, layers, device), layers,
                      backend="triton", max_ctas=max_ctas, validate=False)
    constexprs = [tuple(sorted((k, str(v)) for k, v in kw.items())) for _, _, kw in calls]
    # foreground calls share one compiled variant, capped (background) calls another
    assert constexprs[0] == constexprs[1] and constexprs[2] == constexprs[3], constexprs
    assert dict(constexprs[2])["num_warps"] == str(cr.CONFIG.capped_num_warps)
    grids = [g for g, _, _ in calls]
    assert grids[2] == (1,) and grids[3] == (2,)
    assert [a[6:10] for _, a, _ in calls] == [(3, 10, 3, 18), (7, 10, 7, 14), (64, 10, 64, 256),
                                               (5, 10, 5, 10)]  # n, src_n, dst_n, items


_PTX = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvflow.kernels.triton import copy_runs as cr
src_cache, dst_cache, check, digest, store = json.loads(sys.argv[1])
sig = {k: "i64" for k in ("src_table", "dst_table", "src_stage", "dst_stage", "src_ids",
                          "dst_ids")}
sig.update({"n": "i32", "src_n": "i32", "dst_n": "i32", "total": "i32", "errors": "i64",
            "ready": "i64", "stamps": "i64", "call": "i32", "op": "i32", "digest": "i64",
            "tensor0": "i32"})
const = dict(WORD=tl.int64, ALIGN=16, RUN=16384, CHUNK=8192, BLOCK=2048, EVEN=True,
             SRC_CACHE=src_cache, DST_CACHE=dst_cache, STREAM=False, SRC_I64=False,
             DST_I64=True, CHECK=check, DUP=check, SHARED=check, STAMP_ONLY=False,
             DIGEST=digest, WPW=2, STORE=store, SRC_STRIDE=16384, DST_STRIDE=16384)
sig.update({k: "constexpr" for k in const})
src = ASTSource(fn=triton.jit(cr._copy_runs), signature=sig, constexprs=const, attrs={})
try:
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
except RuntimeError as exc:  # no bundled ptxas/LLVM for sm_90 in this triton build
    print(json.dumps({"skip": str(exc)}))
else:
    print(json.dumps({"ptx": ptx.asm["ptx"]}))
"""


def _ptx(src_cache: bool, dst_cache: bool, check: bool, digest: bool = False,
         store: bool = True) -> str:
    """The sm_90 PTX of one variant, compiled in a fresh process: a session that ran Triton's
    interpreter (``TRITON_INTERPRET=1``) leaves triton.language in a state that the compiler
    cannot use."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="0")
    run = subprocess.run([sys.executable, "-c", _PTX,
                          json.dumps([src_cache, dst_cache, check, digest, store])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot compile for sm_90 here: {out['skip']}")
    return out["ptx"]


@pytest.mark.parametrize("src_cache,dst_cache", [(True, False), (False, True), (True, True)],
                         ids=["gather", "scatter", "copy"])
def test_sm90_body_uses_128_bit_accesses(device, src_cache, dst_cache, monkeypatch):
    if device != "cpu":
        pytest.skip("compile-only check; once is enough")
    pytest.importorskip("triton.backends.nvidia.compiler")
    ptx = _ptx(src_cache, dst_cache, check=False)
    checked = _ptx(src_cache, dst_cache, check=True)
    digested = _ptx(src_cache, dst_cache, check=False, digest=True)
    moves = set(re.findall(r"\b(ld\.global\S*|st\.global\S*)\s", ptx))
    assert "ld.global.v2.b64" in moves and "st.global.v2.b64" in moves, moves
    assert not {m for m in moves if m.startswith("st.")} - {"st.global.v2.b64"}, moves
    # the id checks add scalar atomics and error-record stores, never a narrower copy
    moves = set(re.findall(r"\b(ld\.global\S*|st\.global\S*)\s", checked))
    assert "ld.global.v2.b64" in moves and "st.global.v2.b64" in moves, moves
    assert "atom.global" in checked, "no atomic: the id check is missing"
    # the digest (kvflow.kernels.digest) reads the words it moves: same 128-bit accesses, and
    # one atomic add per work item
    moves = set(re.findall(r"\b(ld\.global\S*|st\.global\S*)\s", digested))
    assert "ld.global.v2.b64" in moves and "st.global.v2.b64" in moves, moves
    assert not {m for m in moves if m.startswith("st.")} - {"st.global.v2.b64"}, moves
    assert re.search(r"\b(atom|red)\.global\S*\.add\.[us]32", digested), "no digest atomic"
    # relaxed: no fence, so a program does not wait for its own stores (the H200 cost of
    # --kv-verify, docs/reliability.md)
    assert not re.search(r"\bmembar\.|\bfence\.|\.acq_rel\.|\.release\.", digested), \
        "the digest atomic orders memory"
    assert not re.search(r"\b(atom|red)\.global", ptx), "an atomic without a digest"
    if src_cache and not dst_cache:  # the digest-only launch (digest_blocks): reads, no stores
        only = _ptx(True, False, check=False, digest=True, store=False)
        moves = set(re.findall(r"\b(ld\.global\S*|st\.global\S*)\s", only))
        assert "ld.global.v2.b64" in moves and not {m for m in moves if m.startswith("st.")}, \
            moves
        assert re.search(r"\b(atom|red)\.global\S*\.add\.[us]32", only), "no digest atomic"


def test_copy_between_two_gpus_pull_and_push(device):
    if device != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("cuda:0 and cuda:1 have no peer access")
    src = random_cache(SPEC, 10, "cuda:0", seed=1)
    s, d = torch.tensor([1, 2, -1, 8]), torch.tensor([3, -1, 5, 6])
    ref = random_cache(SPEC, 10, "cuda:1", seed=3)
    copy_blocks(src, ref, s, d, backend="torch")
    for direction in ("pull", "push"):
        dst = random_cache(SPEC, 10, "cuda:1", seed=3)
        copy_blocks(src, dst, s, d, backend="triton", direction=direction)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        assert_bytes_equal(cache_bytes(dst), cache_bytes(ref), f"peer copy {direction}")


def test_backend_devices_follow_the_interpreter_flag(device, monkeypatch):
    be = get_backend("triton", torch.device(device))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert be.devices == {"cpu"}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert be.devices == {"cuda"}
