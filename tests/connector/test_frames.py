"""kvflow.connector.transport.frames: layer frames of a staging buffer, and the one "check every
frame, then scatter" (exact bytes against the torch reference; a bad count or size refused with
its message before anything is written)."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.cache import staging_buffer
from kvflow.connector.transport.frames import (check_frames, layer_bytes, layer_frames,
                                               scatter_frames)
from kvflow.kernels import gather_blocks

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16,
                   layout="NHD")
SRC, DST = [7, 2, 9], [1, 5, 3]
MSGS = dict(req_id="r{1}", count_msg="{req_id}: {got} of {expected} ({header}) [{start}, {stop})",
            size_msg="{req_id}: layer {layer} has {nbytes}, expected {expected}")


def _filled(seed: int, n: int = 12) -> PagedKVCache:
    cache = PagedKVCache(SPEC, num_blocks=n)
    g = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randint(0, 256, (cache.buffer.numel(),), dtype=torch.uint8,
                                     generator=g))
    return cache


def _frames(p: PagedKVCache, ids: list[int]) -> list[memoryview]:
    staging = gather_blocks(p, ids, staging_buffer(SPEC, len(ids)), backend="torch")
    return [bytes(f) for f in layer_frames(staging)]  # as received: a copy of the bytes


def test_frames_round_trip_writes_exactly_the_blocks():
    p, d = _filled(1), _filled(2)
    want = [t.clone() for t in d.tensors()]
    for src, dst in zip(p.tensors(), want):  # the torch reference: D's blocks = P's
        dst.view(torch.uint8)[DST] = src.view(torch.uint8)[SRC]
    frames = _frames(p, SRC)
    assert [len(f) for f in frames] == [layer_bytes(SPEC, 3)] * 3 == [2 * 3 * SPEC.block_bytes] * 3
    total = scatter_frames(frames, d, torch.tensor(DST), range(3), error=ValueError,
                           num_frames=3, backend="torch", **MSGS)
    assert total == 3 * layer_bytes(SPEC, 3)
    for a, b in zip(d.tensors(), want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_layer_range_and_no_block_to_write():
    p, d = _filled(3), _filled(4)
    frames = _frames(p, SRC)[1:]  # layers 1 and 2
    before = [t.clone() for t in d.tensors()]
    assert scatter_frames(frames, d, torch.tensor([-1, -1, -1]), range(1, 3), error=ValueError,
                          num_blocks=3, backend="torch", **MSGS) == 0  # all skipped: nothing
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(d.tensors(), before))
    scatter_frames(frames, d, torch.tensor(DST), range(1, 3), error=ValueError, backend="torch",
                   **MSGS)
    for t, (a, b) in enumerate(zip(d.tensors(), p.tensors())):
        same = torch.equal(a.view(torch.uint8)[DST], b.view(torch.uint8)[SRC])
        assert same == (t >= 2), f"tensor {t}"  # tensors 2..5 are layers 1 and 2 (K, V)


def test_bad_frames_are_refused_with_the_callers_message_before_any_write():
    p, d = _filled(5), _filled(6)
    frames = _frames(p, SRC)
    before = [t.clone() for t in d.tensors()]
    ids = torch.tensor(DST)
    with pytest.raises(ValueError) as err:
        scatter_frames(frames[:2], d, ids, range(3), error=ValueError, backend="torch", **MSGS)
    assert str(err.value) == "r{1}: 2 of 3 (None) [0, 3)"
    with pytest.raises(ValueError) as err:
        scatter_frames(frames, d, ids, range(3), error=ValueError, num_frames=4, **MSGS)
    assert str(err.value) == "r{1}: 3 of 3 (4) [0, 3)"
    bad = frames[:2] + [frames[2][:-1]]
    with pytest.raises(KeyError) as err:
        scatter_frames(bad, d, ids, range(3), error=KeyError, backend="torch", **MSGS)
    assert err.value.args == (f"r{{1}}: layer 2 has {layer_bytes(SPEC, 3) - 1}, expected "
                              f"{layer_bytes(SPEC, 3)}",)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(d.tensors(), before))  # layers 0, 1 unwritten
    bufs = check_frames(frames, range(3), layer_bytes(SPEC, 3), error=ValueError, **MSGS)
    assert [bytes(b) for b in bufs] == frames
