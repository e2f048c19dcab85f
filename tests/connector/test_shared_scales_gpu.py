"""fp8 per-block scales through CUDA IPC, two processes on one GPU (issue #19): an exported
fp8 ``block_head`` cache keeps its scales in the exported allocation, so

(a) ipc-push: P (a child process) maps D's export and ``copy_sequence`` an fp32 prompt into it;
    D then holds exactly the blocks and the per-block scales of the torch reference;
(b) ipc-pull: D maps P's export (non-1.0 scales, P a child process) and copies into an fp32
    cache (dequantized with P's scales) and, between equal specs, into an fp8 block_head cache
    (blocks and their scales moved), each exactly as the torch reference / by hand.

CUDA cannot open an IPC handle in the process that made it, hence the child. Both sides fill
their caches with the same seeded values (:func:`filled`). Skipped without CUDA; about 30 s on
one H200 (Triton compiles in both processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache
from kvflow.connector.transport.shm import export_new_cache
from kvflow.kernels import copy_blocks, copy_sequence
from kvflow.segments import unlink

from tests.reblock_cases import finite_cache

DEVICE = "cuda:0"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]

FP32 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4,
                   dtype=torch.float32, layout="NHD")
BH = FP32.with_(dtype=torch.float8_e4m3fn, scales="block_head")
D_BH = BH.with_(block_size=8, layout="HND")      # ipc-push: D's spec
D_FP32 = FP32.with_(block_size=8, layout="HND")  # ipc-pull: D's spec
SRC, DST, T = [7, 2, 9, 0], [5, 1], 13           # 13 tokens: P's 4 blocks of 4, D's 2 of 8
NB = 12


def filled(spec: KVCacheSpec, seed: int) -> PagedKVCache:
    """A CPU cache of seeded finite values and random fp8 scales, none 1.0 (the same in every
    process)."""
    return finite_cache(spec, NB, seed=seed)


def load_(cache: PagedKVCache, src: PagedKVCache) -> PagedKVCache:
    """Copy ``src``'s blocks and scales into ``cache`` (any device); returns ``cache``."""
    for d, s in zip(cache.tensors(), src.tensors()):
        d.copy_(s)
    if src.scales is not None:
        cache.scales.copy_(src.scales)
    return cache


def same(got: PagedKVCache, want: PagedKVCache) -> None:
    """Bit-for-bit equal blocks and scales (``got`` on any device, ``want`` on the CPU)."""
    for j, (x, y) in enumerate(zip(got.tensors(), want.tensors())):
        assert torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)), f"tensor {j}"
    if want.scales is not None:
        assert torch.equal(got.scales.cpu().view(torch.int32), want.scales.view(torch.int32))


def map_prefill(name: str, spec: KVCacheSpec, device: torch.device) -> PagedKVCache:
    """D's read-side mapping of P's export (CUDA IPC; a read-only segment on CPU)."""
    if device.type == "cuda":
        from kvflow.connector.transport.cuda_ipc import import_cache, read_export
        return import_cache(read_export(name), spec, NB)
    from kvflow.connector.transport.shm import map_peer_cache
    return map_peer_cache(name, spec, NB)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CHILD = """
import sys, traceback
try:
    import torch
    from tests.connector.test_shared_scales_gpu import *
    dev = torch.device({device!r})
{body}
except BaseException:
    print("ERROR in the {who} child:", traceback.format_exc().replace(chr(10), " | "), flush=True)
    sys.exit(1)
"""

_P_PUSHER = """
    from kvflow.connector.transport.shm import map_decode_cache
    d = map_decode_cache({name!r}, D_BH, NB, dev)
    p = load_(PagedKVCache(FP32, NB, device=dev), filled(FP32, 1))
    copy_sequence(p, d, torch.tensor(SRC), torch.tensor(DST), num_tokens=T)
    sync(dev)
    print("PUSHED", flush=True)
"""

_P_EXPORTER = """
    p, name = export_new_cache(BH, NB, dev, "prefill")
    load_(p, filled(BH, 5))
    sync(dev)
    print(name, flush=True)
    sys.stdin.readline()
    unlink(name)
"""


def _child(body: str, who: str, **fmt) -> subprocess.Popen:
    code = _CHILD.format(device=DEVICE, who=who, body=body.format(**fmt))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.timeout(120)
def test_push_into_exported_fp8_block_head_cache():
    dev = torch.device(DEVICE)
    d, name = export_new_cache(D_BH, NB, dev, "decode")
    try:
        load_(d, filled(D_BH, 3))  # D's other blocks and slots must keep their values
        sync(dev)
        p = _child(_P_PUSHER, "P (ipc-push)", name=name)
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0 and out.split() == ["PUSHED"], out + err
        want = filled(D_BH, 3)
        copy_sequence(filled(FP32, 1), want, torch.tensor(SRC), torch.tensor(DST), num_tokens=T,
                      backend="torch")
        assert not torch.equal(want.scales[:, DST], filled(D_BH, 3).scales[:, DST])
        same(d, want)  # D's own cache object: P's blocks and the scales P's copy computed
    finally:
        unlink(name)


@pytest.mark.timeout(120)
def test_pull_from_exported_fp8_block_head_cache():
    dev = torch.device(DEVICE)
    p = _child(_P_EXPORTER, "P (ipc-pull exporter)")
    try:
        name = p.stdout.readline().strip()
        assert name.startswith("kvflow-"), name + p.stdout.read() + p.stderr.read()
        peer = map_prefill(name, BH, dev)
        src = filled(BH, 5)
        assert not torch.equal(src.scales, torch.ones_like(src.scales))
        same(peer, src)  # P's blocks and its non-1.0 scales, seen through the mapping
        d = load_(PagedKVCache(D_FP32, NB, device=dev), filled(D_FP32, 6))
        copy_sequence(peer, d, torch.tensor(SRC), torch.tensor(DST), num_tokens=T)
        want = filled(D_FP32, 6)
        copy_sequence(src, want, torch.tensor(SRC), torch.tensor(DST), num_tokens=T,
                      backend="torch")
        sync(dev)
        same(d, want)  # value = fp8 * P's scale, exactly
        e = load_(PagedKVCache(BH, NB, device=dev), filled(BH, 7))
        s_ids, d_ids = [7, 2, -1, 0], [1, 5, 3, 11]
        copy_blocks(peer, e, torch.tensor(s_ids), torch.tensor(d_ids))  # equal specs
        want = filled(BH, 7)
        for j in range(BH.num_tensors):
            for s, t in zip(s_ids, d_ids):
                if s >= 0:
                    want.tensors()[j][t] = src.tensors()[j][s]
                    want.scales[j, t] = src.scales[j, s]
        sync(dev)
        same(e, want)  # the blocks and their per-block scales
        del peer
        sync(dev)
    finally:
        out, err = p.communicate("done\n", timeout=60)
        assert p.returncode == 0, out + err
