"""A transfer of zero blocks (D's prefix cache already holds every prompt block) is a success
for every connector: tcp, ipc-pull (after the prefill), layerwise (ipc-pull and tcp parts) and
ipc-push. Checked at the transfer level (sender + receiver, nothing written into D's cache) and in
the served path in process (the same two-block prompt twice: the repeat moves nothing and
decodes the same tokens). Issue 14 kind 5: tcp answered the repeat with 502 "both buffer length
(0) and count (-1) must not be 0"."""

from __future__ import annotations

import types

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector.messages import KVData, KVLayer, KVPushed, KVReady, decode
from kvflow.connector import Peer, PrefillJob, make_receiver
from kvflow.connector.ipc_pull import IpcPullSender
from kvflow.connector.ipc_push import PushReceiver, PushSender
from kvflow.connector.transport.shm import SharedCache
from kvflow.connector.tcp import TcpSender

from tests.zmq_link import recv, zmq_link  # noqa: F401 (zmq_link: a fixture)

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def _d_cache() -> PagedKVCache:
    cache = PagedKVCache(SPEC, 8)
    cache.buffer.fill_(0x5A)
    return cache


def _untouched(cache: PagedKVCache) -> bool:
    return bool((cache.buffer == 0x5A).all())


def test_tcp_sends_and_receives_zero_blocks(zmq_link):
    p_sock, d_sock = zmq_link
    TcpSender(SPEC).send(p_sock, "r", PagedKVCache(SPEC, 8), [], first_token=3, num_prompt_tokens=8)
    head, payload = recv(d_sock)
    assert isinstance(head, KVData) and head.num_blocks == 0
    d = _d_cache()
    stats = make_receiver("tcp").receive(head, payload, d, [])
    assert (stats.blocks, stats.payload_bytes) == (0, 0) and _untouched(d)


def test_ipc_pull_sends_and_receives_zero_blocks(zmq_link):
    p_sock, d_sock = zmq_link
    shared = SharedCache(SPEC, 8)
    try:
        rx = make_receiver("ipc-pull")
        rx.attach(Peer("p0", SPEC, 8, shm_name=shared.name))
        IpcPullSender(SPEC).send(p_sock, "r", shared.cache, [], first_token=3, num_prompt_tokens=8)
        head, payload = recv(d_sock)
        assert isinstance(head, KVReady) and head.src_block_ids == []
        d = _d_cache()
        stats = rx.receive(head, payload, d, [], "p0")
        assert (stats.blocks, stats.payload_bytes) == (0, 0) and _untouched(d)
    finally:
        shared.close()


@pytest.mark.parametrize("transfer", ["ipc-pull", "tcp"])
def test_layerwise_last_part_alone_completes_zero_blocks(transfer):
    rx = make_receiver(transfer)
    if transfer == "ipc-pull":  # stands for P's mapped cache: nothing is read from it
        rx.peers["p0"] = PagedKVCache(SPEC, 8)
    d = _d_cache()
    last = KVLayer(req_id="r", reply_to="p0", last=True, first_token=3, num_prompt_tokens=8)
    stats = rx.receive(last, [], d, [], "p0")
    assert (stats.blocks, stats.payload_bytes) == (0, 0) and _untouched(d)


def test_push_writes_nothing_and_d_accepts_zero_blocks():
    from kvflow.engine import Engine
    from kvflow.model import load_model
    model, _ = load_model("kvflow-tiny")
    spec = model.kv_spec(16)
    w = PushSender(spec, layers_per_copy=2, layerwise_min_tokens=0)
    eng = Engine(model, w.make_cache(4))
    peer = w.peers["d-1"] = PagedKVCache(spec, 4)
    peer.buffer.fill_(0x5A)
    sent = []
    w.links["d-1"] = types.SimpleNamespace(send=sent.append)
    job = PrefillJob("r", list(range(1, 33)), [0, 1], "d-1", [2, 3], num_cached_blocks=2)
    hook = w.begin(job)                              # layer by layer during the prefill
    eng.prefill(job.token_ids, job.blocks, chunk_size=16, on_chunk=hook)
    assert w.finish(job, 3) is None and w.prefilling == {}
    assert w.send_prefilled(job, 3) is None          # after the prefill
    for raw, layerwise in zip(sent, (True, False), strict=True):
        done = decode(raw)
        assert (done.ok, done.first_token, done.num_blocks, done.payload_bytes, done.t_start,
                done.layerwise) == (True, 3, 0, 0, 0.0, layerwise)
    assert bool((peer.buffer == 0x5A).all())
    stats = PushReceiver().receive(KVPushed(req_id="r", ok=True, first_token=3, num_blocks=0),
                                   [], peer, [])
    assert (stats.blocks, stats.payload_bytes) == (0, 0)


# ---- served path, in process: the same two-block prompt twice --------------------------------
def _request(h, rid: str, tokens: list[int], min_tokens: int):
    """As the router does: Allocate on D, Prefill on P with D's prefix hit as
    ``num_cached_blocks``;
    returns (generated ids or the error message, D's first Tokens' kvflow dict)."""
    from kvflow.serve.protocol import Allocate, Allocated, Prefill, Rejected, Tokens
    h.p.connector.layerwise_min_tokens = min_tokens
    h.to(h.d, Allocate(req_id=rid, token_ids=tokens, max_tokens=5, ignore_eos=True))
    (alloc,) = h.wait_for((Allocated, Rejected), req_id=rid)
    h.to(h.p, Prefill(req_id=rid, token_ids=tokens, decode_id=h.d.instance_id,
                      decode_block_ids=alloc.block_ids, num_cached_blocks=alloc.num_cached_blocks))
    out, first = [], None
    while True:
        (msg,) = h.wait_for((Tokens, Rejected), req_id=rid)
        if isinstance(msg, Rejected) or msg.error:
            return msg.error, first
        if first is None and "blocks" in msg.kvflow:  # D's (P's first token carries no blocks)
            first = msg.kvflow
        out.append((msg.index, msg.token_ids))  # P's token and D's may arrive either way round
        if msg.finished and len(out) > 1:
            return [t for _, ids in sorted(out) for t in ids], first


@pytest.mark.parametrize("transfer, extra", [
    ("tcp", {}), ("tcp", {"layerwise": True}), ("ipc-pull", {}), ("ipc-pull", {"layerwise": True}),
    ("ipc-push", {"push": True})], ids=["tcp", "tcp-layerwise", "ipc", "ipc-layerwise", "push"])
def test_repeat_of_a_fully_cached_prompt_moves_nothing_and_decodes_the_same(transfer, extra):
    from tests.serve.test_serve_layerwise import NEVER, Harness, prompt
    extra = dict(extra)
    layerwise = extra.pop("layerwise", False)
    h = Harness(transfer, enable_prefix_caching=True)
    try:
        toks = prompt(32)                                  # exactly 2 blocks of 16
        min_tokens = 0 if layerwise or extra else NEVER
        first, kv1 = _request(h, "first", toks, min_tokens)
        again, kv2 = _request(h, "again", toks, min_tokens)
        assert isinstance(first, list) and again == first, again
        assert (kv1["blocks"], kv1["cached_blocks"]) == (2, 0)
        assert (kv2["blocks"], kv2["payload_bytes"], kv2["cached_blocks"]) == (0, 0, 2)
        assert kv2["layerwise"] == bool(layerwise or extra)
        h.d.prefix.clear()
        assert h.blocks_back() == h.free0
    finally:
        h.close()


def test_served_tcp_repeat_of_a_two_block_prompt_is_200_and_moves_nothing():
    """The issue's report, end to end: ``--kv-connector tcp --enable-prefix-caching``, a prompt of
    exactly 2 blocks sent twice; the repeat was HTTP 502."""
    from tests.serve_server import Server
    srv = Server("--kv-connector", "tcp", "--enable-prefix-caching", "--num-blocks", "16")
    try:
        srv.wait_healthy()
        body = dict(prompt="A" * 31, max_tokens=6, ignore_eos=True)   # <bos> + 31 bytes = 2 blocks
        a, b = srv.complete(**body), srv.complete(**body)
        assert (a.status_code, b.status_code) == (200, 200), b.text
        assert a.json()["kvflow"]["blocks"] == 2
        kv = b.json()["kvflow"]
        assert (kv["blocks"], kv["payload_bytes"], kv["cached_blocks"]) == (0, 0, 2)
        assert b.json()["choices"][0]["token_ids"] == a.json()["choices"][0]["token_ids"]
    finally:
        assert srv.stop() == 0
