"""Load generator: drive a running server (``--url``) or one it starts
(``python -m kvflow.serve --mode M`` as a subprocess), for one mode or disagg vs colocated
(``--compare``), at one or several request rates; one row per (mode, rate).

Each mode is started ``--starts`` times (default 2, modes interleaved) and a row pools every
start. Each load step (start, mode, rate) is saved as a row as soon as it is measured, and the
first SIGINT or SIGTERM stops the study with those rows and stops the server it started
(:func:`run_serve`). Rows are :func:`kvflow.bench.schema.make_row` rows with ``op="serve"``,
``backend`` = the mode, ``time_s`` = the median E2E latency, plus the keys of
:func:`kvflow.bench.loadgen.summarize`,
the per-request ``ttft_ms`` / ``tpot_ms`` lists (for the CDF plots of the report), ``hops_ms``
(the per-hop medians) and every response's ``kvflow``. The printed headline is
TTFT(disagg) / TTFT(colocated) with the time to the second token (TTST) and the per-hop
breakdown (:mod:`kvflow.bench.hops`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from . import cli, loadgen, serve_mix
from .record import sink_of
from .schema import make_row
from .server import started_server


def add_arguments(p) -> None:
    """The ``serve`` study's flags."""
    cli.add_common(p, device=False)
    p.add_argument("--url", help="a running server (default: start python -m kvflow.serve)")
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg",
                   help="server mode to start (ignored with --url)")
    p.add_argument("--compare", action="store_true", help="run disagg and colocated side by side")
    p.add_argument("--server-args", default="", help="extra flags for python -m kvflow.serve, e.g. '--kv-connector tcp'")
    p.add_argument("--server-timeout", type=float, default=120.0, help="seconds to wait for /health")
    p.add_argument("--starts", type=int, default=2,
                   help="server starts per mode, modes interleaved (ignored with --url); the "
                        "rows pool every start")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--rate", type=lambda s: [float(x) for x in s.split(",")],
                   help="requests/s (comma list sweeps; inf = all at once)")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--prompt-len", help="tokens: N or A:B (uniform)")
    p.add_argument("--output-len", help="tokens: N or A:B (uniform)")
    p.add_argument("--dataset", help="JSON list of {prompt, max_tokens} (overrides the lengths)")
    p.add_argument("--concurrency", type=int, help="most requests in flight")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO for goodput (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT SLO for goodput (ms)")
    p.add_argument("--model", default="kvflow-tiny", help="model name sent in each request")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--device-name", help="device label of the rows (default: this host's CPU)")
    serve_mix.add_arguments(p)


def measure(url: str, opts: dict[str, Any], rate: float, progress: bool = True) -> dict[str, Any]:
    """Run one load at ``rate`` against ``url``; returns summary, per-request lists, results."""
    work = loadgen.build_workload(opts["num_requests"], opts["prompt_len"], opts["output_len"],
                                  seed=opts["seed"], dataset=opts.get("dataset"))
    offsets = loadgen.arrival_offsets(len(work), rate, opts["arrival"], opts["seed"])
    bar = cli.progress(len(work), f"serve {rate} req/s", progress)
    running = None
    if opts.get("mix_decodes"):
        results, dur, running = serve_mix.measure_mixed(url, opts, work, offsets,
                                                        on_done=lambda r: bar.update(1))
    else:
        results, dur = asyncio.run(loadgen.run_load(
            url, work, offsets, model=opts["model"], concurrency=opts["concurrency"],
            timeout=opts["request_timeout"], on_done=lambda r: bar.update(1)))
    bar.close()
    summary = loadgen.summarize(results, dur, slo_ttft_ms=opts["slo_ttft_ms"],
                                slo_tpot_ms=opts["slo_tpot_ms"])
    return {"summary": summary, "results": results, "duration_s": dur, "running": running}


def run_serve(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> list[dict]:
    """Rows for every (mode, rate) asked for, each pooled over ``starts`` server starts (one
    with ``url``); see the module docstring.

    Each load step (one server start, mode and rate) is a row saved as it is measured
    (:mod:`kvflow.bench.record`; ``start``: which server start, from 1); where steps share a
    (mode, rate), the rows returned (and the complete result file) pool them instead
    (``start`` None, ``starts`` = the server starts pooled). A study stopped by a signal keeps the step
    rows measured before it, and the server it started is stopped."""
    modes = ["disagg", "colocated"] if opts.get("compare") else [opts["mode"]]
    rates = opts["rate"] if isinstance(opts["rate"], list) else [opts["rate"]]
    own = not (opts.get("url") and not opts.get("compare"))
    starts = int(opts.get("starts") or 2) if own else 1
    if starts < 1:
        raise SystemExit(f"serve: --starts must be >= 1, got {starts}")
    serve_mix.check(opts)
    rows = cli.rows(env, opts)
    got: dict[tuple[str, float], list] = {}
    for start in range(1, starts + 1):
        for mode in modes:
            ctx = started_server(mode, opts.get("server_args", ""), opts["server_timeout"]) \
                if own else contextlib.nullcontext(opts["url"])
            with ctx as url:
                for rate in rates:
                    m = dict(measure(url, opts, rate, progress), start=start)
                    got.setdefault((mode, rate), []).append(m)
                    rows.append(_row(env, opts, mode, rate, m["summary"], m["results"], 1, start,
                                     m["running"]))
    if all(len(ms) == 1 for ms in got.values()):
        return rows
    pooled = []
    for (mode, rate), ms in got.items():
        results = [r for m in ms for r in m["results"]]
        summary = loadgen.summarize(results, sum(m["duration_s"] for m in ms),
                                    slo_ttft_ms=opts["slo_ttft_ms"], slo_tpot_ms=opts["slo_tpot_ms"])
        running = None if ms[0]["running"] is None else {
            k: [r for m in ms for r in m["running"][k]] for k in ("alone", "beside")}
        pooled.append(_row(env, opts, mode, rate, summary, results,
                           len({m["start"] for m in ms}), running=running))
    sink = sink_of(rows)
    if sink is None:
        return pooled
    sink.settle(pooled)
    return sink


def _row(env, opts, mode, rate, summary, results, starts: int = 1,
         start: int | None = None, running: dict | None = None) -> dict:
    from .hops import hop_medians
    ok = [r for r in results if r.ok]
    moved = [r.kvflow for r in ok if r.kvflow]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens]
    return make_row(
        env, op="serve", backend=mode, spec=None,
        tokens=round(sum(prompt) / len(prompt)) if prompt else 0, blocks=0,
        payload_bytes=sum(int(k.get("payload_bytes") or 0) for k in moved),
        times_s=[r.e2e_s for r in ok] or [0.0], ceiling_s=None, seed=opts["seed"],
        rate=None if math.isinf(rate) else rate, arrival=opts["arrival"], **summary,
        ttft_ms=[round(r.ttft_s * 1e3, 3) for r in ok],
        tpot_ms=[round(r.tpot_s * 1e3, 3) for r in ok if r.tpot_s is not None],
        transfer_ms=[k.get("transfer_ms") for k in moved if k.get("transfer_ms") is not None],
        hops_ms=hop_medians(moved), starts=starts, start=start, kvflow=moved,
        **(serve_mix.fields(running) if running else {}),
        config={k: opts.get(k) for k in ("num_requests", "prompt_len", "output_len", "dataset",
                                         "concurrency", "model", "server_args", "url",
                                         *serve_mix.KEYS)})


def format_table(rows: list[dict]) -> str:
    """Text table per (mode, rate): completed, TTFT/TPOT/ITL/E2E p50 and p99 (ms), goodput."""
    head = (f"{'mode':10} {'rate':>6} {'done':>5} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
            f"{'p99':>8} {'ITL p50':>8} {'E2E p50':>9} {'req/s':>6} {'goodput':>7}")
    lines = [head, "-" * len(head)]
    f = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:>{w}.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"{r['backend']:10} {f(r['rate'], 6)} {r['completed']:>5} "
                     f"{f(r['ttft_ms_p50'], 9)} {f(r['ttft_ms_p99'], 8)} {f(r['tpot_ms_p50'], 9)} "
                     f"{f(r['tpot_ms_p99'], 8)} {f(r['itl_ms_p50'], 8)} {f(r['e2e_ms_p50'], 9)} "
                     f"{f(r['throughput_rps'], 6)} {f(r['goodput_rps'], 7)}")
    for r in rows:
        for e in r.get("errors") or []:
            lines.append(f"  {r['backend']} error: {e}")
    return "\n".join(lines)


def format_hops(rows: list[dict]) -> str:
    """Headline TTFT(disagg) / TTFT(colocated) and TTST per rate, with the per-hop breakdown
    (:func:`kvflow.bench.hops.report`)."""
    from .hops import report
    groups = [{"rate": "inf" if r["rate"] is None else r["rate"], "mode": r["backend"],
               "kvflows": r.get("kvflow") or [], "starts": r.get("starts", 1)} for r in rows]
    return report(groups, key="rate")


def run(args) -> int:
    from .schema import env_info
    cli.require("httpx", "serve")
    opts = cli.resolve(args, "serve")
    env = env_info("cpu")
    env["device"] = opts.get("device_name") or env["device"]
    t0 = time.perf_counter()
    rows = run_serve(opts, env, progress=not args.no_progress)
    print(format_table(rows))
    print(format_hops(rows))
    if serve_mix.format_running(rows):
        print(serve_mix.format_running(rows))
    cli.finish(args, opts, env, rows, t0=t0)
    return 0
