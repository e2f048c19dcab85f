"""Launch-setting sweep for the triton copy kernel on a GPU, repeated and interleaved.

Run on a CUDA host from the repository root::

    python tools/launch_sweep.py --json out.json

Each (tokens, repeat) measures the same-run ``copy_`` ceiling, then every variant x op
(gather, scatter, copy_blocks) in Llama-3-8B geometry (as tools/gpu_probe.py: 4096-block source
cache, 1024-block destination cache, two rotated id sets / staging buffers). Repeats are
interleaved so that drift of the device shows up as spread, not as a variant's gain.
Diagnostics (copy_blocks at 1K tokens only): small caches (128 blocks each side: the same
request in a 1 GiB footprint instead of 32 + 8 GiB) and sorted ids (neighbouring blocks),
to tell address-translation / DRAM locality costs from the kernel's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_probe import ceiling, fill_random_, rand_ids, spec_for, stats, time_ms  # noqa: E402
from kvflow import PagedKVCache, staging_buffer  # noqa: E402
from kvflow.kernels import copy_blocks, gather_blocks, payload_bytes, scatter_blocks  # noqa: E402


@triton.jit
def _prefetch(ptr):
    """``prefetch.global.L2`` of one address (warms the address translation and L2)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _item(w, src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids, n, src_n, dst_n,
          WORD: tl.constexpr, RUN: tl.constexpr, CHUNK: tl.constexpr,
          SRC_CACHE: tl.constexpr, DST_CACHE: tl.constexpr):
    NCHUNK: tl.constexpr = (RUN + CHUNK - 1) // CHUNK
    c = w % NCHUNK
    r = w // NCHUNK
    i = r % n
    j = r // n
    valid = i >= 0
    if SRC_CACHE:
        s = tl.load(src_ids + i).to(tl.int64)
        valid = valid & (s >= 0) & (s < src_n)
        sp = tl.load(src_table + j).to(tl.pointer_type(WORD)) + s * RUN
    else:
        sp = src_stage + (j.to(tl.int64) * n + i) * RUN
    if DST_CACHE:
        d = tl.load(dst_ids + i).to(tl.int64)
        valid = valid & (d >= 0) & (d < dst_n)
        dp = tl.load(dst_table + j).to(tl.pointer_type(WORD)) + d * RUN
    else:
        dp = dst_stage + (j.to(tl.int64) * n + i) * RUN
    return sp + c * CHUNK, dp + c * CHUNK, valid, c


@triton.jit
def _copy_runs_prefetch(src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids,
                        n, src_n, dst_n, total,
                        WORD: tl.constexpr, ALIGN: tl.constexpr, RUN: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                        SRC_CACHE: tl.constexpr, DST_CACHE: tl.constexpr,
                        STREAM: tl.constexpr):
    """The product kernel plus a prefetch of the next work item's first source and
    destination addresses before copying the current one (persistent grids only)."""
    ar = tl.arange(0, BLOCK)
    G = tl.num_programs(0)
    for w in range(tl.program_id(0), total, G):
        sp, dp, valid, c = _item(w, src_table, dst_table, src_stage, dst_stage, src_ids,
                                 dst_ids, n, src_n, dst_n, WORD, RUN, CHUNK, SRC_CACHE,
                                 DST_CACHE)
        if w + G < total:
            sp2, dp2, valid2, c2 = _item(w + G, src_table, dst_table, src_stage, dst_stage,
                                         src_ids, dst_ids, n, src_n, dst_n, WORD, RUN, CHUNK,
                                         SRC_CACHE, DST_CACHE)
            if valid2:
                _prefetch(sp2)
                _prefetch(dp2)
        if valid:
            sp = tl.multiple_of(sp, ALIGN)
            dp = tl.multiple_of(dp, ALIGN)
            for k in range(0, CHUNK, BLOCK):
                offs = k + ar
                if EVEN:
                    tl.store(dp + offs, tl.load(sp + offs))
                else:
                    m = c * CHUNK + offs < RUN
                    tl.store(dp + offs, tl.load(sp + offs, mask=m), mask=m)


def variants():
    from kvflow.kernels.triton.copy_runs import LaunchConfig as C
    return [
        ("default", C()),
        ("nonpersist", C(persistent=False)),
        ("np c16K", C(persistent=False, copy_chunk_bytes=16384)),
        ("np c32K", C(persistent=False, copy_chunk_bytes=32768)),
        ("np c64K", C(persistent=False, copy_chunk_bytes=65536)),
        ("np 8w", C(persistent=False, num_warps=8)),
        ("np 8w s32K", C(persistent=False, num_warps=8, block_bytes=32768, chunk_bytes=32768)),
        ("np g32K", C(persistent=False, chunk_bytes=32768)),
        ("p c16K", C(copy_chunk_bytes=16384)),
        ("p 8w", C(num_warps=8)),
        ("pf c16K", C(copy_chunk_bytes=16384)),
        ("pf c32K", C(copy_chunk_bytes=32768)),
        ("pf 2/SM", C(ctas_per_sm=2)),
    ]


def measure(op, src, dst, ids, dids, bufs, reps):
    if op == "gather":
        fns = [lambda i=i, b=b: gather_blocks(src, i, b, backend="triton", validate=False)
               for i, b in zip(ids, bufs)]
    elif op == "scatter":
        fns = [lambda i=i, b=b: scatter_blocks(b, dst, i, backend="triton", validate=False)
               for i, b in zip(dids, bufs)]
    else:
        fns = [lambda i=i, d=d: copy_blocks(src, dst, i, d, backend="triton", validate=False)
               for i, d in zip(ids, dids)]
    return time_ms(fns, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    from kvflow.kernels.triton import copy_runs as cr
    spec = spec_for("NHD", torch.bfloat16)
    src = fill_random_(PagedKVCache(spec, 4096, "cuda"), 1)
    dst = PagedKVCache(spec, 1024, "cuda")
    small_src = fill_random_(PagedKVCache(spec, 128, "cuda"), 2)
    small_dst = PagedKVCache(spec, 128, "cuda")
    rows = []
    plan = [(1024, r) for r in range(a.repeats)] + [(4096, r) for r in range(2)] + [(16384, r) for r in range(2)]
    for tokens, rep in plan:
        n = spec.num_blocks_for(tokens)
        nbytes = payload_bytes(spec, n)
        reps = {1024: 100, 4096: 40, 16384: 15}[tokens]
        ids = [rand_ids(4096, n, 10 + rep, "cuda", False), rand_ids(4096, n, 20 + rep, "cuda", False)]
        dids = [rand_ids(1024, n, 30 + rep, "cuda", False), rand_ids(1024, n, 40 + rep, "cuda", False)]
        bufs = [staging_buffer(spec, n, None, "cuda") for _ in range(2)]
        ceil = ceiling(nbytes, reps)
        rows.append(dict(tokens=tokens, rep=rep, op="copy_", variant="ceiling", **ceil, ratio=1.0))
        cases = [(name, cfg, op, src, dst, ids, dids) for name, cfg in variants()
                 for op in ("gather", "scatter", "copy")]
        if tokens == 1024:
            sids = [rand_ids(128, n, 50 + k, "cuda", False) for k in range(2)]
            sdids = [rand_ids(128, n, 60 + k, "cuda", False) for k in range(2)]
            sorted_ids = [i.sort().values for i in ids]
            sorted_dids = [i.sort().values for i in dids]
            cases += [("diag small caches", None, "copy", small_src, small_dst, sids, sdids),
                      ("diag sorted ids", None, "copy", src, dst, sorted_ids, sorted_dids)]
        for name, cfg, op, s, d, i, di in cases:
            saved, cr.CONFIG = cr.CONFIG, cfg or cr.CONFIG
            jit = cr._JIT.get(False)
            if name.startswith("pf"):
                cr._JIT[False] = _copy_runs_prefetch
            try:
                st = stats(measure(op, s, d, i, di, bufs, reps), nbytes)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name} {op} {tokens}: {type(exc).__name__}: {exc}", flush=True)
                continue
            finally:
                cr.CONFIG = saved
                if jit is not None:
                    cr._JIT[False] = jit
                else:
                    cr._JIT.pop(False, None)
            rows.append(dict(tokens=tokens, rep=rep, op=op, variant=name, **st,
                             ratio=st["gbps"] / ceil["gbps"]))
        print(f"tokens {tokens} repeat {rep} done (ceiling {ceil['gbps']:.0f} GB/s)", flush=True)
    summary = {}
    for r in rows:
        summary.setdefault((r["tokens"], r["op"], r["variant"]), []).append(r["ratio"])
    print(f"{'tokens':>6} {'op':<8}{'variant':<20}{'ratios':<24}{'median':>7}")
    for (tokens, op, var), rs in summary.items():
        print(f"{tokens:>6} {op:<8}{var:<20}{' '.join(f'{x:.3f}' for x in rs):<24}"
              f"{statistics.median(rs):>7.3f}")
    if a.json:
        import os
        env = {"device": torch.cuda.get_device_name(0), "commit": os.environ.get("KVFLOW_COMMIT"),
               "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
