"""Shared fixtures of the CPU op benchmarks (pytest-benchmark).

Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, block 64 tokens, bf16, NHD), a
256-block cache (2 GiB) and 64 random blocks per call (a 4K-token request: 512 MiB payload).
``KVFLOW_BENCH_QUICK=1`` shrinks it to 4 layers, 32 blocks, 8 per call (8 MiB) for CI.
``KVFLOW_BENCH_OUT=<dir>`` also writes the rows as a kvflow result file
(:func:`kvflow.bench.schema.write_results`).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvflow import KVCacheSpec, PagedKVCache, staging_buffer
from kvflow.bench.cases import LLAMA3_8B, make_spec
from kvflow.bench.schema import env_info, write_results
from kvflow.bench.timing import time_calls
from kvflow.kernels import payload_bytes

QUICK = os.environ.get("KVFLOW_BENCH_QUICK", "") not in ("", "0")
ROUNDS, WARMUP = (5, 1) if QUICK else (9, 1)
_ROWS: list[dict] = []


@dataclasses.dataclass
class OpsBench:
    """What every op benchmark shares: one cache, its ids, one staging buffer, the ceiling."""

    spec: KVCacheSpec
    cache: PagedKVCache
    ids: torch.Tensor        # n distinct random blocks (gather reads, scatter writes them)
    copy_dst: torch.Tensor   # n other distinct blocks of the same cache (copy_blocks targets)
    buf: torch.Tensor        # staging buffer [layers, 2, n, *block_shape]
    payload: int             # bytes one call moves
    copy_src_buf: torch.Tensor  # `payload` contiguous bytes, and a destination for the ceiling
    copy_dst_buf: torch.Tensor
    env: dict
    baseline_s: dict         # op -> median seconds of the torch backend (filled lazily)
    rows: list

    def time_copy(self) -> float:
        """Seconds of one ``dst.copy_(src)`` of ``payload`` contiguous bytes (the ceiling)."""
        return time_calls([lambda: self.copy_dst_buf.copy_(self.copy_src_buf)], warmup=0, reps=1)[0]


@pytest.fixture(scope="session")
def ops_bench() -> OpsBench:
    layers, num_blocks, n = (4, 32, 8) if QUICK else (32, 256, 64)
    spec = make_spec(dict(LLAMA3_8B, num_layers=layers), "NHD", torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks)
    torch.arange(cache.buffer.numel() // 8, out=cache.buffer.view(torch.int64))  # distinct bytes
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    payload = payload_bytes(spec, n)
    return OpsBench(spec=spec, cache=cache, ids=perm[:n].clone(), copy_dst=perm[n:2 * n].clone(),
                    buf=staging_buffer(spec, n).zero_(), payload=payload,
                    copy_src_buf=torch.ones(payload, dtype=torch.uint8),
                    copy_dst_buf=torch.zeros(payload, dtype=torch.uint8),
                    env=env_info("cpu"), baseline_s={}, rows=_ROWS)


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    tr = terminalreporter
    tr.section("kvflow op benchmarks (payload GB/s; ratio = vs same-run copy_, x torch = vs torch)")
    tr.write_line(f"{'op':<8}{'backend':<9}{'payload MiB':>12}{'ms':>9}{'GB/s':>8}"
                  f"{'ratio':>7}{'x torch':>9}")
    for r in _ROWS:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        tr.write_line(f"{r['op']:<8}{r['backend']:<9}{r['payload_bytes'] / 2**20:>12.0f}"
                      f"{r['time_s'] * 1e3:>9.1f}{fmt(r['gbps'], '.2f'):>8}"
                      f"{fmt(r['ratio'], '.2f'):>7}{fmt(r['baseline_ratio'], '.2f'):>9}")
    write_rows_if_asked(tr, "ops_cpu.json", _ROWS)


def write_rows_if_asked(tr, name: str, rows: list[dict]) -> None:
    """With ``KVFLOW_BENCH_OUT`` set, write ``rows`` (results schema) to ``$KVFLOW_BENCH_OUT/name``
    and say so on the terminal reporter ``tr``."""
    out = os.environ.get("KVFLOW_BENCH_OUT")
    if out:
        path = write_results(os.path.join(out, name), env_info("cpu"), rows)
        tr.write_line(f"rows written to {path}")
