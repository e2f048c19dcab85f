"""End to end on CPU: P and D on a block-major KV cache (``--kv-layout BM_NHD``: all layers of a
block contiguous, one NIXL descriptor per block) with ``--kv-connector nixl`` over UCX's TCP
transport, prompts moved after the prefill and layer by layer (``--layerwise-min-tokens 64``),
token-identical to colocated serving on the default NHD cache; /health reports the layout. And
a mixed pair, a BM_NHD P feeding an NHD D over ``tcp`` (D re-blocks P's frames, which are packed
per tensor as NHD's: reading them with block-major strides crashed D).
"""

from __future__ import annotations

import os

import pytest

from kvflow.connector.transport.nixl_agent import nixl_available, tcp_tls
from tests.serve.test_serve import MAX_TOKENS, prompt_of
from tests.serve_server import Server

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
LENGTHS = [1, 17, 64, 150]  # 64 and 150: layer by layer


@pytest.fixture(scope="module")
def servers():
    os.environ.setdefault("UCX_TLS", tcp_tls())
    s = {}
    try:
        for name, args in (("colocated", ("--mode", "colocated")),
                           ("bm", ("--kv-connector", "nixl", "--kv-layout", "BM_NHD",
                                   "--layerwise-min-tokens", "64")),
                           ("tcp-bm->nhd", ("--kv-connector", "tcp", "--kv-layout", "BM_NHD",
                                            "--decode-kv-layout", "NHD"))):
            s[name] = Server(*args)  # one at a time: 2 cores
            s[name].wait_healthy()
        yield s
    finally:
        for srv in s.values():
            srv.stop()


def _same_tokens_as_colocated(servers, name: str) -> dict[int, dict]:
    """Each prompt of LENGTHS through server ``name`` and colocated: equal token ids; returns
    each response's ``kvflow`` object by prompt length."""
    kvs = {}
    for n in LENGTHS:
        want = servers["colocated"].complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS,
                                             ignore_eos=True)
        got = servers[name].complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"], \
            f"{name}: prompt of {n} tokens"
        kvs[n] = got.json()["kvflow"]
    return kvs


def test_block_major_nixl_is_token_identical_to_colocated(servers):
    bm = servers["bm"]
    assert bm.instance("prefill")["spec"]["layout"] == "BM_NHD"
    assert bm.instance("decode")["spec"]["layout"] == "BM_NHD"
    for n, kv in _same_tokens_as_colocated(servers, "bm").items():
        assert kv["kv_connector"] == "nixl"
        assert kv["layerwise"] is (n >= 64), kv


def test_a_block_major_p_feeds_an_nhd_d_over_tcp(servers):
    srv = servers["tcp-bm->nhd"]
    p, d = srv.instance("prefill"), srv.instance("decode")
    assert (p["spec"]["layout"], d["spec"]["layout"]) == ("BM_NHD", "NHD")
    assert p["spec_differs"] == {d["id"]: {"layout": ["BM_NHD", "NHD"]}}
    kvs = _same_tokens_as_colocated(servers, "tcp-bm->nhd")
    assert {kv["kv_connector"] for kv in kvs.values()} == {"tcp"}
