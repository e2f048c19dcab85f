"""``python -m kvflow.bench <study>``: one command per study, one result schema.

Studies (``--help`` on each; none needs a GPU package to print it):

- ``kernels``: gather / scatter / copy sweep vs torch and the same-run ``copy_`` ceiling
  (plus the SM-contention study on a GPU);
- ``calls``: host microseconds per call of each op, back to back with no sync inside (default
  arguments, ``validate=False``, host ids, torch, a bare Triton launch, a CUDA-graph replay);
- ``reblock``: copy_sequence between P and D caches of different specs (block size, layout,
  fp8) vs the same-run ``copy_`` ceiling of the bytes written (and read);
- ``sweep``: launch settings of the Triton copy kernel, repeated and interleaved (GPU);
- ``layerwise``: per-layer copies beside a Llama-3-8B-shaped prefill: how much hides;
- ``ipc``: P->D copies between two GPUs (pull, push, per-layer torch, per-block loops,
  cross-process) and the served modes on two GPUs;
- ``transfer``: a connector's P half to its D half per request size, vs its ceiling;
- ``serve``: load generator against a server: TTFT, TPOT, ITL, E2E, goodput;
- ``soak``: minutes of concurrent clients with aborts: leaks, hangs, restarts;
- ``report``: docs/benchmarks.md and docs/img/*.png from the result files.

Every study writes ``<out-dir>/<name>-<device>-<date>.json`` (:mod:`kvflow.bench.schema`)
holding the command line that made it; rows are saved as they are measured, and the first
SIGINT or SIGTERM stops the study with the rows it has (:mod:`kvflow.bench.record`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: study -> (module of kvflow.bench, one-line help). Each module has ``add_arguments(parser)``
#: and ``run(args) -> int`` and imports no torch, numba or triton at import time (``--help`` and
#: flag refusals come before them; tests/bench/test_bench_interrupt.py checks it).
STUDIES = {
    "kernels": ("kernels", "gather/scatter/copy sweep vs torch and the copy_ ceiling"),
    "calls": ("calls", "host time per call of gather/scatter/copy (no sync inside)"),
    "reblock": ("reblock", "copy_sequence between different P and D specs vs the copy_ ceiling"),
    "sweep": ("sweep", "launch settings of the triton copy kernel (GPU)"),
    "layerwise": ("layerwise", "per-layer copies beside a prefill: the hidden fraction"),
    "interference": ("interference", "decode TPOT and prefill time beside KV copies, per backend"),
    "ipc": ("ipc", "P->D copies between two GPUs, and the served modes on two GPUs"),
    "transfer": ("transfer", "a connector's P->D move per request size vs its ceiling"),
    "serve": ("serve", "load generator: TTFT, TPOT, ITL, E2E, throughput, goodput"),
    "soak": ("soak", "minutes of concurrent clients with aborts: leaks, hangs, restarts"),
    "report": ("report", "docs/benchmarks.md and docs/img/*.png from result files"),
}


def _module(study: str):
    return importlib.import_module(f"kvflow.bench.{STUDIES[study][0]}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvflow.bench",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="study", required=True, metavar="STUDY")
    for name, (_, text) in STUDIES.items():
        mod = _module(name)
        p = sub.add_parser(name, help=text, description=(mod.__doc__ or text).split("\n\n")[0])
        mod.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    from .record import run_study
    return run_study(args, _module(args.study).run)


if __name__ == "__main__":
    rc = main()
    if rc in (130, 143):  # stopped by a signal: no interpreter teardown (~30 s at load 10)
        from .record import exit_fast
        exit_fast(rc)
    sys.exit(rc)
