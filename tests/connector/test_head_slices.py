"""Head slices through the connector API (issue #19): one P feeds two D caches that each hold
half of its KV heads (a TP=2 decode), over ipc-pull and tcp, with D's own block_size and
layout. Every (token, head) row of each D is checked against P's full cache, block by block;
slots past the prompt keep their bytes."""

from __future__ import annotations

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector import Peer, make_receiver
from kvflow.connector.ipc_pull import IpcPullSender
from kvflow.connector.transport.shm import SharedCache
from kvflow.connector.tcp import TcpSender

from tests.zmq_link import recv, zmq_link  # noqa: F401 (zmq_link: a fixture)

P_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4,
                     dtype=torch.float32, layout="NHD")
D_SPEC = P_SPEC.with_(num_kv_heads=2, block_size=8, layout="HND")
SRC, DST = [7, 2, 9, 0], [5, 1]  # P's table and each D's (13 tokens: 4 blocks of 4, 2 of 8)
T = 13


def _fill(cache: PagedKVCache, seed: int) -> None:
    """Seeded normal float32 values in every slot (finite: NaN bit patterns stay out)."""
    g = torch.Generator().manual_seed(seed)
    words = cache.buffer.view(torch.float32)
    words.copy_(torch.randn(words.numel(), generator=g))


def check_half(p: PagedKVCache, d: PagedKVCache, before: list, head_start: int) -> None:
    """D's heads are P's ``[head_start, head_start + 2)``, token by token; the rest of D's
    blocks (slots 13..15 of D's block 1, every other block) kept their bytes."""
    for i, (src, dst, old) in enumerate(zip(p.tensors(), d.tensors(), before)):
        want = old.clone()  # [blocks, heads, slot, dim] (HND)
        for t in range(T):
            row = src[SRC[t // 4], t % 4, head_start:head_start + 2]  # NHD: [heads, dim]
            want[DST[t // 8], :, t % 8] = row
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), \
            f"tensor {i}, head_start {head_start}"


def receivers(kind: str, p_name: str = ""):
    """The two D's receivers (head_start 0 and 2), paired with P ``p0``."""
    out = []
    for h in (0, 2):
        rx = make_receiver(kind, D_SPEC, backend="numba", head_start=h)
        rx.attach(Peer("p0", P_SPEC, 12, shm_name=p_name))
        out.append(rx)
    return out


def test_ipc_pull_feeds_two_half_head_d_caches(zmq_link):
    p_sock, d_sock = zmq_link
    shared = SharedCache(P_SPEC, num_blocks=12, role="prefill")
    try:
        _fill(shared.cache, 1)
        rxs = receivers("ipc-pull", shared.name)
        rxs[1].copy_kwargs = {"direction": "push"}  # as the CUDA receiver's: ignored here
        for rx, h in zip(rxs, (0, 2)):
            d = PagedKVCache(D_SPEC, num_blocks=6)
            _fill(d, 10 + h)
            before = [t.clone() for t in d.tensors()]
            IpcPullSender(P_SPEC).send(p_sock, "r1", shared.cache, SRC, first_token=1,
                                       num_prompt_tokens=T)
            head, payload = recv(d_sock)
            stats = rx.receive(head, payload, d, DST, "p0")
            check_half(shared.cache, d, before, h)
            assert (stats.blocks, stats.payload_bytes) == (2, 2 * D_SPEC.bytes_per_block)
    finally:
        shared.close()


def test_tcp_feeds_two_half_head_d_caches(zmq_link):
    p_sock, d_sock = zmq_link
    p = PagedKVCache(P_SPEC, num_blocks=12)
    _fill(p, 2)
    TcpSender(P_SPEC, backend="numba").send(p_sock, "r2", p, SRC, first_token=1,
                                            num_prompt_tokens=T)
    head, payload = recv(d_sock)  # one message, scattered by both D's
    for rx, h in zip(receivers("tcp"), (0, 2)):
        d = PagedKVCache(D_SPEC, num_blocks=6)
        _fill(d, 20 + h)
        before = [t.clone() for t in d.tensors()]
        stats = rx.receive(head, payload, d, DST, "p0")
        check_half(p, d, before, h)
        assert (stats.blocks, stats.payload_bytes) == (2, 2 * D_SPEC.bytes_per_block)


def test_head_start_is_refused_where_no_receiver_slices():
    for kind in ("ipc-push", "nixl"):
        with pytest.raises(ValueError) as e:
            make_receiver(kind, D_SPEC, head_start=2)
        assert str(e.value) == (f"head_start: only the ipc-pull and tcp receivers take a head "
                                f"slice, not {kind}")
