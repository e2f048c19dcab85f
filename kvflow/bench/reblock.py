"""copy_sequence between P and D caches of different specs (issue #19): payload GB/s on both
sides' bytes and the ratio to the same-run copy ceiling, as called and in device time.

Cases (``--cases``; Llama-3-8B geometry: 32 layers, 8 KV heads, head_dim 128, bf16 NHD unless
the case changes it): ``bs16->64`` and ``bs64->16`` (re-blocking), ``nhd->hnd`` (block 64),
``bf16->fp8`` (block 64, D in float8_e4m3fn with per-tensor scales), ``bf16->fp8-bh`` (D with
per-block-per-head scales, computed by the copy), ``same`` (one spec, block 64: the plain
copy_blocks, for reference). Each call moves one ``--tokens`` sequence between random block
tables of a P cache and a D cache (one launch over all layers).

Bytes: ``src_bytes`` read and ``dst_bytes`` written (they differ for fp8). Ratios:
``ratio`` = time of a same-run ``dst.copy_(src)`` of ``dst_bytes`` over the op's time (the
issue's figure: the copy ceiling of the bytes written); ``ratio_read`` the same for
``src_bytes``; ``ratio_traffic`` = (src_bytes + dst_bytes) / time over the ceiling's
2 x bytes / time (the fraction of the memory traffic a copy reaches; equal to ``ratio`` when
the sides are equal). As called (the headline): batches of back-to-back calls with default
arguments, ids on the device (:func:`kvflow.bench.timing.time_as_called`); device time: queue
filled first (:func:`kvflow.bench.timing.time_calls`). Cold L2: block tables rotate over caches
larger than twice the last-level cache when one request's bytes are smaller.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import cli

CASES = {  # name -> (P spec changes, D spec changes) from the bf16 NHD Llama-3-8B spec
    "bs16->64": (dict(block_size=16), dict(block_size=64)),
    "bs64->16": (dict(block_size=64), dict(block_size=16)),
    "nhd->hnd": (dict(block_size=64), dict(block_size=64, layout="HND")),
    "bf16->fp8": (dict(block_size=64), dict(block_size=64, dtype="float8_e4m3fn")),
    "bf16->fp8-bh": (dict(block_size=64), dict(block_size=64, dtype="float8_e4m3fn",
                                                scales="block_head")),
    "same": (dict(block_size=64), dict(block_size=64)),
}


def specs(case: str, geometry: dict):
    """(P spec, D spec) of a case."""
    from kvflow.layout import KVCacheSpec
    base = KVCacheSpec(**geometry, dtype="bfloat16", layout="NHD")
    p, d = CASES[case]
    return base.with_(**p), base.with_(**d)


def _side_bytes(spec, tokens: int) -> int:
    return tokens * spec.bytes_per_token


def setup(case: str, opts: dict, device, rotations: int):
    """``rotations`` closures, each one copy_sequence call of ``opts['tokens']`` tokens between
    a P and a D cache (fresh random block tables per rotation; ``same``: copy_blocks of the
    tables' block pairs), plus (src_bytes, dst_bytes)."""
    import functools

    import torch

    from kvflow.cache import PagedKVCache
    from kvflow.kernels import copy_blocks, copy_sequence
    geometry = {k: opts[k] for k in ("num_layers", "num_kv_heads", "head_dim")} | {"block_size": 64}
    ps, ds = specs(case, geometry)
    op = copy_blocks if ps == ds else copy_sequence
    T = opts["tokens"]
    g = torch.Generator().manual_seed(opts["seed"])
    fns = []
    for _ in range(rotations):
        ns, nd = ps.num_blocks_for(T), ds.num_blocks_for(T)
        p = PagedKVCache(ps, 2 * ns, device)
        d = PagedKVCache(ds, 2 * nd, device)
        for t in p.tensors():
            t.normal_()
        s_ids = torch.randperm(p.num_blocks, generator=g)[:ns].to(device)
        d_ids = torch.randperm(d.num_blocks, generator=g)[:nd].to(device)
        kw = {} if opts["backend"] == "auto" else {"backend": opts["backend"]}
        if d.scales is not None:
            d.scales.fill_(0.05)
        fns.append(functools.partial(op, p, d, s_ids, d_ids, **kw))
    return fns, _side_bytes(ps, T), _side_bytes(ds, T), ps, ds


def run_case(case: str, opts: dict, env: dict) -> dict:
    """One row: as-called and device times of ``case``, its bytes, GB/s and ratios."""
    import torch

    from .kernel_case import check_errors
    from .schema import make_row
    from .timing import (calls_per_batch, copy_ceiling, last_level_cache_bytes, median,
                         rotations_for, time_as_called, time_calls)
    device = torch.device(opts["device"])
    probe_bytes = opts["tokens"] * opts["num_layers"] * 2 * opts["num_kv_heads"] \
        * opts["head_dim"] * 2
    rot = rotations_for(probe_bytes, last_level_cache_bytes(device))
    fns, sb, db, ps, ds = setup(case, opts, device, rot)
    dev_t = time_calls(fns, device=device, warmup=opts["warmup"], reps=opts["reps"])
    calls = calls_per_batch(median(dev_t)) if device.type == "cuda" else max(1, opts["reps"] // 5)
    as_called = time_as_called(fns, device=device, calls=calls, batches=opts["batches"],
                               warmup=opts["warmup"])
    check_errors()
    ceil_w = median(copy_ceiling(db, device=device, rotations=rot, reps=opts["reps"]))
    ceil_r = ceil_w if sb == db else median(copy_ceiling(sb, device=device, rotations=rot,
                                                         reps=opts["reps"]))
    t, td = median(as_called), median(dev_t)
    row = make_row(env, op="copy", backend=opts["backend"], spec=ds, tokens=opts["tokens"],
                   blocks=ds.num_blocks_for(opts["tokens"]), payload_bytes=db,
                   times_s=as_called, ceiling_s=ceil_w, seed=opts["seed"],
                   config={k: opts[k] for k in ("warmup", "reps", "batches", "device")})
    row.update(case=case, src_spec=ps.to_dict(), dst_spec=ds.to_dict(), src_bytes=sb,
               dst_bytes=db, gbps_read=sb / t / 1e9, ratio_read=ceil_r / t,
               ratio_traffic=(sb + db) / t / (2 * db / ceil_w),
               device_time_s=td, device_gbps=db / td / 1e9, device_ratio=ceil_w / td,
               calls_per_batch=calls, rotations=rot)
    return row


def format_table(rows: list[dict]) -> str:
    head = (f"{'case':14} {'tokens':>6} {'read MiB':>9} {'write MiB':>9} {'us/call':>9} "
            f"{'GB/s wr':>8} {'GB/s rd':>8} {'ratio':>6} {'r_read':>6} {'r_traf':>6} "
            f"{'dev ratio':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:14} {r['tokens']:6d} {r['src_bytes'] / 2**20:9.1f} "
                     f"{r['dst_bytes'] / 2**20:9.1f} {r['time_s'] * 1e6:9.1f} {r['gbps']:8.1f} "
                     f"{r['gbps_read']:8.1f} {r['ratio']:6.3f} {r['ratio_read']:6.3f} "
                     f"{r['ratio_traffic']:6.3f} {r['device_ratio']:9.3f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p)
    p.add_argument("--cases", type=cli.csv(), help=f"comma list of {','.join(CASES)} (default all)")
    p.add_argument("--tokens", type=int, help="tokens per call (quick 256, full 4096)")
    p.add_argument("--backend", help="kvflow backend (default auto: triton on CUDA, numba on CPU)")
    p.add_argument("--reps", type=int, help="device-time repetitions (quick 5, full 30)")
    p.add_argument("--batches", type=int, help="as-called batches (quick 2, full 7)")
    p.add_argument("--warmup", type=int, help="untimed calls first (quick 1, full 5)")
    for name, val in (("num_layers", 32), ("num_kv_heads", 8), ("head_dim", 128)):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"geometry (default {val})")


def run(args) -> int:
    from .schema import env_info
    opts = cli.resolve(args, "reblock")
    for name, val in (("num_layers", 32), ("num_kv_heads", 8), ("head_dim", 128)):
        opts[name] = opts.get(name) or val
    opts["cases"] = opts.get("cases") or list(CASES)
    opts["backend"] = opts.get("backend") or "auto"
    unknown = sorted(set(opts["cases"]) - set(CASES))
    if unknown:
        raise SystemExit(f"kvflow.bench reblock: --cases: unknown {','.join(unknown)}; "
                         f"known: {','.join(CASES)}")
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows = cli.rows(env, opts)
    bar = cli.progress(len(opts["cases"]), "reblock", not args.no_progress)
    for case in opts["cases"]:
        rows.append(run_case(case, opts, env))
        bar.update(1)
    bar.close()
    print(format_table(rows))
    cli.finish(args, opts, env, rows, t0=t0)
    return 0


