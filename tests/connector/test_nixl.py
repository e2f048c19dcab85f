"""The ``nixl`` connector at the transfer level: descriptor coalescing (pure functions), the
agent info that travels in Register / Pair, one-sided WRITEs between two processes over
UCX's TCP transport (``UCX_TLS=tcp``: on one host UCX would take shared memory), and the
failures: a dead D is an explicit TransferError and its agent is removed, a bad pairing is
refused naming both values. Skipped where NIXL is not installed (``pip install 'kvflow[nixl]'``).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from kvflow import KVCacheSpec
from kvflow.connector import Peer, PrefillJob, TransferError, make_receiver, make_sender
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from kvflow.connector.transport.nixl_plan import coalesce, desc_indices
from kvflow.connector.messages import (NixlAgentInfo, ProtocolError, decode, decode_agent_info,
                                       encode_agent_info)
from kvflow.serve.advertise import advertised_host

os.environ.setdefault("UCX_TLS", tcp_tls())  # the network path, also between local processes
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 16


def test_coalesce_merges_pairs_consecutive_on_both_sides():
    assert coalesce([], []) == []
    assert coalesce([3, 4, 5], [7, 8, 9]) == [(3, 7, 3)]
    assert coalesce([3, 4, 5], [7, 9, 10]) == [(3, 7, 1), (4, 9, 2)]
    assert coalesce([1, 2, 0], [5, 6, 7]) == [(1, 5, 2), (0, 7, 1)]
    assert coalesce([2, 1], [1, 2]) == [(2, 1, 1), (1, 2, 1)]  # descending ids never merge
    with pytest.raises(ValueError) as e:
        coalesce([1, 2], [3])
    assert str(e.value) == "src_ids has 2 ids and dst_ids 1; they must pair one to one"


def test_desc_indices_are_tensor_major_and_count_runs_per_tensor():
    assert desc_indices([3, 4], range(2, 4), 10).tolist() == [23, 24, 33, 34]
    assert desc_indices([], range(0, 2), 10).tolist() == []
    assert len(coalesce([0, 1, 2, 5], [8, 9, 10, 11])) * 8 == 2 * 8


def test_agent_info_round_trips_and_bad_bytes_are_refused():
    info = NixlAgentInfo(agent="a", metadata=b"\x00\x01md", cache_addr=4096, cache_bytes=8192,
                         num_blocks=2, mode="staged", staging_addr=1 << 40, staging_slots=4,
                         slot_bytes=1024)
    assert decode_agent_info(encode_agent_info(info)) == info
    with pytest.raises(ProtocolError) as e:
        decode_agent_info(b"")
    assert str(e.value) == ("no nixl agent info (connector_md is empty: is the peer running with "
                            "--kv-connector nixl?)")
    with pytest.raises(ProtocolError, match=r"rejected nixl agent info \(3 bytes\)"):
        decode_agent_info(b"\x01\x02\x03")


def test_advertised_host_replaces_a_wildcard():
    assert advertised_host("127.0.0.2") == "127.0.0.2"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    derived = advertised_host("0.0.0.0")
    assert derived not in ("0.0.0.0", "") and derived.count(".") == 3


def test_unknown_mode_is_refused_naming_the_value():
    with pytest.raises(ValueError) as e:
        make_sender("nixl", SPEC, config={"mode": "bulk"})
    assert str(e.value) == ("kv_connector_config key 'mode' of connector 'nixl' must be one of "
                            "direct, staged; got 'bulk'")


def test_write_timeout_is_a_config_key_of_p_that_d_ignores():
    assert make_sender("nixl", SPEC, config={"write_timeout_s": 7}).timeout_s == 7.0
    assert make_sender("nixl", SPEC).timeout_s == 30.0
    make_receiver("nixl", SPEC, config={"write_timeout_s": 7})  # one config for P and D
    with pytest.raises(ValueError) as e:
        make_sender("nixl", SPEC, config={"write_timeout_s": 0})
    assert str(e.value) == ("kv_connector_config key 'write_timeout_s' of connector 'nixl' must be "
                            "a number of seconds > 0; got 0")


# ---- two halves in one process, then in two -------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """Random bytes as float32 hold NaNs: compare the bits."""
    return t.contiguous().view(torch.int32)


def _pair(mode: str, sock):
    tx = make_sender("nixl", SPEC, config={"mode": mode}, instance_id="p-test")
    rx = make_receiver("nixl", SPEC, config={"mode": mode})
    p_cache, d_cache = tx.make_cache(NUM_BLOCKS), rx.make_cache(NUM_BLOCKS)
    rx.attach(Peer("p-test", SPEC, NUM_BLOCKS, **tx.export()))
    tx.attach(Peer("d-test", SPEC, NUM_BLOCKS, **rx.export()), link=sock)
    return tx, rx, p_cache, d_cache


@needs_nixl
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_prefill_writes_exactly_the_missing_blocks_into_d(mode):
    """A 5-block prompt, D's prefix cache holds 2: P's blocks 2..4 land in D's table [2:],
    byte for byte; nothing else of D's cache changes; KVPushed reports 3 blocks."""
    import zmq
    ctx = zmq.Context()
    d_sock, p_sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    p_sock.connect(f"tcp://127.0.0.1:{d_sock.bind_to_random_port('tcp://127.0.0.1')}")
    tx, rx, p_cache, d_cache = _pair(mode, p_sock)
    try:
        torch.manual_seed(0)
        p_cache.buffer.copy_(torch.randint(0, 256, p_cache.buffer.shape, dtype=torch.uint8))
        src, dst = [9, 3, 4, 5, 11], [0, 1, 12, 13, 7]
        job = PrefillJob("r1", [1] * 18, src, "d-test", dst, num_cached_blocks=2)
        assert tx.send_prefilled(job, 42) is None
        _, head, *frames = d_sock.recv_multipart()
        msg = decode(head)
        stats = rx.receive(msg, frames, d_cache, dst[2:], "p-test")
        assert (msg.ok, msg.first_token, msg.num_blocks) == (True, 42, 3)
        assert stats.blocks == 3 and stats.payload_bytes == 3 * SPEC.bytes_per_block
        for s, d in zip(p_cache.tensors(), d_cache.tensors()):
            assert torch.equal(_bits(d[[12, 13, 7]]), _bits(s[[4, 5, 11]]))
            untouched = [b for b in range(NUM_BLOCKS) if b not in (12, 13, 7)]
            assert not _bits(d[untouched]).any()
        # a second request reuses the staging slot once D freed it (staged)
        job = PrefillJob("r2", [1] * 4, [0], "d-test", [2])
        tx.send_prefilled(job, 7)
        _, head, *frames = d_sock.recv_multipart()
        rx.receive(decode(head), frames, d_cache, [2], "p-test")
        assert all(torch.equal(_bits(d[2]), _bits(s[0])) for s, d in zip(p_cache.tensors(), d_cache.tensors()))
    finally:
        tx.close()
        rx.close()
        d_sock.close(0)
        ctx.term()


@needs_nixl
def test_consecutive_ids_move_as_one_descriptor_per_tensor():
    """NIXL merges the prepared per-block descriptors of consecutive ids: a WRITE of 6 pairs
    forming 2 runs moves 2 x num_tensors descriptors (NIXL's telemetry)."""
    from kvflow.connector.transport.nixl_agent import Agent
    from kvflow.connector.transport.nixl_plan import block_descs
    a, b = Agent("t1", telemetry=True), Agent("t2")
    src, dst = torch.ones(SPEC.num_tensors * NUM_BLOCKS * 64, dtype=torch.uint8), \
        torch.zeros(SPEC.num_tensors * NUM_BLOCKS * 64, dtype=torch.uint8)
    a.register(src)
    b.register(dst)
    try:
        name = a.add_peer("b", b.metadata())
        local = a.prep("", block_descs(src.data_ptr(), SPEC.num_tensors, NUM_BLOCKS, 64))
        remote = a.prep(name, block_descs(dst.data_ptr(), SPEC.num_tensors, NUM_BLOCKS, 64))
        s_ids, d_ids = [1, 2, 3, 8, 9, 10], [4, 5, 6, 12, 13, 14]
        tensors = range(SPEC.num_tensors)
        h = a.write(local, desc_indices(s_ids, tensors, NUM_BLOCKS), remote,
                    desc_indices(d_ids, tensors, NUM_BLOCKS), "test")
        tel = None
        while a.agent.check_xfer_state(h) == "PROC":
            pass
        tel = a.telemetry(h)
        assert tel.descCount == len(coalesce(s_ids, d_ids)) * SPEC.num_tensors == 16
        assert tel.totalBytes == len(s_ids) * SPEC.num_tensors * 64
        assert a.descs_posted == len(s_ids) * SPEC.num_tensors and a.post_ms > 0
        h.release()
        assert int(dst.sum()) == len(s_ids) * SPEC.num_tensors * 64
    finally:
        a.close()
        b.close()


def _decode_process(mode, conn):
    """D in its own process: export, wait for P's KVPushed, report what landed, then exit."""
    import zmq
    os.environ["UCX_TLS"] = tcp_tls()
    rx = make_receiver("nixl", SPEC, config={"mode": mode})
    cache = rx.make_cache(NUM_BLOCKS)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send((port, rx.export()))
    p_export = conn.recv()
    rx.attach(Peer("p-test", SPEC, NUM_BLOCKS, **p_export))
    _, head, *frames = sock.recv_multipart()
    rx.receive(decode(head), frames, cache, [5, 6, 7], "p-test")
    conn.send([t[[5, 6, 7]].clone() for t in cache.tensors()])
    conn.recv()  # stay alive until P is done
    rx.close()


@needs_nixl
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_two_processes_over_ucx_tcp_then_the_dead_d_is_an_explicit_failure(mode):
    import zmq
    mp_ctx = mp.get_context("spawn")
    here, there = mp_ctx.Pipe()
    proc = mp_ctx.Process(target=_decode_process, args=(mode, there), daemon=True)
    proc.start()
    tx = make_sender("nixl", SPEC, config={"mode": mode}, instance_id="p-test")
    ctx = zmq.Context()
    try:
        p_cache = tx.make_cache(NUM_BLOCKS)
        torch.manual_seed(1)
        p_cache.buffer.copy_(torch.randint(0, 256, p_cache.buffer.shape, dtype=torch.uint8))
        assert here.poll(60)
        port, d_export = here.recv()
        here.send(tx.export())
        link = ctx.socket(zmq.DEALER)
        link.connect(f"tcp://127.0.0.1:{port}")
        tx.attach(Peer("d-test", SPEC, NUM_BLOCKS, **d_export), link=link)
        tx.send_prefilled(PrefillJob("r1", [1] * 12, [1, 2, 3], "d-test", [5, 6, 7]), 0)
        assert here.poll(60)
        landed = here.recv()
        for s, d in zip(p_cache.tensors(), landed):
            assert torch.equal(_bits(d), _bits(s[[1, 2, 3]]))
        here.send("done")
        proc.join(30)
        assert proc.exitcode == 0
        with pytest.raises(TransferError, match=r"^NIXL WRITE of layers \[0, 4\) to d-test failed"):
            tx.send_prefilled(PrefillJob("r2", [1] * 4, [1], "d-test", [5]), 0)
        tx.detach("d-test")
        assert tx.agent.peers == {} and tx.links == {}
    finally:
        tx.close()
        ctx.term()
        if proc.is_alive():
            proc.kill()


@needs_nixl
def test_mode_mismatch_refuses_the_pairing_naming_both_values():
    tx = make_sender("nixl", SPEC, config={"mode": "direct"}, instance_id="p-test")
    rx = make_receiver("nixl", SPEC, config={"mode": "staged"})
    try:
        tx.make_cache(NUM_BLOCKS)
        rx.make_cache(NUM_BLOCKS)
        with pytest.raises(TransferError) as e:
            tx.attach(Peer("d-test", SPEC, NUM_BLOCKS, **rx.export()), link=_NullLink())
        assert str(e.value) == "nixl mode mismatch, pairing refused: direct (p-test) vs staged (d-test)"
        assert tx.links == {} and tx.peers == {}
        with pytest.raises(TransferError, match="no nixl agent info"):
            tx.attach(Peer("d-x", SPEC, NUM_BLOCKS), link=_NullLink())
    finally:
        tx.close()
        rx.close()


class _NullLink:
    def close(self, linger=None):
        pass


# ---- memory types, descriptors, staged slot notices ------------------------------------------
def test_descriptors_carry_the_device_id_and_the_memory_type_follows_the_tensor():
    from kvflow.bench.nixl import chunk_descs
    from kvflow.connector.transport.nixl_agent import mem_type
    from kvflow.connector.transport.nixl_plan import block_descs
    d = block_descs(1000, 2, 3, 16, device_id=1)
    assert d.tolist() == [[1000 + 16 * i, 16, 1] for i in range(6)]
    assert chunk_descs(64, 40, 16, 2).tolist() == [[64, 16, 2], [80, 16, 2], [96, 8, 2]]
    assert chunk_descs(64, 40, 0).tolist() == [[64, 40, 0]]
    assert mem_type(torch.zeros(1)) == ("DRAM", 0)
    with pytest.raises(TransferError) as e:
        mem_type(torch.zeros(1, device="meta"))
    assert str(e.value) == "NIXL moves host (cpu) or CUDA memory; got a tensor on meta"


def test_agent_info_says_where_the_memory_is():
    info = NixlAgentInfo(agent="a", metadata=b"m", mem_type="VRAM", device_id=3)
    assert decode_agent_info(encode_agent_info(info)) == info
    assert NixlAgentInfo(agent="a", metadata=b"m").mem_type == "DRAM"
    with pytest.raises(ProtocolError, match=r"Invalid enum value 'HBM'"):
        decode_agent_info(encode_agent_info(NixlAgentInfo(agent="a", metadata=b"m",
                                                          mem_type="HBM")))


def test_a_device_nixl_cannot_move_is_refused_naming_it():
    with pytest.raises(ValueError) as e:
        make_sender("nixl", SPEC, "meta")
    assert str(e.value) == "the nixl connector moves host (cpu) or CUDA caches; got device meta"


class _Notices:
    """An Agent stand-in holding D's notices to this P."""

    def __init__(self, *msgs: bytes) -> None:
        self.msgs = list(msgs)

    def take(self, peer_id: str, prefix: bytes):
        for i, m in enumerate(self.msgs):
            if m.startswith(prefix):
                return self.msgs.pop(i)
        return None


def test_staged_p_frees_its_slot_on_its_own_notice_and_drops_the_others():
    """D tells every paired P of a request that ended before its KV came: P keeps none of the
    notices meant for other P's, and its slot is free once its own request's notice came."""
    from kvflow.connector.nixl_writer import NixlPeer, NixlWriter
    w = NixlWriter(_Notices(b"free r-other", b"free r-mine", b"free r-old"), None, None,
                   "staged", 1)
    peer = NixlPeer("d", "agent-d", 8, slot=0, last_req="r-mine")
    w.begin(object(), peer)
    assert peer.last_req == "" and w.agent.msgs == []
    w.agent.msgs = [b"free r-x"]
    peer.last_req = "r-y"
    import kvflow.connector.nixl_writer as nw
    old, nw.SLOT_TIMEOUT_S = nw.SLOT_TIMEOUT_S, 0.05
    try:
        with pytest.raises(TransferError) as e:
            w.begin(object(), peer)
    finally:
        nw.SLOT_TIMEOUT_S = old
    assert str(e.value) == ("decode instance d did not free its staging slot of request r-y "
                            "within 0.05 s")
    assert w.agent.msgs == []


@needs_nixl
@pytest.mark.parametrize("kind", ["nixl", "nixl-staged"])
def test_bench_pair_with_d_in_its_own_process_moves_the_blocks(kind, monkeypatch):
    """The transfer bench's two-process pair (what CUDA IPC and NIXL's cuda_ipc need) writes
    P's blocks into D's ids; a digest of other blocks differs (the check can fail)."""
    from kvflow.bench.cases import blocks_digest
    from kvflow.bench.remote_pair import RemotePair
    monkeypatch.setenv("UCX_TLS", tcp_tls())
    geometry = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    spec = KVCacheSpec(**geometry, dtype=torch.bfloat16)
    pair = RemotePair(kind, spec, geometry, 8, "cpu", "cpu", longest=16)
    try:
        assert pair.check([5, 1, 6], [0, 7, 3]) is True
        assert pair.d.call("digest", ids=[0, 7, 3])["sha256"] != blocks_digest(pair.p_cache,
                                                                                [5, 6, 1])
        stats = pair.request([2], [4])
        assert stats.receive_ms > 0
        assert pair.d.call("digest", ids=[4])["sha256"] == blocks_digest(pair.p_cache, [2])
    finally:
        pair.close()
    assert pair.d.proc.returncode == 0
