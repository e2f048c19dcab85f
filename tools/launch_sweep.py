"""Launch-setting sweep for the triton copy kernel on a GPU, repeated and interleaved.

Run on a CUDA host from the repository root::

    python tools/launch_sweep.py --round 2 --layouts --json out.json

``--round`` picks a list of :class:`LaunchConfig` variants (``ROUNDS``, each given as changes to
the defaults of round 1, ``ROUND1_DEFAULTS``, so that a round means the same after the defaults
change). Each (tokens, repeat) measures the same-run ``copy_`` ceiling, then every variant x op
(gather, scatter, copy_blocks) in Llama-3-8B geometry (as tools/gpu_probe.py: 4096-block source
cache, 1024-block destination cache, two rotated id sets / staging buffers). Repeats are
interleaved so that drift of the device shows up as spread, not as a variant's gain.
``--layouts`` adds HND bf16, MLA bf16 and NHD fp8 (4K tokens, or ``--layout-tokens``).
Diagnostics (round 1, copy_blocks at 1K tokens only): small caches (128 blocks each side: the same
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_probe import ceiling, fill_random_, rand_ids, spec_for, stats, time_ms  # noqa: E402
from kvflow import PagedKVCache, staging_buffer  # noqa: E402
from kvflow.kernels import copy_blocks, gather_blocks, payload_bytes, scatter_blocks  # noqa: E402


# The LaunchConfig defaults when round 1 ran (commit 1126bcc); every variant below is a change
# to these, whatever the defaults are now.
ROUND1_DEFAULTS = dict(persistent=True, num_warps=4, copy_block_bytes=16384)

ROUNDS = {
    # round 1 (2026-11-30, commit 1126bcc): persistent vs not, chunks, warps. That commit also
    # timed a kernel variant that prefetched (prefetch.global.L2) the next work item's first
    # source and destination addresses ("pf" rows of the round-1 log): no gain, removed.
    "1": lambda C: [
        ("default", C()),
        ("nonpersist", C(persistent=False)),
        ("np c16K", C(persistent=False, copy_chunk_bytes=16384)),
        ("np c32K", C(persistent=False, copy_chunk_bytes=32768)),
        ("np c64K", C(persistent=False, copy_chunk_bytes=65536)),
        ("np 8w", C(persistent=False, num_warps=8)),
        ("np 8w s32K", C(persistent=False, num_warps=8, block_bytes=32768, chunk_bytes=32768,
                         copy_block_bytes=32768)),
        ("np g32K", C(persistent=False, chunk_bytes=32768)),
        ("p c16K", C(copy_chunk_bytes=16384)),
        ("p 8w", C(num_warps=8)),
    ],
    # round 2: non-persistent, 8 warps for gather/scatter; copy_blocks' step, item and warps
    "2": lambda C: [
        ("np 8w", C(persistent=False, num_warps=8)),
        ("np 8w cs32K", C(persistent=False, num_warps=8, copy_block_bytes=32768)),
        ("np 8w cs32K c32K", C(persistent=False, num_warps=8, copy_block_bytes=32768,
                               copy_chunk_bytes=32768)),
        ("np 8w cs32K c64K", C(persistent=False, num_warps=8, copy_block_bytes=32768,
                               copy_chunk_bytes=65536)),
        ("np 8w cs64K", C(persistent=False, num_warps=8, copy_block_bytes=65536)),
        ("np 8w c32K", C(persistent=False, num_warps=8, copy_chunk_bytes=32768)),
        ("np 16w cs64K", C(persistent=False, num_warps=16, copy_block_bytes=65536)),
        ("np 16w cs32K", C(persistent=False, num_warps=16, copy_block_bytes=32768)),
        ("np 4w cs32K", C(persistent=False, copy_block_bytes=32768)),
        ("np 4w cs32K c32K", C(persistent=False, copy_block_bytes=32768,
                               copy_chunk_bytes=32768)),
    ],
    # round 3: 16 and 32 warps; copy_blocks' step; gather/scatter step = item
    "3": lambda C: [
        ("np 16w cs64K", C(persistent=False, num_warps=16, copy_block_bytes=65536)),
        ("np 32w cs64K", C(persistent=False, num_warps=32, copy_block_bytes=65536)),
        ("np 32w cs32K", C(persistent=False, num_warps=32, copy_block_bytes=32768)),
        ("np 32w cs128K", C(persistent=False, num_warps=32, copy_block_bytes=131072)),
        ("np 16w cs16K", C(persistent=False, num_warps=16, copy_block_bytes=16384)),
        ("np 16w cs128K", C(persistent=False, num_warps=16, copy_block_bytes=131072)),
        ("np 16w s32K cs64K", C(persistent=False, num_warps=16, block_bytes=32768,
                                chunk_bytes=32768, copy_block_bytes=65536)),
        ("np 16w s8K cs64K", C(persistent=False, num_warps=16, block_bytes=8192,
                               chunk_bytes=8192, copy_block_bytes=65536)),
    ],
    # round 4: copy_blocks items and steps for short runs (MLA 72 KiB, fp8 64 KiB blocks), at
    # 16 warps, one program per item (the defaults chosen after round 3)
    "4": lambda C: [
        ("np 16w cs64K", C(persistent=False, num_warps=16, copy_block_bytes=65536)),
        ("np 16w cs64K c64K", C(persistent=False, num_warps=16, copy_block_bytes=65536,
                                copy_chunk_bytes=65536)),
        ("np 16w cs32K c32K", C(persistent=False, num_warps=16, copy_block_bytes=32768,
                                copy_chunk_bytes=32768)),
        ("np 16w cs16K c16K", C(persistent=False, num_warps=16, copy_block_bytes=16384,
                                copy_chunk_bytes=16384)),
        ("np 16w cs16K c32K", C(persistent=False, num_warps=16, copy_block_bytes=16384,
                                copy_chunk_bytes=32768)),
        ("np 16w cs32K c64K", C(persistent=False, num_warps=16, copy_block_bytes=32768,
                                copy_chunk_bytes=65536)),
    ],
}


def variants(rnd: str):
    from kvflow.kernels.triton.copy_runs import LaunchConfig

    def config(**changes):
        return LaunchConfig(**{**ROUND1_DEFAULTS, **changes})
    return ROUNDS[rnd](config)


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
    ap.add_argument("--round", default="2", choices=sorted(ROUNDS))
    ap.add_argument("--layouts", action="store_true",
                    help="also HND bf16, MLA bf16 and NHD fp8 (at --layout-tokens)")
    ap.add_argument("--layout-tokens", default="4096",
                    help="comma-separated request sizes for --layouts (default 4096)")
    a = ap.parse_args(argv)
    from kvflow.kernels.triton import copy_runs as cr
    main_spec = spec_for("NHD", torch.bfloat16)
    plan = [("NHD bf16", main_spec, t, r) for t, reps in ((1024, a.repeats), (4096, 2), (16384, 2))
            for r in range(reps)]
    if a.layouts:
        plan += [(f"{lay} {dn}", spec_for(lay, dt), int(t), r)
                 for lay, dn, dt in (("HND", "bf16", torch.bfloat16),
                                     ("MLA", "bf16", torch.bfloat16),
                                     ("NHD", "fp8", torch.float8_e4m3fn))
                 for t in a.layout_tokens.split(",") for r in range(2)]
    caches: dict = {}
    rows = []
    for label, spec, tokens, rep in plan:
        if label not in caches:
            caches.clear()
            torch.cuda.empty_cache()
            caches[label] = (fill_random_(PagedKVCache(spec, 4096, "cuda"), 1),
                             PagedKVCache(spec, 1024, "cuda"))
            ceiling(2 ** 27, 10)  # the first copies after a large allocation run slow: discard
        src, dst = caches[label]
        n = spec.num_blocks_for(tokens)
        nbytes = payload_bytes(spec, n)
        reps = {1024: 100, 4096: 40, 16384: 15}[tokens]
        ids = [rand_ids(4096, n, seed + rep, "cuda", False) for seed in (10, 20)]
        dids = [rand_ids(1024, n, seed + rep, "cuda", False) for seed in (30, 40)]
        bufs = [staging_buffer(spec, n, None, "cuda") for _ in range(2)]
        ceil = ceiling(nbytes, reps)
        rows.append(dict(case=label, tokens=tokens, rep=rep, op="copy_", variant="ceiling", **ceil,
                         ratio=1.0))
        cases = [(name, cfg, op, src, dst, ids, dids) for name, cfg in variants(a.round)
                 for op in ("gather", "scatter", "copy")]
        if tokens == 1024 and a.round == "1":
            small_src = fill_random_(PagedKVCache(spec, 128, "cuda"), 2)
            small_dst = PagedKVCache(spec, 128, "cuda")
            sids = [rand_ids(128, n, 50 + k, "cuda", False) for k in range(2)]
            sdids = [rand_ids(128, n, 60 + k, "cuda", False) for k in range(2)]
            sorted_ids = [i.sort().values for i in ids]
            sorted_dids = [i.sort().values for i in dids]
            cases += [("diag small caches", None, "copy", small_src, small_dst, sids, sdids),
                      ("diag sorted ids", None, "copy", src, dst, sorted_ids, sorted_dids)]
        for name, cfg, op, s, d, i, di in cases:
            saved, cr.CONFIG = cr.CONFIG, cfg or cr.CONFIG
            try:
                st = stats(measure(op, s, d, i, di, bufs, reps), nbytes)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name} {op} {tokens}: {type(exc).__name__}: {exc}", flush=True)
                continue
            finally:
                cr.CONFIG = saved
            rows.append(dict(case=label, tokens=tokens, rep=rep, op=op, variant=name, **st,
                             ratio=st["gbps"] / ceil["gbps"]))
        print(f"{label} {tokens} repeat {rep} done (ceiling {ceil['gbps']:.0f} GB/s)", flush=True)
    summary = {}
    for r in rows:
        summary.setdefault((r["case"], r["tokens"], r["op"], r["variant"]), []).append(r["ratio"])
    print(f"{'case':<9}{'tokens':>6} {'op':<8}{'variant':<20}{'ratios':<36}{'median':>7}")
    for (case, tokens, op, var), rs in summary.items():
        print(f"{case:<9}{tokens:>6} {op:<8}{var:<20}{' '.join(f'{x:.3f}' for x in rs):<36}"
              f"{statistics.median(rs):>7.3f}")
    if a.json:
        import os
        env = {"device": torch.cuda.get_device_name(0), "commit": os.environ.get("KVFLOW_COMMIT"),
               "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
