"""The three transports of kvflow's vLLM connector without vLLM: P's :class:`KVServer` and D's
:class:`KVPuller` (tcp) / :class:`NixlPuller` (nixl, UCX over TCP) / :class:`IpcPuller`
(ipc-push, a shared-memory staging cache) between two caches laid out as vLLM lays them (``vllm_like``),
in one process. Exact bytes moved, exact refusals, a dead P's
agent forgotten, and the connector's settings checks."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvflow.bench.ports import free_port  # noqa: E402
from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls  # noqa: E402
from kvflow.integrations.vllm.config import TRANSPORTS, check_config  # noqa: E402
from kvflow.integrations.vllm.ipc_push import IpcPuller, staging_blocks_for  # noqa: E402
from kvflow.integrations.vllm.link import PullError  # noqa: E402
from kvflow.integrations.vllm.transfer import KVPuller, KVServer, open_puller  # noqa: E402
from kvflow.vllm_layout import from_vllm, vllm_like  # noqa: E402


SHAPE = (12, 2, 32, 64)  # blocks, KV heads, block_size, K+V of head_dim 32
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(),
                                                      reason="NIXL not installed"))


def _caches():
    p = from_vllm(vllm_like("LBHNC", 2, SHAPE, torch.float32))
    d = from_vllm(vllm_like("LBHNC", 2, SHAPE, torch.float32))
    for t in p.tensors():
        t.copy_(torch.randn(t.shape))
    return p, d


def _server(p, transport, **kw):
    return KVServer(p, f"tcp://127.0.0.1:{free_port()}", transport=transport, **kw)


def _puller(d, transport, timeout_s=5.0, staging_blocks=3):
    # ipc-push, 3 staging blocks: a pull of 4 blocks moves in two chunks
    return open_puller(transport, d, timeout_s=timeout_s, staging_blocks=staging_blocks)


@contextlib.contextmanager
def _pair(p_transport, d_transport=None, hold_wait_s=5.0):
    """``(p, d, server, puller)``: P's server of ``p_transport`` and D's puller of
    ``d_transport`` (default the same) over two fresh caches; all closed on exit."""
    p, d = _caches()
    server = _server(p, p_transport, hold_wait_s=hold_wait_s)
    puller = _puller(d, d_transport or p_transport)
    try:
        yield p, d, server, puller
    finally:
        puller.close()
        server.close()


@pytest.fixture(autouse=True)
def _ucx_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", tcp_tls())  # the network path, not shared memory


@pytest.mark.parametrize("transport", ["tcp", NIXL, "ipc-push"])
def test_pull_moves_exact_blocks_and_frees_p(transport):
    with _pair(transport) as (p, d, server, puller):
        src, dst = [3, 4, 5, 9], [0, 1, 7, 2]
        server.hold("r1", 30.0)
        assert puller.pull(server.addr, "r1", src, dst) == 4 * p.spec.bytes_per_block == 131072
        for tp, td in zip(p.tensors(), d.tensors()):
            assert torch.equal(td[dst], tp[src])
            assert not td[[3, 4, 5, 6, 8, 9, 10, 11]].any()  # nothing else written
        deadline = time.monotonic() + 5  # nixl, ipc-push: D's Release reaches P's thread later
        while not (done := server.take_done()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == {"r1"}
        if transport == "nixl":
            assert puller.last_runs == 3  # (3,0)x2, (5,7), (9,2)
            # the second pull reuses P's prepared list: one peer, one agent
            server.hold("r2", 30.0)
            puller.pull(server.addr, "r2", [0], [11])
            assert torch.equal(d.tensors()[1][11], p.tensors()[1][0])
            assert list(puller.peers) == [server.addr] == list(puller.agent.peers)
        if transport == "ipc-push":
            assert puller.chunks == 2  # 3 + 1 blocks through 3 staging blocks
            assert list(server.staging) == [puller.name]  # mapped once


@pytest.mark.parametrize("transport", ["tcp", NIXL, "ipc-push"])
def test_pull_of_a_request_p_does_not_hold_is_refused(transport):
    with _pair(transport, hold_wait_s=0.2) as (p, d, server, puller):
        with pytest.raises(PullError, match=r"^request r9: P refused the pull: P holds no "
                                            r"blocks for request 'r9' \(freed or never held\)$"):
            puller.pull(server.addr, "r9", [1], [1])
        assert not any(t.any() for t in d.tensors())


@pytest.mark.parametrize("transport, asked", [
    pytest.param("nixl", r"refused the NIXL hello: ", marks=NIXL.marks),
    ("ipc-push", r"^request r1: P refused the pull: ")])
def test_d_against_a_tcp_p_names_the_setting(transport, asked):
    with _pair("tcp", transport) as (p, d, server, puller):
        server.hold("r1", 30.0)
        with pytest.raises(PullError, match=asked + r"P at tcp://127.0.0.1:\d+ has transport "
                                            r"'tcp'; set kv_connector_extra_config transport "
                                            rf"'{transport}' on P too$"):
            puller.pull(server.addr, "r1", [1], [1])
        assert not any(t.any() for t in d.tensors())


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_nixl_dead_p_times_out_and_its_agent_is_removed():
    p, d = _caches()
    server = _server(p, "nixl")
    puller = _puller(d, "nixl", timeout_s=0.5)
    try:
        server.hold("r1", 30.0)
        puller.pull(server.addr, "r1", [1], [1])
        assert list(puller.agent.peers) == [server.addr]
        server.close()  # P dies
        with pytest.raises(PullError, match=r"^request r2: no answer from P at tcp://127.0.0.1:"
                                            r"\d+ within 0.5 s$"):
            puller.pull(server.addr, "r2", [2], [2])
        assert puller.peers == {} and puller.agent.peers == {}
    finally:
        puller.close()


@pytest.mark.parametrize("extra, message", [
    ({"transport": "ucx"}, "kv_connector_extra_config transport must be one of ('tcp', 'nixl', "
                           "'ipc-push'), got 'ucx'"),
    ({"transport": "ipc-pull"}, "transport must be one of ('tcp', 'nixl', 'ipc-push'), got "
                                "'ipc-pull'"),
    ({"transport": "ipc"}, "kv_connector_extra_config transport 'ipc' is now called "
                           "'ipc-push' (P writes into D's staging cache, as serving's ipc-push "
                           "kind); set transport 'ipc-push'"),
    ({"staging_mb": 0}, "staging_mb must be > 0 MiB, got 0"),
    ({"timeout_s": "abc"}, "kv_connector_extra_config timeout_s must be a number, got 'abc'"),
    ({"backend": "bogus"}, "kv_connector_extra_config backend must be 'auto' or one of "),
    ({"timeout_s": 0}, "timeout_s must be > 0 seconds, got 0"),
    ({"lease_s": 10, "timeout_s": 30}, "lease_s (10 s) must be larger than timeout_s (30 s)"),
    ({"kvflow_prot": 1}, "unknown keys ['kvflow_prot']"),
])
def test_bad_settings_are_refused_by_name(extra, message):
    with pytest.raises(ValueError) as exc:
        check_config(extra)
    assert message in str(exc.value)
    assert check_config({"transport": "nixl"})["transport"] == "nixl"
    assert check_config({"transport": "ipc-push"})["transport"] == "ipc-push"
    assert check_config({})["transport"] == "tcp"


def test_transport_names_are_the_serving_kinds_names():
    from kvflow.connector import CONNECTORS
    assert TRANSPORTS == ("tcp", "nixl", "ipc-push")
    assert set(TRANSPORTS) <= set(CONNECTORS)
    pullers = [open_puller(t, _caches()[1], staging_blocks=1) for t in ("tcp", "ipc-push")]
    assert [type(p) for p in pullers] == [KVPuller, IpcPuller]
    for p in pullers:
        p.close()
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config transport 'ipc' is now "
                                         r"called 'ipc-push' "):
        KVServer(_caches()[0], "tcp://127.0.0.1:1", transport="ipc")
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config transport 'ipc' is now "):
        open_puller("ipc", _caches()[1])



@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_nixl_p_restarted_on_the_same_address_is_met_anew():
    p, d = _caches()
    server = _server(p, "nixl")
    puller = _puller(d, "nixl")
    try:
        server.hold("r1", 30.0)
        puller.pull(server.addr, "r1", [1], [1])
        first = puller.peers[server.addr].agent
        server.close()
        p2, _ = _caches()  # the new P: another agent, another cache, the same address
        server = KVServer(p2, server.addr, transport="nixl")
        server.hold("r2", 30.0)
        assert puller.pull(server.addr, "r2", [2], [3]) == p.spec.bytes_per_block
        assert puller.peers[server.addr].agent == server.agent.name != first
        assert list(puller.agent.peers) == [server.addr]
        for tp, td in zip(p2.tensors(), d.tensors()):
            assert torch.equal(td[3], tp[2])
    finally:
        puller.close()
        server.close()


def test_ipc_staging_of_a_gone_d_is_refused_and_unlinked_on_close():
    from kvflow.segments import segment_path
    with _pair("ipc-push") as (p, d, server, puller):
        path = segment_path(puller.name)
        assert os.path.exists(path)
        os.unlink(path)  # D's staging segment vanished
        server.hold("r1", 30.0)
        with pytest.raises(PullError, match=rf"^request r1: P refused the pull: cannot map D's "
                                            rf"staging cache '{puller.name}': shared-memory "
                                            rf"segment '{puller.name}' does not exist$"):
            puller.pull(server.addr, "r1", [1], [1])
    puller2 = _puller(d, "ipc-push")
    puller2.close()
    assert not os.path.exists(segment_path(puller2.name))


def test_ipc_staging_size_follows_the_longest_prompt_and_the_budget():
    spec = _caches()[0].spec  # 2 layers x 64 KiB... per block: 2 * 2*32*64*4 bytes
    assert spec.bytes_per_block == 32768
    assert staging_blocks_for(spec, 32) == 32            # max_model_len 1024 / block_size 32
    assert staging_blocks_for(spec, 10**6, 1 << 20) == 32  # 1 MiB budget
    assert staging_blocks_for(spec, 10**6, 1000) == 1      # at least one block
    with pytest.raises(ValueError, match=r"^staging_blocks must be an int >= 1, got 0$"):
        IpcPuller(_caches()[1], staging_blocks=0)


@pytest.mark.parametrize("transport", ["tcp", "ipc-push"])
def test_pull_of_blocks_that_are_not_the_requests_is_refused(transport):
    """P serves a held request's own blocks only: ids of another request's blocks (in range,
    the request held) are refused, and D's cache is not written."""
    with _pair(transport) as (p, d, server, puller):
        server.hold("r1", 30.0, [1, 5])
        with pytest.raises(PullError, match=r"^request r1: P refused the pull: block ids \[3, 4\] "
                                            r"are not blocks of request 'r1' \(P holds \[1, 5\]\)$"):
            puller.pull(server.addr, "r1", [1, 3, 4], [0, 1, 2])
        assert not any(t.any() for t in d.tensors())
        server.hold("r2", 30.0, [1, 5])  # (ipc-push's puller releases r1 after the refusal)
        assert puller.pull(server.addr, "r2", [5], [2]) == p.spec.bytes_per_block  # a suffix
        assert torch.equal(d.tensors()[0][2], p.tensors()[0][5])

