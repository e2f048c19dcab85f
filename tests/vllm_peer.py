"""P's end of kvflow's vLLM connector in a process of its own (for tests/integrations/test_vllm_gpu.py):
a :class:`KVServer` over a vLLM-laid-out cache filled by :func:`fill`, holding two requests.

``python -m tests.vllm_peer <transport> <addr> <device>``; prints ``ready`` once it serves,
exits when its stdin closes. Transport nixl prints nothing but ``ready`` as well (its agent
metadata travels in the ``NixlHello`` answer)."""

from __future__ import annotations

import sys

import torch

from kvflow.integrations.vllm.transfer import KVServer
from kvflow.vllm_layout import from_vllm, vllm_like

SHAPE = (12, 2, 32, 64)  # blocks, KV heads, block_size, K+V of head_dim 32


def fill(cache, seed: int = 18) -> None:
    """Seeded normal values (generated on the CPU, so every process and device agrees)."""
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.device))


def cache_on(device: str):
    return from_vllm(vllm_like("LBHNC", 2, SHAPE, torch.float32, device=device))


def main(transport: str, addr: str, device: str) -> None:
    p = cache_on(device)
    fill(p)
    server = KVServer(p, addr, transport=transport)
    for req in ("r1", "r2"):
        server.hold(req, 300.0)
    print("ready", flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
