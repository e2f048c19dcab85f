"""CUDA IPC transfer (kvflow.connector.transport.cuda_ipc), per-role GPU environments, the ipc study
(``python -m kvflow.bench ipc``).

CPU here: export messages, publishing, UUID refusal, bad input, device env, the bench's smoke
mode. On a host with 2 GPUs (the lead's nvidia-h200-x2 run) also: export/import across two
processes with byte equality, UUID remapping under swapped ``CUDA_VISIBLE_DEVICES``, a decode
process that cannot see P's GPU, and served disagg on cuda token-identical to colocated.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.bench.schema import read_results
from kvflow.devices import parent_cards, worker_env_for_cards
from kvflow.serve.launch.procs import instance_env
from kvflow.connector import Peer, TransferError
from kvflow.connector.transport.cuda_ipc import (CudaIpcExport, decode_export, encode_export,
                                                 import_cache, ordinal_of_uuid, publish_export,
                                                 read_export)
from kvflow.connector.ipc_pull import CudaIpcPullReceiver
from kvflow.segments import Owner
from kvflow.segments import segment_path, unlink

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs (run on nvidia-h200-x2)")


def export(**kw) -> CudaIpcExport:
    base = dict(uuid="0badc0de-0000-0000-0000-000000000000", pci_bus_id="00000000:19:00.0",
                handle=b"\x01" * 64, storage_size=8 * SPEC.bytes_per_block, storage_offset=0,
                ref_counter_handle=b"/torch_1_2", ref_counter_offset=0, event_handle=b"\x02" * 64,
                event_sync_required=True, buffer_offset=0, nbytes=8 * SPEC.bytes_per_block,
                num_blocks=8, spec=SPEC.to_dict(), pid=os.getpid() + 1)
    base.update(kw)
    return CudaIpcExport(**base)


def test_export_round_trip_and_rejects():
    e = export()
    assert decode_export(encode_export(e)) == e
    with pytest.raises(TransferError, match="export version 99; expected 2"):
        decode_export(encode_export(export(version=99)))
    with pytest.raises(TransferError, match=r"not a CUDA IPC export \(3 bytes\)"):
        decode_export(b"abc")


def test_publish_is_private_and_removable():
    name = publish_export(export())
    try:
        assert stat.S_IMODE(os.stat(segment_path(name)).st_mode) == 0o600
        assert name.startswith(f"kvflow-cudaipc-{Owner.me().tag}-")
        assert read_export(name) == export()
    finally:
        assert unlink(name)
    with pytest.raises(TransferError, match="does not exist"):
        read_export(name)


def test_import_refuses_before_opening_anything():
    with pytest.raises(TransferError, match="block_size: 16 vs 32"):
        import_cache(export(spec=SPEC.with_(block_size=32).to_dict()), SPEC)
    with pytest.raises(TransferError, match="has 8 blocks; pairing said 9"):
        import_cache(export(), SPEC, 9)
    with pytest.raises(TransferError, match="inconsistent"):
        import_cache(export(nbytes=7), SPEC)
    with pytest.raises(TransferError, match="made by this process"):
        import_cache(export(pid=os.getpid()), SPEC)
    # a GPU this process cannot see: an error naming it, never a fallback ordinal
    with pytest.raises(TransferError, match="on GPU 0badc0de-0000-0000-0000-000000000000, which "
                                            "this process cannot see"):
        import_cache(export(), SPEC)
    with pytest.raises(TransferError, match="CUDA_VISIBLE_DEVICES"):
        ordinal_of_uuid("GPU-0BADC0DE-0000-0000-0000-000000000000")


def test_export_needs_one_cuda_buffer():
    from kvflow.connector.transport.cuda_ipc import export_cache
    with pytest.raises(TypeError, match="over one CUDA buffer, got one on cpu"):
        export_cache(PagedKVCache(SPEC, 2))


def test_receiver_bad_input():
    with pytest.raises(ValueError, match="direction must be 'pull' or 'push', got 'sideways'"):
        CudaIpcPullReceiver(direction="sideways")
    with pytest.raises(TransferError, match="before pairing"):
        CudaIpcPullReceiver().receive(None, [], PagedKVCache(SPEC, 2), [0])


def test_parent_cards_and_role_env(monkeypatch):
    assert parent_cards("cuda", [1, 0], base={}) == ["1", "0"]
    assert parent_cards("cuda", 1, base={"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == ["GPU-bb"]
    with pytest.raises(ValueError, match="device_index 2 is not visible: CUDA_VISIBLE_DEVICES='4,5'"):
        parent_cards("cuda", 2, base={"CUDA_VISIBLE_DEVICES": "4,5"})
    with pytest.raises(ValueError, match="device_kind must be one of"):
        parent_cards("cpu", 0)
    assert worker_env_for_cards("cuda", ["5", "3", "5"], base={})["CUDA_VISIBLE_DEVICES"] == "5,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    env = {r: instance_env(r, "cuda", 0, 1)["CUDA_VISIBLE_DEVICES"]
           for r in ("prefill", "decode", "colocated")}
    assert env == {"prefill": "6,7", "decode": "7,6", "colocated": "6"}  # own GPU first, peer's too
    assert instance_env("decode", "cuda", 1, 1)["CUDA_VISIBLE_DEVICES"] == "7"
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    cpu = instance_env("decode", "cpu", 0, 1)  # the inherited environment + OpenMP sleeping
    assert cpu["OMP_WAIT_POLICY"] == "PASSIVE" and cpu["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # one the user set wins
    assert instance_env("prefill", "cpu", 0, 1)["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # so does another way to choose the wait
    assert "OMP_WAIT_POLICY" not in instance_env("prefill", "cpu", 0, 1)


def test_serve_flags():
    from kvflow.serve.__main__ import parse_args
    from kvflow.serve.launch.server import instance_config
    a = parse_args(["--device", "cuda", "--dtype", "bfloat16", "--decode-device", "3"])
    assert (a.prefill_device, a.decode_device) == (0, 3)
    assert instance_config(a, "decode", "tcp://127.0.0.1:1").dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse_args(["--prefill-device", "-1"])


def test_bench_smoke(tmp_path, capsys):
    from kvflow.bench.__main__ import main
    assert main(["ipc", "--quick", "--tokens", "32", "--reps", "1", "--out-dir", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("ipc-cpu-*.json")
    rows = read_results(out)["rows"]
    names = [r["backend"] for r in rows]
    assert names[0] == "kvflow_pull" and "per_layer_torch" in names and names[-1] == "per_block_torch"
    assert all(r["op"] == "ipc_p2d" and r["tokens"] == 32 and r["blocks"] == 2 for r in rows)
    assert rows[0]["payload_bytes"] == 2 * 2 * 2 * 16 * 2 * 16 * 4  # blocks x layers x K,V x block
    assert rows[-1]["baseline_ratio"] == pytest.approx(1.0)
    text = capsys.readouterr().out
    assert "cross-process CUDA IPC variant skipped (needs 2 GPUs)" in text
    assert "end-to-end serve on 2 GPUs skipped (needs 2 GPUs)" in text


# ---- 2 GPUs -------------------------------------------------------------------------------
_P_CHILD = """
import sys, torch
from kvflow.bench.cases import fill_pattern
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector.transport.cuda_ipc import export_cache, publish_export
from kvflow.segments import unlink
spec = KVCacheSpec(**{spec!r})
cache = PagedKVCache(spec, 64, device="cuda:0")
fill_pattern(cache); torch.cuda.synchronize()
name = publish_export(export_cache(cache))
print(name, torch.cuda.get_device_properties(0).uuid, flush=True)
sys.stdin.readline(); unlink(name)
"""

_D_CHILD = """
import sys, torch
from kvflow.bench.cases import pattern
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_blocks
from kvflow.connector.transport.cuda_ipc import enable_peer_access, import_cache, read_export
spec = KVCacheSpec(**{spec!r})
try:
    peer = import_cache(read_export({name!r}), spec, 64)
except Exception as exc:
    print("ERROR", exc, flush=True); sys.exit(0)
d = PagedKVCache(spec, 64, device="cuda:0")
enable_peer_access(d.device, peer.device)
src, dst = torch.tensor([5, 63, 0]), torch.tensor([1, 2, 40])
copy_blocks(peer, d, src, dst, backend="triton", direction="push")  # see cuda_ipc's docstring
torch.cuda.synchronize(peer.device); torch.cuda.synchronize(d.device)
ok = all(torch.equal(t[dst.cuda()].reshape(3, -1).view(torch.int32), pattern(j, src.cuda(), spec, 64))
         for j, t in enumerate(d.tensors()))
print("OK" if ok else "MISMATCH", peer.device.index, flush=True)
"""


def _spawn(code: str, visible: str, **fmt) -> subprocess.Popen:
    src = code.format(spec=SPEC.to_dict(), **fmt)
    return subprocess.Popen([sys.executable, "-c", src], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible))


@TWO_GPUS
@pytest.mark.timeout(180)
def test_two_processes_uuid_remapping_and_refusal():
    """P sees physical GPU 1 as cuda:0; D with CUDA_VISIBLE_DEVICES=0,1 finds it as cuda:1 by UUID
    and copies exact bytes; D with CUDA_VISIBLE_DEVICES=0 cannot see it: a clear error."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    cards = vis.split(",")[:2] if vis else ["0", "1"]
    p = _spawn(_P_CHILD, cards[1])
    try:
        name, uuid = p.stdout.readline().split()
        ok = subprocess.run([sys.executable, "-c", _D_CHILD.format(
            spec=SPEC.to_dict(), name=name)], capture_output=True,
            text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(cards)), timeout=120)
        assert ok.stdout.split() == ["OK", "1"], ok.stdout + ok.stderr
        swapped = subprocess.run([sys.executable, "-c", _D_CHILD.format(
            spec=SPEC.to_dict(), name=name)], capture_output=True,
            text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=f"{cards[1]},{cards[0]}"), timeout=120)
        assert swapped.stdout.split() == ["OK", "0"], swapped.stdout + swapped.stderr
        blind = subprocess.run([sys.executable, "-c", _D_CHILD.format(
            spec=SPEC.to_dict(), name=name)], capture_output=True,
            text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=cards[0]), timeout=120)
        assert "which this process cannot see" in blind.stdout, blind.stdout + blind.stderr
        assert uuid.lower().removeprefix("gpu-") in blind.stdout
    finally:
        p.stdin.close()
        p.wait(30)


_D_EXPORTER = """
import sys, torch
from kvflow.bench.cases import pattern
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector.transport.cuda_ipc import export_cache, publish_export
from kvflow.segments import unlink
spec = KVCacheSpec(**{spec!r})
cache = PagedKVCache(spec, 64, device="cuda:0")
cache.buffer.zero_(); torch.cuda.synchronize()
name = publish_export(export_cache(cache))
print(name, flush=True)
sys.stdin.readline(); torch.cuda.synchronize()
dst = torch.tensor([1, 2, 40], device="cuda:0")
ok = all(torch.equal(t[dst].reshape(3, -1).view(torch.int32), pattern(j, torch.tensor([5, 63, 0], device="cuda:0"), spec, 64))
         for j, t in enumerate(cache.tensors()))
rest = all(int(t[[i for i in range(64) if i not in (1, 2, 40)]].view(torch.uint8).count_nonzero()) == 0
           for t in cache.tensors())
print("OK" if ok and rest else "MISMATCH", flush=True); unlink(name)
"""

_P_PUSHER = """
import sys, torch
from kvflow.bench.cases import fill_pattern
from kvflow import KVCacheSpec, PagedKVCache
from kvflow.kernels import copy_blocks
from kvflow.connector.transport.shm import map_decode_cache
spec = KVCacheSpec(**{spec!r})
mine = torch.device("cuda", {mine})
p = PagedKVCache(spec, 64, device=mine)
fill_pattern(p)
d = map_decode_cache({name!r}, spec, 64, mine)
assert d.device == mine, d.device
copy_blocks(p, d, torch.tensor([5, 63, 0]), torch.tensor([1, 2, 40]), backend="triton")
torch.cuda.synchronize(mine)
print("PUSHED", flush=True)
"""


@TWO_GPUS
@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["same", "swapped"])
def test_prefill_pushes_into_decode_export_on_its_own_gpu(order):
    """D (physical GPU 1, its cuda:0) exports its cache; P sees both GPUs (in either order),
    maps D's export into its own GPU's context and writes three blocks with a kernel on its
    own GPU: D sees exactly those bytes there and zeros elsewhere."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    cards = vis.split(",")[:2] if vis else ["0", "1"]
    d = _spawn(_D_EXPORTER, cards[1])
    try:
        name = d.stdout.readline().strip()
        p_vis, mine = (",".join(cards), 0) if order == "same" else (f"{cards[1]},{cards[0]}", 1)
        r = subprocess.run([sys.executable, "-c", _P_PUSHER.format(
            spec=SPEC.to_dict(), name=name, mine=mine)],
            capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=p_vis),
            timeout=120)
        assert r.stdout.split() == ["PUSHED"], r.stdout + r.stderr
        d.stdin.write("check\n")
        d.stdin.flush()
        assert d.stdout.readline().split() == ["OK"]
    finally:
        d.stdin.close()
        d.wait(30)


@pytest.mark.parametrize("gpus", [2, 1])
@pytest.mark.timeout(900)
def test_served_disagg_cuda_token_identical_to_colocated(gpus):
    """P and D on two GPUs, or sharing one (``--decode-device 0``): every connector's tokens
    equal colocated's."""
    import asyncio

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")

    import httpx

    from kvflow.bench.server import started_server
    prompts = [[(7 * i + 3 * k) % 200 + 32 for k in range(n)] for i, n in enumerate((5, 70, 300))]

    async def run(url):
        async with httpx.AsyncClient() as c:
            out = []
            for p in prompts:
                r = await c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 12,
                                                                 "ignore_eos": True}, timeout=120)
                assert r.status_code == 200, r.text
                out.append((r.json()["choices"][0]["token_ids"], r.json()["kvflow"]))
            return out

    got = {}
    configs = {"colocated": ("colocated", ""), "push": ("disagg", "--layerwise-min-tokens 0"),  # auto: push on cuda
               "push-request": ("disagg", "--layerwise-min-tokens 100000"),
               "pull-request": ("disagg", "--kv-connector ipc-pull --layerwise-min-tokens 100000")}
    for name, (mode, extra) in configs.items():
        where = "--decode-device 0" if gpus == 1 and mode == "disagg" else ""
        with started_server(mode, f"--device cuda --num-blocks 256 {where} {extra}",
                            timeout=240) as url:
            got[name] = asyncio.run(run(url))
    want = [t for t, _ in got["colocated"]]
    for name in ("push", "push-request", "pull-request"):
        assert [t for t, _ in got[name]] == want, name
        assert [kv["payload_bytes"] for _, kv in got[name]] == [
            -(-len(p) // 16) * 4 * 2 * 16 * 2 * 32 * 4 for p in prompts]  # tiny: 4 layers, fp32
        assert {(kv["kv_connector"], kv["layerwise"]) for _, kv in got[name]} == {
            ("ipc-pull" if name.startswith("pull") else "ipc-push",
             not name.endswith("request"))}, name
    assert all(len(t) == 12 for t in want)


def test_receiver_keeps_one_mapping_per_prefill_and_reads_the_senders(monkeypatch):
    """The CUDA receiver's bookkeeping, on CPU caches (mapping and stream sync stubbed): two P's
    paired, each KVReady / KVLayer is read from the cache of the P that sent it; a detached P
    is refused by name."""
    import kvflow.connector.transport.cuda_ipc as ci
    from kvflow.connector.ipc_pull import CudaIpcPullReceiver
    from kvflow.connector.messages import KVLayer, KVReady

    def filled(v):
        c = PagedKVCache(SPEC, 8)
        c.buffer.fill_(v)
        return c
    caches = {"exp-a": filled(1), "exp-b": filled(2)}
    monkeypatch.setattr(ci, "read_export", lambda name: name)
    monkeypatch.setattr(ci, "import_cache", lambda exp, spec, n: caches[exp])
    monkeypatch.setattr(ci, "enable_peer_access", lambda a, b: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev=None: type("S", (), {"synchronize": lambda self: None})())
    rx = CudaIpcPullReceiver(backend="torch", direction="pull")
    rx.attach(Peer("p1", SPEC, 8, shm_name="exp-a"))
    rx.attach(Peer("p2", SPEC, 8, shm_name="exp-b"))
    d = PagedKVCache(SPEC, 8)
    ready = KVReady(req_id="r", src_block_ids=[3], first_token=0, num_prompt_tokens=4, t_start=0.0)
    assert rx.receive(ready, [], d, [5], "p1").blocks == 1
    part = KVLayer(req_id="s", reply_to="p2", layer_start=0, layer_stop=SPEC.num_layers,
                   block_offset=0, num_blocks=1, src_block_ids=[4], num_prompt_tokens=4)
    last = KVLayer(req_id="s", reply_to="p2", last=True, first_token=0, num_prompt_tokens=4)
    assert rx.receive(part, [], d, [6], "p2") is None and rx.receive(last, [], d, [6], "p2").blocks == 1
    for t in d.tensors():
        assert bool((t[5].view(torch.uint8) == 1).all()) and bool((t[6].view(torch.uint8) == 2).all())
    rx.detach("p1")
    with pytest.raises(TransferError) as e:
        rx.receive(ready, [], d, [5], "p1")
    assert str(e.value) == ("ipc transfer from 'p1', which is not paired with this decode "
                            "instance (paired: ['p2'])")
