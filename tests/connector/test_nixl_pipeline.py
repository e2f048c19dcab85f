"""The pipelined staged ``nixl`` mode on CPU, P and D in one process over UCX's TCP transport:
blocks byte-exact against the torch reference for 4, 2 (an uneven last group) and 1 layer
groups; P reuses each of its two staging slots only after that slot's WRITE was waited for;
D scatters each group on its notification, before ``KVPushed``; a notification of a request D
ended never scatters. Skipped where NIXL is not installed."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.cache import PagedKVCache
from kvflow.connector import Peer, PrefillJob, make_receiver, make_sender
from kvflow.connector.messages import decode
from kvflow.connector.nixl_receiver import staging_blocks
from kvflow.connector.nixl_writer import PIPELINE_SLOTS
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from kvflow.kernels import copy_blocks

os.environ.setdefault("UCX_TLS", tcp_tls())
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 16


@pytest.fixture(params=[1, 3, 4], ids=["4-groups", "2-groups", "1-group"])
def pair(request):
    """A staged P and D of ``layers_per_copy`` 1, 3 or 4, linked by a ZMQ pair."""
    import zmq
    config = {"mode": "staged", "layers_per_copy": request.param}
    tx = make_sender("nixl", SPEC, config=config, instance_id="p-test")
    rx = make_receiver("nixl", SPEC, config=config)
    ctx = zmq.Context()
    d_sock, p_sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    p_sock.connect(f"tcp://127.0.0.1:{d_sock.bind_to_random_port('tcp://127.0.0.1')}")
    p_cache, d_cache = tx.make_cache(NUM_BLOCKS), rx.make_cache(NUM_BLOCKS)
    rx.attach(Peer("p-test", SPEC, NUM_BLOCKS, **tx.export()))
    tx.attach(Peer("d-test", SPEC, NUM_BLOCKS, **rx.export()), link=p_sock)
    torch.manual_seed(request.param)
    p_cache.buffer.copy_(torch.randint(0, 256, p_cache.buffer.shape, dtype=torch.uint8))
    yield tx, rx, p_cache, d_cache, d_sock
    tx.close()
    rx.close()
    d_sock.close(0)
    ctx.term()


def _expected(p_cache, src, dst) -> torch.Tensor:
    """D's cache bytes after the move, by the torch reference copy into a zeroed cache."""
    ref = PagedKVCache(SPEC, NUM_BLOCKS)
    copy_blocks(p_cache, ref, src, dst, backend="torch")
    return ref.buffer


def test_staged_blocks_are_byte_exact_and_slots_are_reused_only_after_their_write(
        pair, monkeypatch):
    tx, rx, p_cache, d_cache, d_sock = pair
    G = tx.layers_per_copy
    groups = -(-SPEC.num_layers // G)
    w = tx.copier
    nb = staging_blocks(SPEC, NUM_BLOCKS, tx.max_model_len)  # two slots of one group each
    assert w.slot_descs == nb * SPEC.tensors_per_layer * min(G, SPEC.num_layers)
    assert w.staging.numel() == PIPELINE_SLOTS * w.slot_descs * SPEC.block_bytes
    log, real_write, real_wait = [], w.agent.write, w.agent.wait

    def write(local, lidx, remote, ridx, what, notif=b""):
        h = real_write(local, lidx, remote, ridx, what, notif)
        log.append(("write", int(lidx[0]) // w.slot_descs, notif.split(b" ")[1:3], h))
        return h

    def wait(handles, *a, **k):
        log.append(("wait", [next(i for i, e in enumerate(log) if e[-1] is h) for h in handles]))
        return real_wait(handles, *a, **k)
    monkeypatch.setattr(w.agent, "write", write)
    monkeypatch.setattr(w.agent, "wait", wait)
    for req, (src, dst, cached) in enumerate([([9, 3, 4, 5, 11], [0, 1, 12, 13, 7], 2),
                                              ([2], [6], 0)]):
        log.clear()
        d_cache.buffer.zero_()
        job = PrefillJob(f"r{req}", [1] * (4 * len(src) - 1), src, "d-test", dst,
                         num_cached_blocks=cached)
        tx.send_prefilled(job, 42)
        _, head, *frames = d_sock.recv_multipart()
        stats = rx.receive(decode(head), frames, d_cache, dst[cached:], "p-test")
        assert stats.blocks == len(src) - cached
        assert torch.equal(d_cache.buffer, _expected(p_cache, src[cached:], dst[cached:]))
        writes = [e for e in log if e[0] == "write"]
        assert [e[1] for e in writes] == [g % PIPELINE_SLOTS for g in range(groups)]
        assert [e[2] for e in writes] == [[b"%d" % lo, b"%d" % min(lo + G, SPEC.num_layers)]
                                          for lo in range(0, SPEC.num_layers, G)]
        # group g is gathered into slot g % 2 only after the WRITE of group g - 2 was waited
        # for; the last wait (finish) takes the WRITEs still in flight
        ws = [i for i, e in enumerate(log) if e[0] == "write"]
        for g in range(PIPELINE_SLOTS, groups):
            (waited,) = [e[1] for e in log[:ws[g]] if e[0] == "wait" and ws[g - 2] in e[1]]
            assert waited == [ws[g - 2]]
        assert log[-1][0] == "wait" and sorted(log[-1][1]) == ws[max(0, groups - 2):]


def test_d_scatters_each_group_on_its_notification_before_kvpushed(pair):
    tx, rx, p_cache, d_cache, d_sock = pair
    src, dst = [5, 6, 7], [1, 2, 3]
    rx.expect("r1")
    tx.send_prefilled(PrefillJob("r1", [1] * 12, src, "d-test", dst), 0)
    deadline = time.monotonic() + 10
    while rx.groups.get("r1", [0])[0] < SPEC.num_layers:  # D's progress thread scatters
        assert time.monotonic() < deadline, rx.groups
        time.sleep(1e-3)
    assert torch.equal(d_cache.buffer, _expected(p_cache, src, dst))  # KVPushed not read yet
    _, head, *frames = d_sock.recv_multipart()
    assert rx.receive(decode(head), frames, d_cache, dst, "p-test").blocks == 3
    assert "r1" not in rx.groups and "r1" in rx.ended


def test_notifications_of_a_request_d_ended_never_scatter(pair):
    tx, rx, p_cache, d_cache, d_sock = pair
    rx.forget("r-gone")  # D ended it (its blocks lent): P's WRITEs still land in the slot
    tx.send_prefilled(PrefillJob("r-gone", [1] * 8, [4, 5], "d-test", [8, 9]), 0)
    d_sock.recv_multipart()
    time.sleep(0.2)  # the notifications came and went
    rx.agent.progress()
    assert not d_cache.buffer.any() and "r-gone" not in rx.groups


def test_kv_into_other_blocks_than_kvpushed_is_for_fails_the_request(pair):
    from kvflow.connector import TransferError
    tx, rx, p_cache, d_cache, d_sock = pair
    tx.send_prefilled(PrefillJob("r1", [1] * 8, [4, 5], "d-test", [8, 9]), 0)
    _, head, *frames = d_sock.recv_multipart()
    with pytest.raises(TransferError) as e:
        rx.receive(decode(head), frames, d_cache, [8, 10], "p-test")
    assert str(e.value) == "staged KV of r1 went into D's blocks [8, 9]; D expects [8, 10]"
    assert "r1" in rx.ended and "r1" not in rx.groups


def test_a_request_over_p_s_staging_slot_is_refused_before_any_write(pair):
    """P's slots hold one layer group of its longest request (``max_model_len``): a request
    over it is refused naming P, before any WRITE (a gather past a slot would overwrite the
    other slot while its WRITE is in flight)."""
    from kvflow.connector import TransferError
    tx, rx, p_cache, d_cache, d_sock = pair
    tx.copier.slot_descs //= NUM_BLOCKS  # as if P's max_model_len were one block
    with pytest.raises(TransferError) as e:
        tx.send_prefilled(PrefillJob("r1", [1] * 8, [4, 5], "d-test", [8, 9]), 0)
    assert str(e.value) == ("request r1 moves 2 blocks (8 tokens, 0 cached on D); a staging "
                            "slot of this prefill instance holds 1")
    assert tx.copier.posted == 0 and tx.agent.descs_posted == 0
