"""fp8 scales through shared memory (issue #19), two caches in one process over real segments:
a shared cache keeps its scales after its blocks, so ipc-push into an fp8 D leaves on D the
per-block scales P's copy computed (block_head) or quantizes with the scale D's owner set
(tensor), and ipc-pull from an fp8 P dequantizes with P's scales; each exact against the torch
reference. A segment too small for blocks + scales is refused."""

from __future__ import annotations

import os
import re

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector import Peer, make_receiver
from kvflow.connector.base import PrefillJob, TransferError
from kvflow.connector.ipc_pull import IpcPullSender
from kvflow.connector.ipc_push import PushReceiver, PushSender
from kvflow.connector.transport.shm import map_peer_cache
from kvflow.kernels import copy_sequence
from kvflow.connector.messages import decode
from kvflow.segments import create, unlink

from tests.reblock_cases import finite_, row
from tests.reliability_harness import FakeLink

FP32 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                   dtype=torch.float32, layout="NHD")
FP8_BH = FP32.with_(dtype=torch.float8_e4m3fn, scales="block_head")
SRC, DST, T = [7, 2, 9, 0], [5, 1], 13  # 13 tokens: P's 4 blocks of 4, D's 2 blocks of 8
NB = 12


def prefill_(cache: PagedKVCache, seed: int) -> PagedKVCache:
    """Finite values in every block (:func:`finite_`); fp8: scales in [0.25, 1.25), none 1.0."""
    for i, t in enumerate(cache.tensors()):
        finite_(t, seed * 100 + i)
    if cache.scales is not None:
        g = torch.Generator().manual_seed(seed)
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) + 0.25)
    return cache


def same_bytes(a: PagedKVCache, b: PagedKVCache) -> None:
    for i, (x, y) in enumerate(zip(a.tensors(), b.tensors())):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"tensor {i}"
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None:  # bit for bit
        assert torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)), "scales"


def push(d_spec: KVCacheSpec, before=None) -> tuple[PushReceiver, PagedKVCache, PagedKVCache]:
    """P (float32, numba) pushes the 13-token prompt into D's exported fp8 cache; ``before(d)``
    runs on D's own cache after pairing, before P writes. Returns (D's receiver, P's cache,
    the torch reference of D's cache after the push)."""
    rx = PushReceiver(d_spec, backend="numba")
    d = rx.make_cache(NB)
    prefill_(d, 3)  # D's other slots and blocks (and their scales) must keep their values
    tx = PushSender(FP32, backend="numba", instance_id="p0")
    p = prefill_(tx.make_cache(NB), 1)
    link = FakeLink()
    try:
        tx.attach(Peer("d0", d_spec, NB, **rx.export()), link=link)
        if before:
            before(d)
        want = PagedKVCache(d_spec, NB)
        for w, x in zip(want.tensors(), d.tensors()):
            w.copy_(x)
        want.scales.copy_(d.scales)
        copy_sequence(p, want, torch.tensor(SRC), torch.tensor(DST), num_tokens=T, backend="torch")
        assert tx.reblocks("d0")
        tx.send_prefilled(PrefillJob("r1", [0] * T, SRC, "d0", DST), first_token=1)
        (frame,) = link.frames.pop()
        stats = rx.receive(decode(frame), [], d, DST)
        assert (stats.blocks, stats.payload_bytes) == (2, 2 * d_spec.bytes_per_block)
        return rx, p, want
    finally:
        tx.close()


def test_push_into_fp8_block_head_d_leaves_p_computed_scales_on_d():
    rx, _, want = push(FP8_BH.with_(block_size=8, layout="HND"))
    try:
        d = rx.cache
        assert not torch.equal(want.scales[:, DST], d.scales.new_ones(4, 2, 2))  # P computed them
        same_bytes(d, want)  # D's own cache object: blocks and scales
    finally:
        rx.close()


def test_push_into_fp8_tensor_d_quantizes_with_d_owners_scale():
    set_by_owner = torch.tensor([0.5, 0.25, 2.0, 0.125])
    rx, p, want = push(FP8_BH.with_(block_size=8, scales="tensor"),
                       before=lambda d: d.scales.copy_(set_by_owner))
    try:
        d = rx.cache
        assert torch.equal(d.scales, set_by_owner)
        same_bytes(d, want)
        ones = PagedKVCache(d.spec, NB)  # what P would have written believing the scales 1.0
        copy_sequence(p, ones, torch.tensor(SRC), torch.tensor(DST), num_tokens=T, backend="torch")
        assert not torch.equal(ones.tensors()[0][DST].view(torch.uint8),
                               d.tensors()[0][DST].view(torch.uint8))
    finally:
        rx.close()


def test_pull_from_fp8_block_head_p_dequantizes_with_p_scales():
    d_spec = FP32.with_(block_size=8, layout="HND")
    tx = IpcPullSender(FP8_BH, instance_id="p0")
    p = prefill_(tx.make_cache(NB), 5)  # P's own cache: the segment's owner writes the scales
    try:
        rx = make_receiver("ipc-pull", d_spec, backend="numba")
        rx.attach(Peer("p0", FP8_BH, NB, shm_name=tx.export_name))
        mapped = rx.peers["p0"]
        assert mapped.scales.data_ptr() != p.scales.data_ptr()  # another mapping, same bytes
        assert torch.equal(mapped.scales, p.scales)
        d = prefill_(PagedKVCache(d_spec, NB), 6)
        want = PagedKVCache(d_spec, NB)
        for w, x in zip(want.tensors(), d.tensors()):
            w.copy_(x)
        link = FakeLink()
        tx.send(link, "r1", p, SRC, first_token=1, num_prompt_tokens=T)
        (frame,) = link.frames.pop()
        rx.receive(decode(frame), [], d, DST, "p0")
        copy_sequence(p, want, torch.tensor(SRC), torch.tensor(DST), num_tokens=T, backend="torch")
        same_bytes(d, want)
        for j, (src, dst) in enumerate(zip(p.tensors(), d.tensors())):  # value = fp8 * P's scale
            for t in range(T):
                sb, db = SRC[t // 4], DST[t // 8]
                for h in range(2):
                    expect = row(src, "NHD", sb, t % 4, h).float() * p.scales[j, sb, h]
                    assert torch.equal(row(dst, "HND", db, t % 8, h), expect), (j, t, h)
    finally:
        tx.close()


def test_map_refuses_a_segment_without_room_for_the_scales():
    # 12 blocks x 256 bytes = 3072 bytes of blocks; block_head scales [4, 12, 2] float32 = 384
    name, fd = create("prefill", 3072)
    os.close(fd)
    try:
        with pytest.raises(TransferError, match="^" + re.escape(
                f"segment {name!r} holds 3072 bytes; the peer cache of 12 blocks needs 3456 "
                f"(3072 bytes of blocks, then 384 bytes of float32 scales at byte 3072)") + "$"):
            map_peer_cache(name, FP8_BH, NB)
        assert isinstance(map_peer_cache(name, FP32.with_(dtype=torch.float8_e4m3fn), 11),
                          PagedKVCache)  # 11 blocks + 16 bytes of per-tensor scales fit
    finally:
        unlink(name)


def test_scales_follow_the_blocks_16_byte_aligned_in_one_buffer():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=3,
                       dtype=torch.float8_e5m2, layout="NHD")  # 12 bytes per block
    a = PagedKVCache(spec, 3, scales_in_buffer=True)  # 36 bytes of blocks, scales at byte 48
    assert a.buffer.numel() == 56 and a.scales.data_ptr() == a.buffer.data_ptr() + 48
    assert torch.equal(a.scales, torch.ones(2))
    b = PagedKVCache(spec, 3, buffer=a.buffer, scales_in_buffer=True)
    b.scales[1] = 0.5
    assert a.scales.tolist() == [1.0, 0.5]
    assert a.buffer[52:56].view(torch.float32).item() == 0.5
    assert PagedKVCache(spec, 3).buffer.numel() == 36  # by default the scales are apart
    with pytest.raises(ValueError, match="^" + re.escape(
            "buffer holds 55 bytes; the cache needs 56 (36 bytes of blocks, then 8 bytes of "
            "float32 scales at byte 48)") + "$"):
        PagedKVCache(spec, 3, buffer=a.buffer[:55], scales_in_buffer=True)
    with pytest.raises(ValueError, match="not a multiple of 16 bytes .fp8 scales in the buffer."):
        PagedKVCache(spec, 2, buffer=a.buffer[4:], scales_in_buffer=True)


def test_cuda_import_refuses_an_export_without_the_scales():
    """Checked before any handle is opened (runs without a GPU)."""
    from kvflow.connector.transport.cuda_ipc import CudaIpcExport, import_cache
    exp = CudaIpcExport(uuid="0badc0de", pci_bus_id="0", handle=b"\x01" * 64,
                        storage_size=4096, storage_offset=0, ref_counter_handle=b"",
                        ref_counter_offset=0, event_handle=b"", event_sync_required=False,
                        buffer_offset=0, nbytes=3072, num_blocks=NB, spec=FP8_BH.to_dict(),
                        pid=os.getpid() + 1)
    with pytest.raises(TransferError, match="^" + re.escape(
            "CUDA IPC export is inconsistent: 3072 bytes at offset 0 of a 4096-byte storage; "
            "12 blocks of 256 bytes need 3456 (3072 bytes of blocks, then 384 bytes of float32 "
            "scales at byte 3072)") + "$"):
        import_cache(exp, FP8_BH, NB)
