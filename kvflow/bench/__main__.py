"""``python -m kvflow.bench``: one command per figure.

Subcommands (``--help`` on each): ``kernels`` (op x backend x layout x dtype x tokens sweep, plus
the SM-contention study on a GPU), ``transfer`` (ipc / tcp connectors and the loopback ceiling),
``layerwise`` (the overlap study of bench/layerwise_gpu.py), ``serve`` (load generator: TTFT,
TPOT, ITL, E2E, goodput) and ``report`` (docs/benchmarks.md and docs/img/*.png from result files).
Every run writes ``<out-dir>/<name>-<device>-<date>.json`` (schema: :mod:`kvflow.bench.schema`)
holding the command line that made it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from . import presets


def _csv(kind=str):
    def parse(text: str) -> list:
        out = []
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            if kind is int and item.lower() in ("none", "0"):
                out.append(None)
                continue
            try:
                out.append(kind(item))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a {kind.__name__}")
        return out
    return parse


def _tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        mult = 1024 if item.endswith("K") else 1
        try:
            out.append(int(item.rstrip("K")) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tokens: {item!r} is not a token count (e.g. 16,1K,64K)")
    return out


def _common(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="preset", action="store_const", const="quick",
                   help="small CPU preset (< 60 s on 2 cores; what CI runs); the default")
    g.add_argument("--full", dest="preset", action="store_const", const="full",
                   help="the H200 preset (minutes)")
    if device:
        p.add_argument("--device", default=None,
                       help="'cuda' or 'cpu' (default: cuda if available, else cpu)")
        p.add_argument("--threads", type=int,
                       help="CPU threads for torch and numba alike (default: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of block ids and data (default 0)")
    p.add_argument("--out-dir", default="bench/results", help="folder of result files")
    p.add_argument("--name", default=None, help="result file prefix (default: the subcommand)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _load_plugin(ref: str) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvflow.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="gather/scatter/copy sweep vs torch and the copy_ ceiling")
    _common(k)
    k.add_argument("--ops", type=_csv(), help="comma list of gather,scatter,copy")
    k.add_argument("--backends", type=_csv(), help="comma list (default: every available one)")
    k.add_argument("--layouts", type=_csv(), help="comma list of NHD,HND,MLA")
    k.add_argument("--dtypes", type=_csv(), help="comma list, e.g. bfloat16,float8_e4m3fn")
    k.add_argument("--tokens", type=_tokens, help="request sizes in tokens, e.g. 16,1K,64K")
    for name, val in presets.LLAMA3_8B.items():
        k.add_argument("--" + name.replace("_", "-"), type=int, default=val,
                       help=f"cache geometry (default {val}, Llama-3-8B)")
    k.add_argument("--mla-dim", type=int, default=576, help="MLA latent width (default 576)")
    k.add_argument("--num-blocks", type=int, help="blocks in the cache (quick 24, full 4096)")
    k.add_argument("--warmup", type=int, help="untimed calls per case")
    k.add_argument("--reps", type=int, help="timed calls per case (fewer above 1 GiB)")
    k.add_argument("--max-ctas", type=_csv(int), help="GPU grid caps, e.g. none,32")
    k.add_argument("--plugin", action="append", default=[],
                   help="a .py file or module to import first (e.g. one that registers a backend)")
    k.add_argument("--contention", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the SM-contention study (GPU only; on in --full)")

    t = sub.add_parser("transfer", help="ipc / tcp connectors: GB/s, latency p50/p99, loopback ceiling")
    _common(t)
    t.add_argument("--connectors", type=_csv(), help="comma list of ipc,tcp")
    t.add_argument("--tokens", type=_tokens, help="request sizes in tokens")
    t.add_argument("--num-blocks", type=int)
    t.add_argument("--warmup", type=int)
    t.add_argument("--reps", type=int)

    sub.add_parser("layerwise", add_help=False,  # --help goes to the study's own parser
                   help="overlap study (runs bench/layerwise_gpu.py; --quick = its --smoke CPU "
                        "run, --full = the H200 run; other flags go to the study)")

    s = sub.add_parser("serve", help="load generator: TTFT, TPOT, ITL, E2E, throughput, goodput")
    _common(s, device=False)
    from .serving import add_arguments
    add_arguments(s)

    r = sub.add_parser("report", help="write docs/benchmarks.md and docs/img/*.png from result files")
    r.add_argument("files", nargs="*", help="result JSON files (default: <results>/*.json)")
    r.add_argument("--results", default="bench/results", help="folder read when no files given")
    r.add_argument("--out", default="docs/benchmarks.md", help="markdown file to write")
    r.add_argument("--img-dir", default="docs/img", help="folder of the PNG plots")
    return ap


def _resolve(args: argparse.Namespace, command: str) -> dict[str, Any]:
    import torch
    opts = presets.preset(command, args.preset)
    for key, val in vars(args).items():
        if key.startswith("_"):
            continue
        if val is not None or key not in opts:
            opts[key] = val
    opts["preset"] = args.preset or "quick"
    if "device" in opts and opts["device"] is None:
        opts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.get("threads"):
        _set_threads(opts["threads"])
    return opts


def _finish(args, opts: dict, env: dict, rows: list, extra_env: dict | None = None) -> Path:
    from .schema import command_line, result_path, write_results
    env = dict(env, command=command_line(getattr(args, "_argv", None)),
               kind=args.command, options=opts, **(extra_env or {}))
    path = write_results(result_path(args.out_dir, args.name or args.command, env), env, rows)
    print(f"wrote {path} ({len(rows)} rows)")
    return path


def _set_threads(n: int) -> None:
    """Same CPU thread count for torch and numba (a fair CPU comparison; also avoids OpenMP
    spin-waiting when other processes share the cores)."""
    import torch
    torch.set_num_threads(n)
    try:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def cmd_kernels(args) -> int:
    from . import contention, kernels
    from .schema import env_info
    for ref in args.plugin:
        _load_plugin(ref)
    opts = _resolve(args, "kernels")
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = kernels.run_kernels(opts, env, progress=not args.no_progress)
    print(kernels.format_table(rows))
    for s in skipped:
        print("skipped:", ", ".join(f"{k}={v}" for k, v in s.items()), file=sys.stderr)
    if opts["contention"]:
        reason = contention.skip_reason(opts["device"])
        if reason:
            print(f"contention: skipped: {reason}", file=sys.stderr)
        else:
            copts = dict(presets.preset("contention", opts["preset"]), **{
                k: opts[k] for k in ("device", "seed", "backends", "mla_dim", "num_layers",
                                     "num_kv_heads", "head_dim", "block_size")})
            crows = contention.run_contention(copts, env)
            print(contention.format_table(crows))
            rows += crows
    wall = time.perf_counter() - t0
    print(f"kernels: {len(rows)} rows in {wall:.1f} s")
    _finish(args, opts, env, rows, {"skipped": skipped, "wall_s": wall})
    return 0


def cmd_transfer(args) -> int:
    from . import transfer
    from .schema import env_info
    opts = _resolve(args, "transfer")
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = transfer.run_transfer(opts, env, progress=not args.no_progress)
    print(transfer.format_table(rows))
    for s in skipped:
        print(f"transfer: skipped {s['connector']}: {s['reason']}", file=sys.stderr)
    _finish(args, opts, env, rows, {"skipped": skipped, "wall_s": time.perf_counter() - t0})
    return 0


def cmd_layerwise(args) -> int:
    path = Path(__file__).resolve().parents[2] / "bench" / "layerwise_gpu.py"
    if not path.is_file():
        print(f"layerwise: skipped: the study {path} is not in this checkout", file=sys.stderr)
        return 0
    spec = importlib.util.spec_from_file_location("kvflow_layerwise_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "main"):
        print(f"layerwise: skipped: {path} has no main(argv)", file=sys.stderr)
        return 0
    from .schema import command_line, write_results
    cmd = command_line(getattr(args, "_argv", None))
    # Record the command in the study's result file, as every other subcommand does.
    mod.write_results = lambda path, env, rows: write_results(
        path, dict(env, command=cmd, kind="layerwise"), rows)
    argv = [{"--quick": "--smoke"}.get(a, a) for a in args.args if a not in ("--", "--full")]
    return int(mod.main(argv) or 0)


def cmd_serve(args) -> int:
    from . import serving
    from .schema import env_info
    opts = _resolve(args, "serve")
    env = env_info("cpu")
    env["device"] = opts.get("device_name") or env["device"]
    rows = serving.run_serve(opts, env, progress=not args.no_progress)
    print(serving.format_table(rows))
    _finish(args, opts, env, rows)
    return 0


def cmd_report(args) -> int:
    from . import report
    files = [Path(f) for f in args.files] or sorted(Path(args.results).glob("*.json"))
    if not files:
        print(f"report: no result files in {args.results}", file=sys.stderr)
        return 1
    out = report.write_report(files, Path(args.out), Path(args.img_dir))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra and args.command != "layerwise":
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "layerwise":
        args.args = extra  # every flag goes to the study (python bench/layerwise_gpu.py --help)
    args._argv = argv
    return {"kernels": cmd_kernels, "transfer": cmd_transfer, "layerwise": cmd_layerwise,
            "serve": cmd_serve, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
