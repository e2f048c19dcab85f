"""The kernel sweep: gather / scatter / copy_blocks x backends x layouts x dtypes x request sizes.

For each case the sweep (1) checks the backend's result byte for byte against the torch
reference once, (2) times it over rotating id sets and staging buffers whose total exceeds
twice the last-level cache (cold L2/LLC), twice: **as called** (batches of back-to-back calls
with default arguments, one sync per batch: :func:`timing.time_as_called`), the headline, and
**device time** (``validate=False``, per-call events with the queue filled first:
:func:`timing.time_calls`), and (3) reports for both GB/s of payload, the ratio to the same-run
ceiling (``dst.copy_(src)`` of the same payload bytes, device time, :func:`timing.copy_ceiling`)
and the speed-up over the torch backend (per-layer ``index_select`` / ``index_copy_``, the
baseline a user would write) timed the same way. See docs/design.md, "Measuring".

Row fields: ``time_s``, ``gbps``, ``ratio``, ``baseline_ratio`` are device time (as in result
files made before the as-called figure existed); ``as_called_s``, ``as_called_gbps``,
``as_called_ratio``, ``as_called_baseline_ratio`` (and p10 / p90, calls per batch) are as called.
Cases: :class:`kvflow.bench.kernel_case.KernelCase`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from . import cli
from .backends import pick_backends
from .cases import LLAMA3_8B, MLA_DIM, make_spec, scramble
from .kernel_case import KernelCase, check_errors
from .presets import reps_for

OPS = ("gather", "scatter", "copy")
#: the ops with ``digest=`` (--kv-verify; not in the presets: name them in --ops)
DIGEST_OPS = ("gather+digest", "scatter+digest", "copy+digest")


def run_kernels(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> tuple[list, list]:
    """Run the sweep described by ``opts`` (the parsed flags of ``kernels``).

    Returns
    -------
    rows : list of dict
        One :func:`kvflow.bench.schema.make_row` row per (op, backend, layout, dtype, tokens,
        max_ctas) (device time), with the as-called figures of
        :func:`kvflow.bench.schema.as_called_fields` and extra keys ``max_ctas``, ``verified``,
        ``rotations``, ``cold``.
    skipped : list of dict
        Cases that did not run, with the reason (e.g. a request larger than the cache).
    """
    import torch

    from kvflow.cache import PagedKVCache
    from kvflow.kernels import payload_bytes

    from .schema import as_called_fields, make_row
    from .timing import (calls_per_batch, copy_ceiling, last_level_cache_bytes, median,
                         rotations_for, time_as_called, time_calls)
    unknown = sorted(set(opts["ops"]) - set(OPS + DIGEST_OPS))
    if unknown:
        raise SystemExit(f"kvflow.bench kernels: --ops: unknown {','.join(unknown)}; known: "
                         f"{','.join(OPS + DIGEST_OPS)}")
    device = torch.device(opts["device"])
    backends, left_out = pick_backends(opts.get("backends"), device)
    llc = last_level_cache_bytes(device)
    gen = torch.Generator().manual_seed(opts["seed"])
    torch.manual_seed(opts["seed"])
    skipped = [{"backend": b, "reason": r} for b, r in left_out.items()]
    geometry = {k: opts[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")}
    combos = [(lay, dt) for lay in opts["layouts"] for dt in opts["dtypes"]]
    total = len(combos) * len(opts["tokens"]) * len(opts["ops"])
    rows: list[dict] = cli.rows(env, opts)
    bar = cli.progress(total, "kernels", progress)
    for layout, dtype in combos:
        spec = make_spec(geometry, layout, dtype, opts["mla_dim"])
        cache = PagedKVCache(spec, opts["num_blocks"], device)
        scramble(cache.buffer)
        for tokens in opts["tokens"]:
            n = spec.num_blocks_for(tokens)
            need = 2 * n if any(op.startswith("copy") for op in opts["ops"]) else n
            if need > opts["num_blocks"]:
                skipped.append({"layout": layout, "dtype": dtype, "tokens": tokens,
                                "reason": f"needs {need} blocks; --num-blocks is {opts['num_blocks']}"})
                bar.update(len(opts["ops"]))
                continue
            payload = payload_bytes(spec, n)
            rot = rotations_for(payload, llc, max_rotations=opts.get("max_rotations", 8))
            reps = reps_for(payload, opts["reps"])
            case = KernelCase(cache, n, rot, gen)
            ceiling_s = median(copy_ceiling(payload, device=device, rotations=rot,
                                            warmup=opts["warmup"], reps=reps))
            for op in opts["ops"]:
                baseline_s = called_baseline_s = None
                for backend in backends:
                    ctas_list = [None] if backend == "torch" or device.type == "cpu" else opts["max_ctas"]
                    for max_ctas in ctas_list:
                        if opts.get("threads"):  # numba's OpenMP resets torch's count
                            torch.set_num_threads(opts["threads"])
                        try:
                            ok = case.verify(op, backend, max_ctas)
                            times = time_calls(case.fns(op, backend, max_ctas), device=device,
                                               warmup=opts["warmup"], reps=reps)
                            per_batch = calls_per_batch(median(times))
                            called = time_as_called(
                                case.fns(op, backend, max_ctas, as_called=True), device=device,
                                calls=per_batch, batches=min(5, reps), warmup=opts["warmup"])
                            check_errors()
                        except Exception as exc:  # noqa: BLE001 - one backend's failure is reported, not fatal
                            skipped.append({"op": op, "backend": backend, "layout": layout,
                                            "dtype": dtype, "tokens": tokens, "max_ctas": max_ctas,
                                            "reason": f"{type(exc).__name__}: {exc}"})
                            continue
                        if not ok:
                            print(f"kernels: {backend} {op} {layout} {dtype} {tokens} tokens differs "
                                  f"from the torch reference", file=sys.stderr)
                        if backend == "torch":
                            baseline_s, called_baseline_s = median(times), median(called)
                        rows.append(make_row(
                            env, op=op, backend=backend, spec=spec, tokens=tokens, blocks=n,
                            payload_bytes=payload, times_s=times, ceiling_s=ceiling_s,
                            baseline_s=baseline_s, seed=opts["seed"], max_ctas=max_ctas,
                            verified=ok, rotations=rot, cold=rot * payload > llc,
                            **as_called_fields(called, payload, ceiling_s, called_baseline_s,
                                               calls=per_batch),
                            config={"num_blocks": opts["num_blocks"], "reps": reps,
                                    "warmup": opts["warmup"], "device": str(device),
                                    "llc_bytes": llc, "preset": opts.get("preset")}))
                bar.update(1)
            del case
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows, skipped


def format_table(rows: list[dict]) -> str:
    """Compact text table: op, backend, layout, dtype, tokens, max_ctas, then as called (GB/s,
    ratio to the same-run ceiling, speed-up over torch) and device time (GB/s, ratio)."""
    w = max([8] + [len(r["op"]) for r in rows])  # 8, or the digest ops' names
    head = f"{'op':{w}} {'backend':10} {'layout':6} {'dtype':14} {'tokens':>7} {'ctas':>5} " \
           f"{'called GB/s':>11} {'ratio':>6} {'xtorch':>7} {'device GB/s':>11} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(f"{r['op']:{w}} {r['backend']:10} {r['layout']:6} {r['dtype']:14} "
                     f"{r['tokens']:>7} {fmt(r.get('max_ctas'), 'd'):>5} "
                     f"{fmt(r.get('as_called_gbps'), '.2f'):>11} {fmt(r.get('as_called_ratio'), '.2f'):>6} "
                     f"{fmt(r.get('as_called_baseline_ratio'), '.2f'):>7} "
                     f"{fmt(r['gbps'], '.2f'):>11} {fmt(r['ratio'], '.2f'):>6}"
                     + ("" if r.get("verified", True) else "  MISMATCH"))
    return "\n".join(lines)


def load_plugin(ref: str) -> None:
    """Import ``ref`` (a .py file or a module name) so it can register backends."""
    if ref.endswith(".py"):
        path = Path(ref)
        if not path.is_file():
            raise SystemExit(f"--plugin {ref!r}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(ref)


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p)
    p.add_argument("--ops", type=cli.csv(), help="comma list of gather,scatter,copy and "
                   "gather+digest,scatter+digest,copy+digest (digest=, --kv-verify)")
    p.add_argument("--backends", type=cli.csv(), help="comma list (default: every available one)")
    p.add_argument("--layouts", type=cli.csv(), help="comma list of NHD,HND,MLA")
    p.add_argument("--dtypes", type=cli.csv(), help="comma list, e.g. bfloat16,float8_e4m3fn")
    p.add_argument("--tokens", type=cli.tokens, help="request sizes in tokens, e.g. 16,1K,64K")
    for name, val in LLAMA3_8B.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=val,
                       help=f"cache geometry (default {val}, Llama-3-8B)")
    p.add_argument("--mla-dim", type=int, default=MLA_DIM, help=f"MLA latent width (default {MLA_DIM})")
    p.add_argument("--num-blocks", type=int, help="blocks in the cache (quick 24, full 4096)")
    p.add_argument("--warmup", type=int, help="untimed calls per case")
    p.add_argument("--reps", type=int, help="timed calls per case (fewer above 1 GiB)")
    p.add_argument("--max-ctas", type=cli.csv(int), help="GPU grid caps, e.g. none,32")
    p.add_argument("--plugin", action="append", default=[],
                   help="a .py file or module to import first (e.g. one that registers a backend)")
    p.add_argument("--contention", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the SM-contention study (GPU only; on in --full)")


def run(args) -> int:
    from .presets import preset
    from .schema import env_info
    for ref in args.plugin:
        load_plugin(ref)
    opts = cli.resolve(args, "kernels")
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = run_kernels(opts, env, progress=not args.no_progress)
    print(format_table(rows))
    for s in skipped:
        print("skipped:", ", ".join(f"{k}={v}" for k, v in s.items()), file=sys.stderr)
    if opts["contention"]:
        from . import contention
        reason = contention.skip_reason(opts["device"])
        if reason:
            print(f"contention: skipped: {reason}", file=sys.stderr)
        else:
            copts = dict(preset("contention", opts["preset"]), **{
                k: opts[k] for k in ("device", "seed", "backends", "mla_dim", "num_layers",
                                     "num_kv_heads", "head_dim", "block_size")})
            crows = contention.run_contention(copts, env, rows)  # each row saved as measured
            print(contention.format_table(crows))
    print(f"kernels: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    cli.finish(args, opts, env, rows, {"skipped": skipped}, t0=t0)
    return 0
