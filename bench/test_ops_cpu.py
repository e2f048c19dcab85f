"""CPU benchmarks of gather_blocks / scatter_blocks / copy_blocks, torch vs numba, against the
same-run ``copy_`` ceiling (see bench/conftest.py for the geometry and bench/README.md).

The ceiling of each op row is the median of a ``copy_`` timed before every round of that op
(interleaved, so both see the same machine load). Each row (``benchmark.extra_info``) has the
fields of :func:`kvflow.bench.schema.make_row`: payload bytes, GB/s of payload, ``ratio`` to the
ceiling and ``baseline_ratio`` to torch.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.bench.schema import make_row
from kvflow.bench.timing import median, time_calls
from kvflow.kernels import available_backends, copy_blocks, gather_blocks, scatter_blocks

from conftest import QUICK, ROUNDS, WARMUP

# Benchmarks are not bounded by the unit tests' 300 s timeout: the torch reference of the full
# geometry takes seconds per call on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1800)
BACKENDS = [b for b in ("torch", "numba", "native") if available_backends().get(b) == "available"]
OPS = ("gather", "scatter", "copy")


def _call(ob, op: str, backend: str):
    """A zero-argument closure running ``op`` once over the benchmark's cache and ids."""
    if op == "gather":
        return lambda: gather_blocks(ob.cache, ob.ids, ob.buf, backend=backend)
    if op == "scatter":  # writes back the blocks gathered from the same ids: the cache is stable
        return lambda: scatter_blocks(ob.buf, ob.cache, ob.ids, backend=backend)
    return lambda: copy_blocks(ob.cache, ob.cache, ob.ids, ob.copy_dst, backend=backend)


def _baseline(ob, op: str) -> float:
    """Median seconds of the torch backend for ``op`` (its own row's, or measured here)."""
    if op not in ob.baseline_s:
        ob.baseline_s[op] = median(time_calls([_call(ob, op, "torch")], warmup=WARMUP,
                                              reps=min(ROUNDS, 5)))
    return ob.baseline_s[op]


def test_copy_ceiling(benchmark, ops_bench):
    """``dst.copy_(src)`` of the payload's bytes: the ceiling every ratio is taken against."""
    ob = ops_bench
    benchmark.pedantic(ob.copy_dst_buf.copy_, args=(ob.copy_src_buf,), rounds=ROUNDS,
                       warmup_rounds=WARMUP)
    row = make_row(ob.env, op="copy_", backend="torch", spec=ob.spec, tokens=0, blocks=0,
                   payload_bytes=ob.payload, times_s=list(benchmark.stats.stats.data),
                   ceiling_s=median(list(benchmark.stats.stats.data)), config={"quick": QUICK})
    benchmark.extra_info.update(row)
    ob.rows.append(row)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_op(benchmark, ops_bench, op, backend):
    ob = ops_bench
    n = ob.ids.numel()
    gather_blocks(ob.cache, ob.ids, ob.buf, backend="torch")  # reference content for the check
    if op == "gather" and backend != "torch":
        ref = ob.buf.clone()
        ob.buf.zero_()
        gather_blocks(ob.cache, ob.ids, ob.buf, backend=backend)
        assert torch.equal(ob.buf.view(torch.uint8), ref.view(torch.uint8)), backend
    benchmark.group = op
    ceiling = []  # a copy_ of the same bytes before every round: same load, same run
    rounds = min(ROUNDS, 5) if backend == "torch" else ROUNDS  # the slow reference: fewer
    benchmark.pedantic(_call(ob, op, backend), setup=lambda: ceiling.append(ob.time_copy()),
                       rounds=rounds, warmup_rounds=WARMUP)
    if backend == "torch":  # the torch row is the baseline of the others (same run)
        ob.baseline_s[op] = median(list(benchmark.stats.stats.data))
    baseline = _baseline(ob, op)
    row = make_row(ob.env, op=op, backend=backend, spec=ob.spec,
                   tokens=n * ob.spec.block_size, blocks=n, payload_bytes=ob.payload,
                   times_s=list(benchmark.stats.stats.data), ceiling_s=median(ceiling),
                   baseline_s=baseline, config={"quick": QUICK, "cache_blocks": ob.cache.num_blocks,
                                                "threads": torch.get_num_threads()})
    benchmark.extra_info.update(row)
    ob.rows.append(row)
