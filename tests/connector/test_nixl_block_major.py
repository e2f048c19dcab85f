"""The ``nixl`` connector on a block-major cache (``BM_NHD``, all layers of a block contiguous):
its descriptor plan covers exactly the bytes the per-layer views hold, a WRITE of every layer
names one descriptor per block, a layerwise prefill one per (layer group, block), and both
modes land P's blocks in D's byte for byte over UCX's TCP transport (the layer-major plan is
:func:`~kvflow.connector.transport.nixl_plan.block_descs` unchanged).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector import Peer, PrefillJob, make_receiver, make_sender
from kvflow.connector.messages import decode
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from kvflow.connector.transport.nixl_plan import DescPlan, block_descs, layer_groups

os.environ.setdefault("UCX_TLS", tcp_tls())
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
BM = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32,
                 layout="BM_NHD")
NUM_BLOCKS = 12


def test_layer_groups_cover_each_group_then_every_layer():
    assert layer_groups(6, 4) == ((0, 4), (4, 6), (0, 6))
    assert layer_groups(8, 4) == ((0, 4), (4, 8), (0, 8))
    assert layer_groups(6, 6) == ((0, 6),)
    assert layer_groups(3, 8) == ((0, 3),)


def test_layer_major_plan_is_one_descriptor_per_tensor_and_block():
    spec = BM.with_(layout="NHD")
    plan = DescPlan(spec, NUM_BLOCKS, 4)
    assert np.array_equal(plan.rows(4096, 1),
                          block_descs(4096, spec.num_tensors, NUM_BLOCKS, spec.block_bytes, 1))
    assert plan.indices([3, 4], range(1, 2)).tolist() == [27, 28, 39, 40]


def test_block_major_rows_hold_exactly_the_bytes_of_the_group_layers():
    cache = PagedKVCache(BM, NUM_BLOCKS)
    plan = DescPlan(BM, NUM_BLOCKS, 4)
    base = cache.buffer.data_ptr()
    rows = plan.rows(base, 0)
    assert rows.shape == (3 * NUM_BLOCKS, 3)  # groups (0, 4), (4, 6), (0, 6)
    tpl, views = BM.tensors_per_layer, cache.tensors()
    for g, (lo, hi) in enumerate(plan.groups):
        for b in (0, 5, NUM_BLOCKS - 1):
            addr, size, dev = (int(x) for x in rows[g * NUM_BLOCKS + b])
            first, last = views[lo * tpl][b], views[hi * tpl - 1][b]
            assert addr == first.data_ptr() and dev == 0
            assert addr + size == last.data_ptr() + BM.block_bytes
    assert int(rows[2 * NUM_BLOCKS + 7][1]) == BM.bytes_per_block
    assert plan.indices([7, 2], range(0, 6)).tolist() == [2 * NUM_BLOCKS + 7, 2 * NUM_BLOCKS + 2]
    assert plan.indices([7], range(4, 6)).tolist() == [NUM_BLOCKS + 7]
    with pytest.raises(ValueError) as e:
        plan.indices([1], range(1, 3))
    assert str(e.value) == ("layers [1, 3) are not a layer group of this block-major descriptor "
                            "list (groups [(0, 4), (4, 6), (0, 6)])")


# ---- P -> D over UCX TCP ---------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # random bytes as float32 hold NaNs


@pytest.fixture
def link():
    import zmq
    ctx = zmq.Context()
    d_sock, p_sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    p_sock.connect(f"tcp://127.0.0.1:{d_sock.bind_to_random_port('tcp://127.0.0.1')}")
    yield p_sock, d_sock
    d_sock.close(0)
    p_sock.close(0)
    ctx.term()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _pair(mode, p_sock, device="cpu", layers_per_copy=4):
    config = {"mode": mode, "layers_per_copy": layers_per_copy}
    tx = make_sender("nixl", BM, device, config=config, instance_id="p-bm")
    rx = make_receiver("nixl", BM, device, config=config)
    p_cache, d_cache = tx.make_cache(NUM_BLOCKS), rx.make_cache(NUM_BLOCKS)
    rx.attach(Peer("p-bm", BM, NUM_BLOCKS, **tx.export()))
    tx.attach(Peer("d-bm", BM, NUM_BLOCKS, **rx.export()), link=p_sock)
    torch.manual_seed(1)
    p_cache.buffer.copy_(torch.randint(0, 256, p_cache.buffer.shape, dtype=torch.uint8))
    return tx, rx, p_cache, d_cache


def _check_landed(p_cache, d_cache, src, dst):
    for s, d in zip(p_cache.tensors(), d_cache.tensors()):
        assert torch.equal(_bits(d[dst]), _bits(s[src]))
        assert not _bits(d[[b for b in range(NUM_BLOCKS) if b not in dst]]).any()


@needs_nixl
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_after_the_prefill_one_descriptor_per_block(mode, device, link):
    """A 5-block prompt, 2 cached on D: P's blocks 4, 5, 11 land in D's 12 -> 9, 10, 3 byte for
    byte; direct posts 3 descriptors (one per block, all 6 layers), staged 3 x 12 tensors'
    worth in one contiguous range."""
    p_sock, d_sock = link
    tx, rx, p_cache, d_cache = _pair(mode, p_sock, device)
    try:
        src, dst = [9, 3, 4, 5, 11], [0, 1, 9, 10, 3]
        job = PrefillJob("r1", [1] * 18, src, "d-bm", dst, num_cached_blocks=2)
        tx.send_prefilled(job, 5)
        _, head, *frames = d_sock.recv_multipart()
        stats = rx.receive(decode(head), frames, d_cache, dst[2:], "p-bm")
        assert stats.blocks == 3 and stats.payload_bytes == 3 * BM.bytes_per_block
        _check_landed(p_cache, d_cache, src[2:], dst[2:])
        assert tx.agent.descs_posted == (3 if mode == "direct" else 3 * BM.num_tensors)
    finally:
        tx.close()
        rx.close()


@needs_nixl
@pytest.mark.parametrize("device", DEVICES)
def test_a_layerwise_prefill_writes_one_descriptor_per_group_and_block(device, link):
    """The connector's chunk hook, driven as the engine drives it (one chunk, a hook per layer):
    groups [0, 4) and [4, 6) each WRITE the 4 blocks' bytes of their layers; 8 descriptors (on
    a GPU posted by the poster's thread after each group's CUDA event)."""
    p_sock, d_sock = link
    tx, rx, p_cache, d_cache = _pair("direct", p_sock, device)
    try:
        src, dst = [2, 7, 8, 0], [11, 4, 5, 6]
        job = PrefillJob("r2", [1] * 14, src, "d-bm", dst)
        stats = tx.plan(job)
        on_layer = tx.chunk_hook(job, stats)(0, 14)
        for layer in range(BM.num_layers):
            on_layer(layer)
        tx._finish(job, 3, stats)
        assert tx.agent.descs_posted == 2 * 4
        _, head, *frames = d_sock.recv_multipart()
        msg = decode(head)
        rx.receive(msg, frames, d_cache, dst, "p-bm")
        assert msg.layerwise and msg.num_blocks == 4
        _check_landed(p_cache, d_cache, src, dst)
    finally:
        tx.close()
        rx.close()
