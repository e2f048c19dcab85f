"""CPU benchmarks of the native extension (``kvflow._native``), each beside its baseline in the
same run:

gather / scatter, ``native`` (C++ thread pool of memcpy) vs ``numba`` (prange), at the
geometry of bench/conftest.py (Llama-3-8B, 64 of 256 blocks, 512 MiB payload;
``KVFLOW_BENCH_QUICK=1``: 8 MiB).

Run: ``python -m pytest bench/test_native_cpu.py --benchmark-only -q`` (bench/README.md).
``KVFLOW_BENCH_OUT=<dir>`` writes the rows to ``<dir>/native_cpu.json``.
"""

from __future__ import annotations

import os

import pytest

from kvflow.bench.schema import make_row
from kvflow.bench.timing import median, time_calls
from kvflow.kernels import available_backends, gather_blocks, scatter_blocks

from conftest import QUICK, ROUNDS, WARMUP, write_rows_if_asked

_ROWS: list[dict] = []

pytestmark = pytest.mark.skipif(available_backends().get("native") != "available",
                                reason=f"native backend: {available_backends().get('native')}")


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if not _ROWS or tr is None or capman is None:
        return
    with capman.global_and_fixture_disabled():  # print past pytest's output capture
        _print_rows(tr)


def _print_rows(tr) -> None:
    tr.write_line("")
    tr.section("kvflow native vs baselines (same run)")
    for r in _ROWS:
        tr.write_line(f"{r['op']:<8} {r['backend']:<7} {r['payload_bytes'] / 2**20:6.0f} MiB "
                      f"{r['time_s'] * 1e3:8.2f} ms {r['gbps']:7.2f} GB/s  ratio {r['ratio']:.2f}"
                      f"  x numba {r['baseline_ratio'] or 0:.2f}")
    write_rows_if_asked(tr, "native_cpu.json", _ROWS)


def _measure(benchmark, fn, rounds: int, warmup: int) -> list[float]:
    """Seconds of each timed call: through pytest-benchmark, or (``--benchmark-disable``) timed
    here the same way, so the figures exist in both modes."""
    if not getattr(benchmark, "disabled", False):
        benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup)
        return list(benchmark.stats.stats.data)
    return time_calls([fn], warmup=warmup, reps=rounds)


@pytest.mark.parametrize("backend", ["numba", "native"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_gather_scatter(benchmark, ops_bench, op, backend):
    ob = ops_bench
    if op == "gather":
        fn = lambda: gather_blocks(ob.cache, ob.ids, ob.buf, backend=backend)  # noqa: E731
    else:  # writes back the blocks gathered from the same ids: the cache stays as it was
        gather_blocks(ob.cache, ob.ids, ob.buf, backend="torch")
        fn = lambda: scatter_blocks(ob.buf, ob.cache, ob.ids, backend=backend)  # noqa: E731
    benchmark.group = f"native-vs-numba {op}"
    times = _measure(benchmark, fn, ROUNDS, WARMUP)
    ceiling_s = median([ob.time_copy() for _ in range(ROUNDS)])  # same run, same payload
    key = f"native_cpu:{op}:numba"
    if backend == "numba":
        ob.baseline_s[key] = median(times)
    row = make_row(ob.env, op=op, backend=backend, spec=ob.spec, tokens=ob.ids.numel() * ob.spec.block_size,
                   blocks=ob.ids.numel(), payload_bytes=ob.payload, times_s=times, ceiling_s=ceiling_s,
                   baseline_s=ob.baseline_s.get(key),
                   config={"quick": QUICK, "cache_blocks": ob.cache.num_blocks, "baseline": "numba",
                           "native_threads": os.environ.get("KVFLOW_NATIVE_THREADS", "0")})
    benchmark.extra_info.update(row)
    _ROWS.append(row)
