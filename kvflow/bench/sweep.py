"""Launch settings of the Triton copy kernel on a GPU, repeated and interleaved.

``--round`` picks a list of :class:`~kvflow.kernels.triton.copy_runs.LaunchConfig` variants
(:data:`ROUNDS`, each given as changes to :data:`ROUND1_DEFAULTS`, so that a round means the
same after the defaults change). Each (tokens, repeat) measures the same-run ``copy_`` ceiling,
then every variant x op (gather, scatter, copy_blocks) in Llama-3-8B geometry (4096-block source
cache, 1024-block destination cache, two rotated id sets / staging buffers). Repeats are
interleaved so that drift of the device shows up as spread, not as a variant's gain.
``--layouts`` adds HND bf16, MLA bf16 and NHD fp8 (at ``--layout-tokens``). Round 1 also
times two diagnostics of copy_blocks at 1K tokens: small caches (128 blocks each side) and
sorted ids, to tell address-translation / DRAM locality costs from the kernel's own.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from . import cli
from .cases import make_spec, scramble

ROUND1_DEFAULTS = dict(persistent=True, num_warps=4, copy_block_bytes=16384)

ROUNDS = {
    # round 1: persistent vs not, chunks, warps
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
    # 16 warps, one program per item (the defaults since round 3)
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
    """``[(name, LaunchConfig)]`` of round ``rnd``."""
    from kvflow.kernels.triton.copy_runs import LaunchConfig

    def config(**changes):
        return LaunchConfig(**{**ROUND1_DEFAULTS, **changes})
    return ROUNDS[rnd](config)


@contextlib.contextmanager
def launch_config(cfg):
    """Run the Triton copy kernel with ``cfg`` inside the block (``None``: the defaults)."""
    from kvflow.kernels.triton import copy_runs
    saved = copy_runs.CONFIG
    copy_runs.CONFIG = cfg or saved
    try:
        yield
    finally:
        copy_runs.CONFIG = saved


def _fns(op, src, dst, ids, dids, bufs):
    from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
    kw = {"backend": "triton", "validate": False}
    if op == "gather":
        return [lambda i=i, b=b: gather_blocks(src, i, b, **kw) for i, b in zip(ids, bufs)]
    if op == "scatter":
        return [lambda i=i, b=b: scatter_blocks(b, dst, i, **kw) for i, b in zip(dids, bufs)]
    return [lambda i=i, d=d: copy_blocks(src, dst, i, d, **kw) for i, d in zip(ids, dids)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, device=False, presets=False)
    p.add_argument("--round", default="2", choices=sorted(ROUNDS), help="variant list (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats at 1K tokens")
    p.add_argument("--layouts", action="store_true",
                   help="also HND bf16, MLA bf16 and NHD fp8 (at --layout-tokens)")
    p.add_argument("--layout-tokens", type=cli.tokens, default=[4096],
                   help="request sizes for --layouts (default 4096)")


def run(args) -> int:
    import torch

    from kvflow.cache import PagedKVCache, staging_buffer
    from kvflow.kernels import payload_bytes

    from .schema import env_info, make_row
    from .timing import copy_ceiling, median, time_calls
    cli.require("triton", "sweep")
    if not torch.cuda.is_available():
        raise SystemExit("sweep: needs a CUDA GPU (the launch settings of the Triton kernel)")
    dev = torch.device("cuda")
    env = env_info(dev)
    main_spec = make_spec(None, "NHD", "bfloat16")
    plan = [("NHD bf16", main_spec, t, r) for t, reps in ((1024, args.repeats), (4096, 2), (16384, 2))
            for r in range(reps)]
    if args.layouts:
        plan += [(f"{lay} {dn}", make_spec(None, lay, dt), t, r)
                 for lay, dn, dt in (("HND", "bf16", "bfloat16"), ("MLA", "bf16", "bfloat16"),
                                     ("NHD", "fp8", "float8_e4m3fn"))
                 for t in args.layout_tokens for r in range(2)]
    gen = torch.Generator().manual_seed(args.seed)

    def ids(num_blocks, n, k=2):
        return [torch.randperm(num_blocks, generator=gen)[:n].to(dev) for _ in range(k)]
    caches: dict = {}
    rows = cli.rows(env)
    t0 = time.perf_counter()
    for label, spec, tokens, rep in plan:
        if label not in caches:
            caches.clear()
            torch.cuda.empty_cache()
            caches[label] = (PagedKVCache(spec, 4096, dev), PagedKVCache(spec, 1024, dev))
            scramble(caches[label][0].buffer)
            copy_ceiling(2 ** 27, device=dev, reps=10)  # the first copies after a large allocation run slow
        src, dst = caches[label]
        n = spec.num_blocks_for(tokens)
        nbytes = payload_bytes(spec, n)
        reps = {1024: 100, 4096: 40}.get(tokens, 15)
        sids, dids = ids(4096, n), ids(1024, n)
        bufs = [staging_buffer(spec, n, device=dev) for _ in range(2)]
        ceil = median(copy_ceiling(nbytes, device=dev, rotations=2, reps=reps))
        cases = [(name, cfg, op, src, dst, sids, dids) for name, cfg in variants(args.round)
                 for op in ("gather", "scatter", "copy")]
        if tokens == 1024 and args.round == "1":
            small_src, small_dst = PagedKVCache(spec, 128, dev), PagedKVCache(spec, 128, dev)
            scramble(small_src.buffer)
            cases += [("diag small caches", None, "copy", small_src, small_dst, ids(128, n), ids(128, n)),
                      ("diag sorted ids", None, "copy", src, dst, [i.sort().values for i in sids],
                       [i.sort().values for i in dids])]
        for name, cfg, op, s, d, i, di in cases:
            try:
                with launch_config(cfg):
                    times = time_calls(_fns(op, s, d, i, di, bufs), device=dev, warmup=3, reps=reps)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name} {op} {tokens}: {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append(make_row(env, op=op, backend="triton", spec=spec, tokens=tokens, blocks=n,
                                 payload_bytes=nbytes, times_s=times, ceiling_s=ceil, seed=args.seed,
                                 variant=name, case=label, rep=rep,
                                 config={"round": args.round, "launch": None if cfg is None
                                         else vars(cfg)}))
        print(f"{label} {tokens} repeat {rep} done (ceiling {nbytes / ceil / 1e9:.0f} GB/s)", flush=True)
    summary: dict = {}
    for r in rows:
        summary.setdefault((r["case"], r["tokens"], r["op"], r["variant"]), []).append(r["ratio"])
    print(f"{'case':<9}{'tokens':>6} {'op':<8}{'variant':<20}{'ratios':<36}{'median':>7}")
    for (case, tokens, op, var), rs in summary.items():
        print(f"{case:<9}{tokens:>6} {op:<8}{var:<20}{' '.join(f'{x:.3f}' for x in rs):<36}"
              f"{statistics.median(rs):>7.3f}")
    cli.finish(args, {k: v for k, v in vars(args).items() if not k.startswith("_")}, env, rows, t0=t0)
    return 0
