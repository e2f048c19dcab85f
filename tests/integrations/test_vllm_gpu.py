"""kvflow's vLLM connector transports between GPU caches laid out as vLLM lays them, P in a
process of its own (CUDA IPC cannot be opened by the process that exported it), D here: the
exact blocks arrive in D's cache on the GPU and nothing else is written. Skipped without CUDA
(and the nixl case without NIXL); runs without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvflow.bench.ports import free_port  # noqa: E402
from kvflow.connector.transport.nixl_agent import nixl_available  # noqa: E402
from kvflow.integrations.vllm.transfer import open_puller  # noqa: E402

from tests.reap import reap, spawn  # noqa: E402
from tests.vllm_peer import cache_on, fill  # noqa: E402

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(),
                                                      reason="NIXL not installed"))


def _puller(d, transport):
    return open_puller(transport, d, timeout_s=60.0, staging_blocks=3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "ipc-push", NIXL])
def test_gpu_pull_from_a_p_process_moves_exact_blocks(transport):
    addr = f"tcp://127.0.0.1:{free_port()}"
    peer = spawn([sys.executable, "-m", "tests.vllm_peer", transport, addr, "cuda"],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []  # NIXL logs to stdout too
        while not lines or lines[-1] not in ("ready", ""):
            lines.append(peer.stdout.readline().strip())
        assert lines[-1] == "ready", lines
        want = cache_on("cuda")
        fill(want)  # P's values, made here from the same seed
        d = cache_on("cuda")
        puller = _puller(d, transport)
        try:
            src, dst = [3, 4, 5, 9], [0, 1, 7, 2]
            assert puller.pull(addr, "r1", src, dst) == 4 * d.spec.bytes_per_block
            puller.pull(addr, "r2", [11], [11])
            torch.cuda.synchronize()
            for tw, td in zip(want.tensors(), d.tensors()):
                assert td.device.type == "cuda"
                assert torch.equal(td[dst], tw[src]) and torch.equal(td[11], tw[11])
                assert not td[[3, 4, 5, 6, 8, 9, 10]].any()  # nothing else written
            if transport == "ipc-push":
                assert puller.chunks == 1  # r2: one block
        finally:
            puller.close()
    finally:
        peer.stdin.close()
        try:
            peer.wait(timeout=30)
        finally:
            reap(peer, grace_s=5.0)
