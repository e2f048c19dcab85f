"""In-process pieces of the server: the profile run opens no socket and sends nothing, pairing
refuses a spec mismatch naming both values, stop rules, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import zmq

import kvflow.engine
from kvflow import KVCacheSpec
from kvflow.serve.protocol import Register, decode
from kvflow.serve.__main__ import build_parser, parse_args
from kvflow.serve.launch.config import ServeConfig
from kvflow.serve.instance.pairing import check_pairing
from kvflow.serve.instance.sampling import sample_token, stop_reason


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_profile_run_opens_no_channel_and_sends_nothing(monkeypatch, role):
    from kvflow.serve.instance.decode import DecodeInstance
    from kvflow.serve.instance.prefill import PrefillInstance

    counts = {"sockets": 0, "sends": 0}
    during = {}
    real_socket, real_send = zmq.Context.socket, zmq.Socket.send_multipart
    real_send1 = zmq.Socket.send

    def socket(self, *a, **k):
        counts["sockets"] += 1
        return real_socket(self, *a, **k)

    def send_multipart(self, *a, **k):
        counts["sends"] += 1
        return real_send(self, *a, **k)

    def send(self, *a, **k):
        counts["sends"] += 1
        return real_send1(self, *a, **k)

    real_dnb = kvflow.engine.determine_num_blocks

    def profiled(*a, **k):
        before = dict(counts)
        n = real_dnb(*a, **k)
        during.update({key: counts[key] - before[key] for key in counts}, before=before)
        return n

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    monkeypatch.setattr(zmq.Context, "socket", socket)
    monkeypatch.setattr(zmq.Socket, "send_multipart", send_multipart)
    monkeypatch.setattr(zmq.Socket, "send", send)
    monkeypatch.setattr(kvflow.engine, "determine_num_blocks", profiled)
    cfg = ServeConfig(role=role, router_url=f"tcp://127.0.0.1:{port}", kv_connector="tcp",
                      max_model_len=128, memory_budget_mb=16, max_num_batched_tokens=128)
    inst = (PrefillInstance if role == "prefill" else DecodeInstance)(cfg)
    try:
        inst.startup()
        # The profile run ran (no --num-blocks), before any socket existed, and sent nothing.
        assert during["before"] == {"sockets": 0, "sends": 0}
        assert (during["sockets"], during["sends"]) == (0, 0)
        assert inst.num_blocks > 0
        # After it, the instance opened its channels and registered: the counters do count.
        assert counts["sockets"] >= 1 and counts["sends"] >= 1
        assert router.poll(5000)
        ident, frame = router.recv_multipart()
        reg = decode(frame)
        assert isinstance(reg, Register) and reg.num_blocks == inst.num_blocks and reg.role == role
    finally:
        inst.close()
        router.close(0)
        ctx.term()


def test_pairing_refuses_a_spec_mismatch_naming_both_values():
    p = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    assert check_pairing(p, "p-1", p.to_dict(), "d-2") == ""
    d = p.with_(block_size=32, dtype=torch.bfloat16, head_dim=64)
    assert check_pairing(p, "p-1", d.to_dict(), "d-2", "tcp") == (
        "KV cache spec mismatch, pairing refused: head_dim: 32 (p-1) vs 64 (d-2); "
        "block_size: 16 (p-1) vs 32 (d-2); dtype: torch.float32 (p-1) vs torch.bfloat16 (d-2); "
        "P and D may differ only in block_size, layout (NHD/HND) and dtype")
    assert check_pairing(p, "p-1", d.with_(head_dim=32).to_dict(), "d-2", "tcp") == ""
    bad = dict(p.to_dict(), layout="XYZ")
    assert "sent an invalid KV cache spec" in check_pairing(p, "p-1", bad, "d-2")


def test_stop_rules_and_seeded_sampling():
    assert stop_reason(257, 1, 5, 10, 512, 257, False) == "stop"
    assert stop_reason(257, 1, 5, 10, 512, 257, True) == ""
    assert stop_reason(3, 5, 5, 10, 512, 257, False) == "length"
    assert stop_reason(3, 2, 5, 512, 512, 257, False) == "length"
    logits = torch.tensor([0.1, 2.0, 0.3])
    assert sample_token(logits, 0.0, 0, 0) == 1
    draws = [sample_token(torch.zeros(50), 1.0, 7, i) for i in range(6)]
    assert draws == [sample_token(torch.zeros(50), 1.0, 7, i) for i in range(6)]
    assert len(set(draws)) > 1


def test_cli_help_names_every_flag():
    text = build_parser().format_help()
    for flag in ("--host", "--port", "--mode", "--model", "--kv-connector", "--device", "--block-size",
                 "--max-model-len", "--num-blocks", "--role", "--router-url"):
        assert flag in text
    out = subprocess.run([sys.executable, "-m", "kvflow.serve", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--kv-connector {auto,ipc-pull,ipc-push,tcp,nixl}" in out.stdout


@pytest.mark.parametrize("argv, message", [
    (["--role", "decode"], "--role decode needs --router-url tcp://HOST:PORT"),
    (["--block-size", "0"], "--block-size must be positive"),
    (["--block-size", "100000", "--max-model-len", "2048"], "--block-size 100000 exceeds the "
     "longest request (2048 tokens): no request fills one block; use at most 2048"),
    (["--router-url", "http://x"], "--router-url must look like tcp://HOST:PORT, got 'http://x'"),
    (["--kv-connector", "rdma"], "invalid choice: 'rdma'"),
])
def test_cli_rejects_bad_flags(argv, message, capsys):
    """One line on stderr and exit status 1 (issue 14), not argparse's usage and status 2."""
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("kvflow.serve: error: ") and message in err
    assert err.count("\n") == 1
