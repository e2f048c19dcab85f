"""pytest-benchmark suite of the kernel sweep: the same cases as ``python -m kvflow.bench kernels``
(ops x backends x layouts x dtypes x request sizes, from :mod:`kvflow.bench.presets`), the same
buffers (:class:`kvflow.bench.kernel_case.KernelCase`: seeded random ids, rotated staging buffers) and
the same row schema: each benchmark's ``extra_info`` is a :func:`kvflow.bench.schema.make_row`
row (GB/s of payload, ratio to the same-run ``copy_`` ceiling, speed-up over torch).

    pytest bench/test_kernels_bench.py --benchmark-json out.json          # quick preset, CPU
    KVFLOW_BENCH_PRESET=full pytest bench/test_kernels_bench.py ...       # the H200 sweep
    pytest bench/test_kernels_bench.py --benchmark-autosave               # then, after a change:
    pytest bench/test_kernels_bench.py --benchmark-compare --benchmark-compare-fail=median:10%

Every case first checks the backend's bytes against the torch reference (a failure, not a skip).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow.bench import presets
from kvflow.bench.cases import LLAMA3_8B, MLA_DIM, make_spec, scramble
from kvflow.bench.kernel_case import KernelCase
from kvflow.bench.kernels import OPS, pick_backends
from kvflow.bench.schema import env_info, make_row
from kvflow.bench.timing import (copy_ceiling, last_level_cache_bytes, median, rotations_for,
                                 time_calls)
from kvflow.cache import PagedKVCache
from kvflow.kernels import payload_bytes

PRESET = os.environ.get("KVFLOW_BENCH_PRESET", "quick")
OPTS = presets.preset("kernels", PRESET)
DEVICE = torch.device("cuda" if PRESET == "full" and torch.cuda.is_available() else "cpu")
BACKENDS = pick_backends(None, DEVICE)[0]
SEED = 0
_STATE: dict = {}


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _case(layout: str, dtype: str, tokens: int) -> dict:
    """Cache per (layout, dtype), buffers and ceiling per request size; built once."""
    key = (layout, dtype, tokens)
    if key not in _STATE:
        if _STATE.get("cache_key") != (layout, dtype):  # free the last geometry's buffers
            for k in [k for k in _STATE if isinstance(k, tuple)]:
                del _STATE[k]
            _STATE.pop("cache", None)
            spec = make_spec(LLAMA3_8B, layout, dtype, MLA_DIM)
            cache = PagedKVCache(spec, OPTS["num_blocks"], DEVICE)
            scramble(cache.buffer)
            _STATE.update(cache=cache, cache_key=(layout, dtype))
        cache = _STATE["cache"]
        n = cache.spec.num_blocks_for(tokens)
        if 2 * n > cache.num_blocks:
            pytest.skip(f"{tokens} tokens need {2 * n} blocks; the cache has {cache.num_blocks}")
        payload = payload_bytes(cache.spec, n)
        rot = rotations_for(payload, last_level_cache_bytes(DEVICE))
        reps = presets.reps_for(payload, OPTS["reps"])
        case = KernelCase(cache, n, rot, torch.Generator().manual_seed(SEED))
        ceiling = median(copy_ceiling(payload, device=DEVICE, rotations=rot,
                                      warmup=OPTS["warmup"], reps=reps))
        _STATE[key] = {"case": case, "payload": payload, "rot": rot, "reps": reps,
                       "ceiling_s": ceiling, "baseline": {}}
    return _STATE[key]


# The bottom decorator is the outer loop: one cache per (layout, dtype) at a time.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tokens", OPTS["tokens"])
@pytest.mark.parametrize("dtype", OPTS["dtypes"])
@pytest.mark.parametrize("layout", OPTS["layouts"])
def test_kernel(benchmark, op, backend, layout, dtype, tokens):
    c = _case(layout, dtype, tokens)
    case = c["case"]
    assert case.verify(op, backend, None), f"{backend} {op} differs from the torch reference"
    fns = case.fns(op, backend, None)
    if op not in c["baseline"] and "torch" in BACKENDS:
        c["baseline"][op] = median(time_calls(case.fns(op, "torch", None), device=DEVICE,
                                              warmup=OPTS["warmup"], reps=c["reps"]))
    turn = iter(range(1 << 62))

    def call():
        fns[next(turn) % len(fns)]()
        _sync()

    benchmark.pedantic(call, rounds=c["reps"], warmup_rounds=OPTS["warmup"], iterations=1)
    env = _STATE.setdefault("env", env_info(DEVICE))
    benchmark.extra_info.update(make_row(
        env, op=op, backend=backend, spec=case.cache.spec, tokens=tokens, blocks=case.n,
        payload_bytes=c["payload"], times_s=list(benchmark.stats.stats.data),
        ceiling_s=c["ceiling_s"], baseline_s=c["baseline"].get(op), seed=SEED, max_ctas=None,
        verified=True, rotations=c["rot"],
        config={"preset": PRESET, "num_blocks": OPTS["num_blocks"], "reps": c["reps"],
                "device": str(DEVICE), "suite": "pytest-benchmark"}))
