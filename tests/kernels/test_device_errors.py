"""Bad block ids checked by the kernel on the device (kvflow.kernels.errors), and no host sync.

On the CPU machine the triton kernel runs in Triton's interpreter and is called through its
backend with ``check=True`` (what the ops do for ids on a GPU); on a GPU host the public ops
are called with GPU ids and default arguments. Every case checks the bytes: the bad pair is
skipped, the rest is copied exactly, and nothing around the cache changes.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.kernels import capture, check_errors, copy_blocks, gather_blocks, scatter_blocks
from kvflow.kernels.registry import get_backend

from tests.conftest import assert_bytes_equal, random_bytes_

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
NB = 12
GUARD = 4096  # bytes of random data before and after the cache's memory
CUDA = torch.cuda.is_available()


def guarded_cache(device: str, seed: int) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache laid over the middle of a random buffer: ``(cache, whole buffer)``."""
    size = SPEC.num_tensors * NB * SPEC.block_bytes
    whole = random_bytes_(torch.empty(size + 2 * GUARD, dtype=torch.uint8, device=device), seed)
    return PagedKVCache(SPEC, NB, buffer=whole[GUARD:GUARD + size]), whole


def message(op: str, device: str, base: str, after: str) -> str:
    return f"an earlier {op} call on {device} (ids checked by the kernel): {base}; {after}"


def range_error(op, device, name, i, value):
    return message(op, device, f"{name}[{i}]={value} is out of range for a cache of {NB} blocks "
                   f"(valid: 0..{NB - 1}, or -1 for padding)",
                   "that pair was skipped; nothing outside the cache was written")


def repeat_error(op, device, name, block):
    return message(op, device, f"{name} repeats destination block {block}; destination ids "
                   f"must be distinct (only -1 padding may repeat)", "its content is undefined")


def raises_exactly(text: str, fn) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(text) + "$"):
        fn()


@pytest.fixture(autouse=True)
def clean_records():
    check_errors()  # nothing left over from another test
    yield
    check_errors()


def _expected_gather(src: PagedKVCache, ids: list[int], out: torch.Tensor) -> torch.Tensor:
    """``out`` after a gather of ``ids`` where ids outside the cache leave their slot alone."""
    exp = out.clone()
    for i, b in enumerate(ids):
        if 0 <= b < NB:
            for layer in range(SPEC.num_layers):
                for t, tensor in enumerate(src.layer(layer)):
                    exp[layer, t, i] = tensor[b]
    return exp


# ---- the kernel's record, on the CPU through Triton's interpreter --------------------------
@pytest.fixture
def triton_cpu():
    try:
        return get_backend("triton", torch.device("cpu"))
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"triton cannot run on CPU tensors here: {exc}")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gather_bad_source_id_is_recorded_and_its_slot_untouched(triton_cpu, dtype):
    src, _ = guarded_cache("cpu", 1)
    ids = [3, NB, 0, -1]
    out = random_bytes_(staging_buffer(SPEC, len(ids)), 2)
    expected = _expected_gather(src, ids, out)
    triton_cpu.gather(src, torch.tensor(ids, dtype=dtype), out, 0, SPEC.num_layers, check=True)
    assert_bytes_equal(out, expected, "gather with one bad id")
    raises_exactly(range_error("gather_blocks", "cpu", "block_ids", 1, NB), check_errors)
    check_errors()  # reported once, then clean


def test_scatter_out_of_range_writes_nothing_outside_the_cache(triton_cpu):
    dst, whole = guarded_cache("cpu", 3)
    ids = torch.tensor([5, NB, 2, NB + 1000])
    src = random_bytes_(staging_buffer(SPEC, 4), 4)
    ref, _ = guarded_cache("cpu", 3)
    scatter_blocks(src[:, :, [0, 2]].contiguous(), ref, torch.tensor([5, 2]), backend="torch")
    before = whole.clone()
    triton_cpu.scatter(src, dst, ids, 0, SPEC.num_layers, check=True)
    assert torch.equal(whole[:GUARD], before[:GUARD]) and torch.equal(whole[-GUARD:], before[-GUARD:])
    for a, b in zip(dst.tensors(), ref.tensors()):
        assert_bytes_equal(a, b, "scatter with bad ids")
    raises_exactly(range_error("scatter_blocks", "cpu", "block_ids", 1, NB), check_errors)


def test_copy_bad_destination_id_and_next_call_reports_it_first(triton_cpu):
    src, _ = guarded_cache("cpu", 5)
    dst, whole = guarded_cache("cpu", 6)
    before = whole.clone()
    triton_cpu.copy(src, dst, torch.tensor([1, 2]), torch.tensor([4, -7]), 0, SPEC.num_layers,
                    check=True)
    for layer in range(SPEC.num_layers):
        for a, b in zip(dst.layer(layer), src.layer(layer)):
            assert_bytes_equal(a[4], b[1], "the good pair")
    rest = [i for i in range(NB) if i != 4]
    for a, b in zip(dst.tensors(), PagedKVCache(SPEC, NB, buffer=before[GUARD:-GUARD]).tensors()):
        assert_bytes_equal(a[rest], b[rest], "blocks other than 4")
    # the next public call with validate=True raises the finding before it runs anything
    out = random_bytes_(staging_buffer(SPEC, 1), 7)
    kept = out.clone()
    raises_exactly(range_error("copy_blocks", "cpu", "dst_ids", 1, -7),
                   lambda: gather_blocks(src, torch.tensor([0]), out))
    assert_bytes_equal(out, kept, "the refused call")
    gather_blocks(src, torch.tensor([0]), out)  # the record was cleared by raising it
    assert_bytes_equal(out[:, :, 0], torch.stack([torch.stack(src.layer(l))[:, 0]
                                                   for l in range(SPEC.num_layers)]), "gather")


@pytest.mark.parametrize("op", ["scatter", "copy"])
def test_repeated_destination_is_recorded(triton_cpu, op):
    dst, _ = guarded_cache("cpu", 8)
    ids = torch.tensor([3, 9, -1, -1, 9, 3])
    if op == "scatter":
        triton_cpu.scatter(random_bytes_(staging_buffer(SPEC, 6), 9), dst, ids, 0, 1, check=True)
        expected = repeat_error("scatter_blocks", "cpu", "block_ids", 9)
    else:
        src, _ = guarded_cache("cpu", 10)
        triton_cpu.copy(src, dst, torch.arange(6), ids, 0, 1, check=True)
        expected = repeat_error("copy_blocks", "cpu", "dst_ids", 9)
    raises_exactly(expected, check_errors)


def test_copy_within_one_cache_skips_and_reports_a_shared_block(triton_cpu):
    cache, whole = guarded_cache("cpu", 18)
    before = PagedKVCache(SPEC, NB, buffer=whole[GUARD:-GUARD].clone())
    # pair 1 reads block 5, which pair 2 writes: reported (block 9 undefined); 0 and 2 copy
    triton_cpu.copy(cache, cache, torch.tensor([1, 5, 7]), torch.tensor([2, 9, 5]), 0,
                    SPEC.num_layers, check=True, same=True)
    for layer in range(SPEC.num_layers):
        for now, old in zip(cache.layer(layer), before.layer(layer)):
            assert_bytes_equal(now[2], old[1], "pair 0")
            assert_bytes_equal(now[5], old[7], "pair 2")
    raises_exactly(message("copy_blocks", "cpu", "src_ids and dst_ids share block 5 of one cache",
                           "the destination of pair 1 is undefined"), check_errors)


def test_first_finding_wins_and_unchecked_calls_record_nothing(triton_cpu):
    src, _ = guarded_cache("cpu", 11)
    out = staging_buffer(SPEC, 3)
    triton_cpu.gather(src, torch.tensor([0, 99, 98]), out, 0, 1, check=False)
    check_errors()  # validate=False: skipped, not recorded
    triton_cpu.gather(src, torch.tensor([0, 99, -3]), out, 0, 1, check=True)
    triton_cpu.gather(src, torch.tensor([-5]), out, 0, 1, check=True)
    raises_exactly(range_error("gather_blocks", "cpu", "block_ids", 1, 99), check_errors)


def test_check_errors_names_a_bad_device_and_is_quiet_for_an_unused_one():
    with pytest.raises(ValueError, match=r"^device must be a torch\.device or a device string "
                                         r"such as 'cuda:0', got 'gpu0'$"):
        check_errors("gpu0")
    check_errors("cpu")
    check_errors("cuda:3")  # no kernel ever ran there: nothing to report, no CUDA call


def test_capture_needs_cuda_and_a_positive_warmup():
    if CUDA:
        with pytest.raises(ValueError, match=r"^warmup must be an int >= 1, got 0$"):
            capture(lambda: None, warmup=0)
    else:
        with pytest.raises(RuntimeError, match=r"^capture needs a CUDA device \(CUDA graphs\)$"):
            capture(lambda: None)


# ---- public ops with ids on a GPU ----------------------------------------------------------
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@needs_cuda
def test_default_calls_with_gpu_ids_never_sync(monkeypatch):
    src, _ = guarded_cache("cuda", 12)
    dst, _ = guarded_cache("cuda", 13)
    ids = torch.tensor([4, 0, 7], device="cuda")
    low, high = torch.tensor([0, 1, 2], device="cuda"), torch.tensor([6, 7, 8], device="cuda")
    out = staging_buffer(SPEC, 3, device="cuda")
    for _ in range(2):  # the first call builds tables, plans and compiles
        gather_blocks(src, ids, out)
        scatter_blocks(out, dst, ids + 1)
        copy_blocks(src, dst, ids, ids + 4)
        copy_blocks(dst, dst, low, high)  # within one cache
    torch.cuda.synchronize()

    def forbidden(*a, **k):
        raise AssertionError("a default call synchronised with the GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.Tensor, "cpu", forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    torch.cuda.set_sync_debug_mode("error")  # torch raises on any synchronising op
    try:
        for _ in range(3):
            gather_blocks(src, ids, out)
            scatter_blocks(out, dst, ids + 1)
            copy_blocks(src, dst, ids, ids + 4)
            copy_blocks(dst, dst, low, high)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    ref = staging_buffer(SPEC, 3, device="cuda")
    gather_blocks(src, ids, ref, backend="torch")
    assert_bytes_equal(out, ref, "gather")


@needs_cuda
def test_bad_gpu_id_is_reported_and_nothing_outside_the_cache_is_written():
    dst, whole = guarded_cache("cuda", 14)
    before = whole.clone()
    src = random_bytes_(staging_buffer(SPEC, 3, device="cuda"), 15)
    scatter_blocks(src, dst, torch.tensor([1, NB + 5, 2], device="cuda"))  # returns at once
    dev = str(dst.device)
    raises_exactly(range_error("scatter_blocks", dev, "block_ids", 1, NB + 5),
                   lambda: check_errors("cuda"))
    assert torch.equal(whole[:GUARD], before[:GUARD]) and torch.equal(whole[-GUARD:], before[-GUARD:])
    for layer in range(SPEC.num_layers):
        for t, tensor in enumerate(dst.layer(layer)):
            assert_bytes_equal(tensor[1], src[layer, t, 0], "slot 0")
            assert_bytes_equal(tensor[2], src[layer, t, 2], "slot 2")
    # reported by the next call once the kernel has run (no explicit check_errors)
    other, _ = guarded_cache("cuda", 17)
    copy_blocks(other, dst, torch.tensor([0], device="cuda"), torch.tensor([NB], device="cuda"))
    torch.cuda.synchronize()
    out = staging_buffer(SPEC, 1, device="cuda")
    raises_exactly(range_error("copy_blocks", dev, "dst_ids", 0, NB),
                   lambda: gather_blocks(dst, torch.tensor([0], device="cuda"), out))


@needs_cuda
def test_captured_gather_replays_with_new_ids_and_reports_bad_ones():
    src, _ = guarded_cache("cuda", 16)
    ids = torch.full((4,), -1, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(staging_buffer(SPEC, 4, device="cuda"))
    graph = capture(lambda: gather_blocks(src, ids, out))
    for table in ([3, 1, 4, 1], [0, -1, 11, 5]):
        ids.copy_(torch.tensor(table, dtype=torch.int32))
        graph.replay()
        ref = torch.zeros_like(out)
        gather_blocks(src, torch.tensor(table, device="cuda"), ref, backend="torch")
        keep = [i for i, b in enumerate(table) if b >= 0]
        assert_bytes_equal(out[:, :, keep], ref[:, :, keep], f"replay of {table}")
    ids.copy_(torch.tensor([2, NB + 1, 0, 0], dtype=torch.int32))
    graph.replay()
    raises_exactly(range_error("gather_blocks", str(src.device), "block_ids", 1, NB + 1),
                   lambda: check_errors("cuda"))


def test_read_only_numpy_output_is_refused_and_not_written():
    np = pytest.importorskip("numpy")
    cache, _ = guarded_cache("cpu", 19)
    ro = np.zeros(tuple(staging_buffer(SPEC, 2).shape), np.float16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out is read-only \(a numpy array with flags\.writeable "
                                         r"False\); kvflow writes into it$"):
        gather_blocks(cache, torch.tensor([1, 2]), ro)
    assert not ro.any()


def test_cache_too_large_and_unstorable_dtypes_name_the_argument():
    with pytest.raises(ValueError, match=r"^num_blocks=4611686018427387904 makes a cache of "):
        PagedKVCache(SPEC, 2 ** 62)
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=rf"^dtype={dtype!r} is not a dtype kvflow can store"):
            KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=dtype)
