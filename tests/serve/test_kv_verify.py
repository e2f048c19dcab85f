"""``--kv-verify`` end to end on ``python -m kvflow.serve`` (tcp and ipc-pull): a block corrupted
in flight (``KVFLOW_FAULT_KV_CORRUPT``: P flips a byte of the last sent block after taking its
digest) ends the request with HTTP 502 naming the logical block, its blocks come back on P and
D, and the next request is token-identical to a server without ``--kv-verify``; kinds and
transfers it does not check are refused at start, in one line."""

from __future__ import annotations

import pytest

from kvflow.serve.launch.checks import parse_config
from kvflow.serve.launch.startup import StartupError

from tests.serve_server import Server

MARK = "\x0e\x0e\x0e"  # token ids 14,14,14: P corrupts this request's last sent block
ENV = {"KVFLOW_FAULT_KV_CORRUPT": "14,14,14"}
BLOCKS = 40
PROMPT = "the digest of every block goes with it; "  # 40 bytes: 3 blocks of 16 tokens


@pytest.fixture(scope="module")
def servers():
    srv = {"plain": Server("--kv-connector", "ipc-pull", "--num-blocks", str(BLOCKS)),
           **{kind: Server("--kv-connector", kind, "--kv-verify", "--num-blocks", str(BLOCKS),
                           env=ENV) for kind in ("tcp", "ipc-pull")}}
    try:
        for s in srv.values():
            s.wait_healthy()
        yield srv
    finally:
        assert all(s.stop() == 0 for s in srv.values())


def _settled(srv: Server) -> None:
    idle = {"prefill": (BLOCKS, 0), "decode": (BLOCKS, 0)}
    assert srv.wait_settled({"prefill": BLOCKS, "decode": BLOCKS}, timeout=8, idle=True) == idle


def _tokens(srv: Server, prompt: str) -> list[int]:
    r = srv.complete(prompt=prompt, max_tokens=6, ignore_eos=True)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("kind", ["tcp", "ipc-pull"])
def test_a_corrupted_block_fails_the_request_and_frees_it(servers, kind):
    srv = servers[kind]
    want = _tokens(servers["plain"], PROMPT)
    assert _tokens(srv, PROMPT) == want  # verified and clean: the same tokens
    before = srv.requests_total("error")
    r = srv.complete(prompt=MARK + PROMPT, max_tokens=6, ignore_eos=True)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    # 43 prompt tokens: blocks 0..2, the last one corrupted
    assert "kv verify failed: logical block 2 (D block " in msg, msg
    assert "; the request's blocks are freed, not decoded from" in msg, msg
    assert srv.requests_total("error") == before + 1
    _settled(srv)
    assert _tokens(srv, PROMPT) == want  # the next request is still right
    _settled(srv)


@pytest.mark.parametrize("argv, line", [
    (["--kv-verify", "--kv-connector", "ipc-push"],
     "--kv-verify checks the ipc-pull and tcp connectors, not ipc-push (--kv-connector "
     "ipc-push); use --kv-connector ipc-pull or tcp, or leave --kv-verify out"),
    (["--kv-verify", "--layerwise-min-tokens", "256"],
     "--kv-verify does not check layer-by-layer transfers, and prompts from "
     "--layerwise-min-tokens 256 tokens (<= --max-model-len 2048) would move so; set "
     "--layerwise-min-tokens above 2048"),
    (["--kv-verify", "--kv-connector", "tcp", "--decode-block-size", "32"],
     "--kv-verify does not check re-blocked transfers: --decode-block-size 32 differs from "
     "P's 16; leave one of them out"),
    (["--kv-verify", "--mode", "colocated"],
     "--kv-verify has no effect with --mode colocated (one instance prefills and decodes: "
     "no KV moves); leave it out"),
])
def test_unchecked_transfers_are_refused_at_start(argv, line):
    with pytest.raises(StartupError) as info:
        parse_config(argv)
    assert str(info.value).removeprefix("kvflow.serve: error: ") == line
