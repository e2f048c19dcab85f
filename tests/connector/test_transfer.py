"""The ipc and tcp connectors move exactly the request's blocks into D's own ids (byte-equal
to the torch reference), refuse bad frames, never send during a profile run, and manage
shared-memory segments (0600, unique names, unlinked, stale ones cleaned)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.context import forward_context
from kvflow.connector.messages import KVData, KVReady
from kvflow.segments import Owner
from kvflow.connector import Peer, TransferError, make_receiver
from kvflow.connector.ipc_pull import IpcPullSender
from kvflow.connector.transport.shm import SharedCache, map_peer_cache
from kvflow.segments import SHM_DIR, clean_stale
from kvflow.connector.tcp import TcpSender

from tests.zmq_link import recv, zmq_link  # noqa: F401 (zmq_link: a fixture)

SPECS = [
    KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32, layout="NHD"),
    KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16, layout="HND"),
    KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float16, layout="MLA"),
]
SRC = [7, 2, 9, 0]     # P's blocks of the request
DST = [1, 5, 3, 11]    # D's own blocks (a different table: D replaces P's, never extends it)


def _fill(cache: PagedKVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randint(0, 256, (cache.buffer.numel(),), dtype=torch.uint8, generator=g))


def _expected(p: PagedKVCache, d_before: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.clone() for t in d_before]
    for t_src, t_dst in zip(p.tensors(), out):
        t_dst.view(torch.uint8)[DST] = t_src.view(torch.uint8)[SRC]
    return out


def _assert_bytes_equal(got: PagedKVCache, want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got.tensors(), want)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"tensor {i} differs"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.dtype}")
def test_ipc_pulls_request_blocks_into_d_ids(spec, zmq_link):
    p_sock, d_sock = zmq_link
    shared = SharedCache(spec, num_blocks=12, role="prefill")
    try:
        _fill(shared.cache, 1)
        d_cache = PagedKVCache(spec, num_blocks=16)
        _fill(d_cache, 2)
        want = _expected(shared.cache, d_cache.tensors())
        receiver = make_receiver("ipc-pull", backend="numba")
        receiver.attach(Peer("p0", spec, 12, shm_name=shared.name))
        IpcPullSender(spec).send(p_sock, "r1", shared.cache, SRC, first_token=42, num_prompt_tokens=15)
        head, payload = recv(d_sock)
        assert isinstance(head, KVReady) and head.src_block_ids == SRC and head.first_token == 42
        stats = receiver.receive(head, payload, d_cache, DST)
        _assert_bytes_equal(d_cache, want)
        assert (stats.blocks, stats.payload_bytes) == (4, 4 * spec.bytes_per_block)
    finally:
        shared.close()
    assert not os.path.exists(shared.path)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.dtype}")
def test_tcp_gathers_sends_and_scatters_into_d_ids(spec, zmq_link):
    p_sock, d_sock = zmq_link
    p_cache, d_cache = PagedKVCache(spec, num_blocks=12), PagedKVCache(spec, num_blocks=16)
    _fill(p_cache, 3)
    _fill(d_cache, 4)
    want = _expected(p_cache, d_cache.tensors())
    keep = TcpSender(spec, backend="numba").send(p_sock, "r2", p_cache, SRC, first_token=7,
                                           num_prompt_tokens=13)
    head, payload = recv(d_sock)
    assert isinstance(head, KVData) and (head.num_blocks, head.num_frames) == (4, spec.num_layers)
    assert len(payload) == spec.num_layers
    stats = make_receiver("tcp", backend="numba").receive(head, payload, d_cache, DST)
    _assert_bytes_equal(d_cache, want)
    assert stats.payload_bytes == 4 * spec.bytes_per_block == keep.numel() * keep.element_size()


def test_receive_max_ctas_caps_each_of_d_s_copies(zmq_link, monkeypatch):
    """``receive_max_ctas`` reaches every copy D's receive makes (tcp's scatter per layer,
    ipc-pull's copy), and the blocks land byte for byte as without it."""
    import kvflow.connector.ipc_pull as ipc_pull
    import kvflow.connector.transport.frames as frames
    spec, seen = SPECS[0], []

    def spy(fn):
        def call(*a, **kw):
            seen.append(kw.get("max_ctas"))
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(frames, "scatter_blocks", spy(frames.scatter_blocks))
    monkeypatch.setattr(ipc_pull, "copy_blocks", spy(ipc_pull.copy_blocks))
    p_sock, d_sock = zmq_link
    p_cache, d_cache = PagedKVCache(spec, num_blocks=12), PagedKVCache(spec, num_blocks=16)
    _fill(p_cache, 5)
    _fill(d_cache, 6)
    want = _expected(p_cache, d_cache.tensors())
    TcpSender(spec, backend="numba").send(p_sock, "r3", p_cache, SRC, first_token=1,
                                          num_prompt_tokens=13)
    head, payload = recv(d_sock)
    rx = make_receiver("tcp", backend="numba", config={"receive_max_ctas": 4})
    rx.receive(head, payload, d_cache, DST)
    _assert_bytes_equal(d_cache, want)
    assert seen == [4] * spec.num_layers
    shared = SharedCache(spec, num_blocks=12, role="prefill")
    try:
        _fill(shared.cache, 7)
        d_cache = PagedKVCache(spec, num_blocks=16)
        want = _expected(shared.cache, d_cache.tensors())
        rx = make_receiver("ipc-pull", backend="numba", config={"receive_max_ctas": 8})
        rx.attach(Peer("p0", spec, 12, shm_name=shared.name))
        IpcPullSender(spec).send(p_sock, "r4", shared.cache, SRC, first_token=1,
                                 num_prompt_tokens=15)
        head, payload = recv(d_sock)
        rx.receive(head, payload, d_cache, DST)
        _assert_bytes_equal(d_cache, want)
        assert seen == [4] * spec.num_layers + [8]
    finally:
        shared.close()


def test_tcp_rejects_frames_that_do_not_match(zmq_link):
    spec = SPECS[0]
    d_cache = PagedKVCache(spec, num_blocks=16)
    rx = make_receiver("tcp")
    head = KVData(req_id="r", num_blocks=4, num_frames=3, first_token=1, num_prompt_tokens=16, t_start=0.0)
    short = [b"\1" * (2 * 4 * spec.block_bytes)] * 2 + [b"\1" * 5]
    with pytest.raises(TransferError, match="layer 2 frame has 5 bytes, expected 2048"):
        rx.receive(head, short, d_cache, DST)
    with pytest.raises(TransferError, match="carries 4 blocks; D allocated 3"):
        rx.receive(head, short, d_cache, DST[:3])
    with pytest.raises(TransferError, match="expected 3 layer frames, header says 3, got 2"):
        rx.receive(head, short[:2], d_cache, DST)
    assert all(int(t.abs().sum()) == 0 for t in d_cache.tensors())  # nothing written


def test_ipc_receive_before_pairing_and_count_mismatch():
    spec = SPECS[0]
    rx = make_receiver("ipc-pull")
    head = KVReady(req_id="r", src_block_ids=SRC, first_token=1, num_prompt_tokens=16, t_start=0.0)
    with pytest.raises(TransferError, match="before pairing"):
        rx.receive(head, [], PagedKVCache(spec, 16), DST)
    with pytest.raises(ValueError, match="kv_connector must be 'auto' or one of"):
        make_receiver("rdma")


def test_no_send_during_profile_run(zmq_link):
    p_sock, d_sock = zmq_link
    spec = SPECS[0]
    cache = PagedKVCache(spec, num_blocks=12)
    shared = SharedCache(spec, num_blocks=12)
    try:
        for sender in (TcpSender(spec), IpcPullSender(spec)):
            with forward_context(is_dummy_or_profile_run=True):
                with pytest.raises(RuntimeError, match="nothing may be sent"):
                    sender.send(p_sock, "r", cache, SRC, first_token=1, num_prompt_tokens=16)
    finally:
        shared.close()
    assert d_sock.poll(200) == 0  # zero frames reached D


def test_shared_segment_mode_name_and_stale_cleanup():
    spec = SPECS[0]
    a, b = SharedCache(spec, 4), SharedCache(spec, 4)
    try:
        assert a.name != b.name and a.name.startswith(f"kvflow-prefill-{Owner.me().tag}-")
        assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
        with pytest.raises(TransferError, match="holds 6144 bytes; the peer cache of 5 blocks needs 7680"):
            map_peer_cache(a.name, spec, 5)
        with pytest.raises(ValueError, match="shm_name must look like"):
            map_peer_cache("../etc/passwd", spec, 4)
        # A segment left by a dead owner is removed; live owners' segments stay.
        dead = subprocess.run([sys.executable, "-c", "from kvflow.segments import Owner; "
                               "print(Owner.me().tag)"], capture_output=True, text=True, check=True)
        stale = f"kvflow-decode-{dead.stdout.strip()}-0123456789ab"
        open(os.path.join(SHM_DIR, stale), "wb").close()
        assert stale in clean_stale()
        assert not os.path.exists(os.path.join(SHM_DIR, stale))
        assert os.path.exists(a.path) and os.path.exists(b.path)
    finally:
        a.close()
        b.close()
    assert not os.path.exists(a.path) and not os.path.exists(b.path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tcp_frames_land_in_a_cuda_cache_byte_exact():
    """tcp on CUDA: P's frames are host memory; D copies each layer to its GPU and scatters
    (once refused: "src is on cpu; the cache is on cuda:0")."""
    from kvflow.connector import make_receiver
    from kvflow.connector.tcp import TcpSender
    from kvflow.connector.messages import decode
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
    src = PagedKVCache(spec, 8, device="cuda")
    for t in src.tensors():
        t.copy_(torch.randn(t.shape, dtype=torch.float32))
    rx = make_receiver("tcp", spec, "cuda")
    dst = rx.make_cache(8)
    for t in dst.tensors():
        t.zero_()

    class Link:
        def send_multipart(self, frames, copy=False):
            self.frames = frames
    link = Link()
    TcpSender(spec, "cuda").send(link, "r", src, [1, 5, 2], first_token=0, num_prompt_tokens=12)
    rx.receive(decode(bytes(link.frames[0])), link.frames[1:], dst, [7, 0, 3])
    for layer in range(spec.num_layers):
        for got, want in zip(dst.layer(layer), src.layer(layer)):
            for s, d in ((1, 7), (5, 0), (2, 3)):
                assert torch.equal(got[d], want[s])
