"""End to end on CPU: P and D with different KV cache specs (issue #19): D with 64-token blocks
fed by P's 16-token blocks (ipc-pull, ipc-push), D in HND fed by P in NHD (tcp, ipc-push), and
D with an fp8 KV cache of another block size or layout than P's fp8 one (ipc-pull, ipc-push: D's
scales in its exported segment). Each is token-identical to colocated serving with the same KV
cache dtype (float32 colocated; fp8 colocated for the fp8 pairs), and /health names what differs.

An fp8 D fed by a float32 P is not in this list: D then holds P's float32 K/V quantized, while
colocated fp8 quantizes every layer's K/V before the next layer attends over it, so the two
differ by construction (a few tokens in, on some prompts); the quantization itself is checked
byte for byte against the torch reference (tests/kernels/test_reblock*.py)."""

from __future__ import annotations

import pytest

from tests.serve_server import Server
from tests.serve.test_serve import MAX_TOKENS, prompt_of

LENGTHS = [1, 17, 64, 150]
FP8 = ("--kv-dtype", "float8_e4m3fn")
SERVERS = {
    "colocated": ("--mode", "colocated"),
    "colocated-fp8": ("--mode", "colocated", *FP8),
    "bs16->64": ("--kv-connector", "ipc-pull", "--decode-block-size", "64"),
    "nhd->hnd": ("--kv-connector", "tcp", "--decode-kv-layout", "HND"),
    "fp8-bs16->64": ("--kv-connector", "ipc-pull", *FP8, "--decode-block-size", "64"),
    "push-bs16->64": ("--kv-connector", "ipc-push", "--decode-block-size", "64"),
    "push-nhd->hnd": ("--kv-connector", "ipc-push", "--decode-kv-layout", "HND"),
    "push-fp8-nhd->hnd": ("--kv-connector", "ipc-push", *FP8, "--decode-kv-layout", "HND"),
}
#: (server, its colocated reference, what /health says differs: field -> [P's, D's])
CASES = [("bs16->64", "colocated", {"block_size": [16, 64]}),
         ("nhd->hnd", "colocated", {"layout": ["NHD", "HND"]}),
         ("fp8-bs16->64", "colocated-fp8", {"block_size": [16, 64]}),
         ("push-bs16->64", "colocated", {"block_size": [16, 64]}),
         ("push-nhd->hnd", "colocated", {"layout": ["NHD", "HND"]}),
         ("push-fp8-nhd->hnd", "colocated-fp8", {"layout": ["NHD", "HND"]})]


@pytest.fixture(scope="module")
def servers():
    s = {}
    try:
        for name, args in SERVERS.items():  # one at a time: 2 cores
            s[name] = Server(*args)
            s[name].wait_healthy()
        yield s
    finally:
        for srv in s.values():
            srv.stop()


@pytest.mark.parametrize("name,ref,differs", CASES, ids=[c[0] for c in CASES])
def test_hetero_disagg_is_token_identical_to_colocated(servers, name, ref, differs):
    srv = servers[name]
    d_spec = srv.instance("decode")["spec"]
    for n in LENGTHS:
        want = servers[ref].complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        got = srv.complete(prompt=prompt_of(n), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"], \
            f"{name}: prompt of {n} tokens"
        assert got.json()["kvflow"]["blocks"] == -(-n // d_spec["block_size"])
        assert got.json()["kvflow"]["kv_connector"] == SERVERS[name][1]
    p, d = srv.instance("prefill"), srv.instance("decode")
    assert p["spec_differs"] == {d["id"]: differs}
    assert d["spec_differs"] == {p["id"]: {k: v[::-1] for k, v in differs.items()}}
