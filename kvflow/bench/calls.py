"""Host time per call: what issuing one gather / scatter / copy_blocks costs the calling thread.

Each case issues ``--calls`` calls back to back from Python with no sync inside, ``--repeats``
times; the figure is the wall clock of the issuing loop divided by the calls (microseconds per
call; median, p10 / p90 over the repeats). The payload is tiny (default: 32 layers as
Llama-3-8B, 1 KV head, head_dim 16, block 16, bf16, 2 blocks: 64 KiB), so on a GPU the device
finishes each call before the host issues the next and the loop measures the host; a case where
the device queue was the limit anyway (more than 10 calls, and 50 us, still queued when the loop
ended: ``drain_us``) is marked ``queue_bound``. On a CPU the call does its copy on the calling
thread, so its host time includes the (small) copy.

Cases per op and backend (``triton`` on CUDA, ``numba`` on a CPU; ``--backends``): default
arguments (ids as tensors on the cache's device), ``validate=False``, host ids (a CPU tensor for a
GPU cache; a Python list on a CPU); the torch backend (per-layer ``index_select`` /
``index_copy_``) with default arguments. References: one ``dst.copy_(src)`` of the payload, a
bare launch of a trivial Triton kernel (CUDA), and the replay of one gather captured in a CUDA
graph (``torch.cuda.graph``; default arguments, else ``validate=False``; skipped with the
reason when capture fails). docs/design.md, "Measuring".
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any, Callable

from . import cli
from .cases import make_spec, scramble

#: Default geometry: Llama-3-8B's 32 layers (the per-layer work of a wrapper or of the torch
#: baseline scales with them), tiny blocks (the copy itself must not be what is timed).
GEOMETRY = {"num_layers": 32, "num_kv_heads": 1, "head_dim": 16, "block_size": 16}
OPS = ("gather", "scatter", "copy")


def issue(fn: Callable[[], object], calls: int, device) -> tuple[float, float]:
    """(host seconds per call, drain seconds): ``calls`` back-to-back calls of ``fn`` timed with
    ``time.perf_counter`` after a device sync, then the time the final sync took (CUDA)."""
    import torch
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    return (t1 - t0) / calls, time.perf_counter() - t1


def capture_graph(call: Callable[[], object], device) -> Callable[[], object]:
    """``call`` captured once in a CUDA graph (warmed up on a side stream, as torch's docs
    ask); returns the graph's ``replay``. Raises whatever capture raises."""
    import torch
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize(device)
    return graph.replay


def cases(opts: dict, device, skipped: list) -> list[tuple[dict, Callable[[], object]]]:
    """(row fields, call) of every case on ``device``; a case that cannot run is appended to
    ``skipped`` with its reason."""
    import torch

    from kvflow.cache import PagedKVCache, staging_buffer
    from kvflow.kernels import copy_blocks, gather_blocks, scatter_blocks
    from kvflow.kernels.registry import get_backend
    geometry = {k: opts[k] for k in GEOMETRY}
    spec = make_spec(geometry, "NHD", opts["dtype"])
    n = spec.num_blocks_for(opts["tokens"])
    cache = PagedKVCache(spec, max(64, 4 * n), device)
    scramble(cache.buffer)
    ids = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(opts["seed"]))
    src, dst = ids[:n].to(device), ids[n:2 * n].to(device)
    buf = scramble(staging_buffer(spec, n, device=device))
    other = PagedKVCache(spec, cache.num_blocks, device)  # copy_blocks' destination: P -> D
    # each case is one C-level partial of the op: no Python frame between the loop and the op
    ops = {"gather": lambda s, d, **kw: functools.partial(gather_blocks, cache, s, buf, **kw),
           "scatter": lambda s, d, **kw: functools.partial(scatter_blocks, buf, cache, s, **kw),
           "copy": lambda s, d, **kw: functools.partial(copy_blocks, cache, other, s, d, **kw)}
    # host ids: a CPU tensor for a GPU cache (the wrapper copies it over), a list on a CPU
    host = {"cuda": lambda t: t.cpu(), "cpu": lambda t: t.tolist()}[device.type]
    hsrc, hdst = host(src), host(dst)
    auto = get_backend("auto", device).name
    out: list[tuple[dict, Callable[[], object]]] = []
    base = {"spec": spec, "tokens": opts["tokens"], "blocks": n}
    for op in opts["ops"]:
        f = ops[op]
        for backend in opts["backends"]:
            kw = {} if backend == auto else {"backend": backend}
            args = "defaults" if not kw else f"backend={backend!r}"
            out.append((dict(base, op=op, backend=backend, call=args, ids="device tensor"),
                        f(src, dst, **kw)))
            if backend == "torch":
                continue
            out.append((dict(base, op=op, backend=backend, call=args + ", validate=False",
                             ids="device tensor"), f(src, dst, validate=False, **kw)))
            out.append((dict(base, op=op, backend=backend, call=args,
                             ids="host tensor" if device.type == "cuda" else "Python list"),
                        f(hsrc, hdst, **kw)))
    if "copy" in opts["ops"]:  # within one cache: a second, stamping launch checks the pairs
        be = next((b for b in opts["backends"] if b != "torch"), auto)
        kw = {} if be == auto else {"backend": be}
        out.append((dict(base, op="copy", backend=be, call=("defaults" if not kw else
                                                              f"backend={be!r}") + ", one cache",
                         ids="device tensor"),
                    functools.partial(copy_blocks, cache, cache, src, dst, **kw)))
    a = torch.empty(spec.bytes_per_block * n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    out.append((dict(base, op="copy_", backend="torch", call="dst.copy_(src), payload bytes",
                     ids="-"), lambda: b.copy_(a)))
    if device.type != "cuda":
        skipped += [{"case": c, "reason": f"needs a CUDA device; device is {device}"}
                    for c in ("bare triton launch", "cuda graph replay")]
        return out
    try:
        from .noop_kernel import bare_launch
        x = torch.zeros(128, device=device)
        out.append((dict(base, op="launch", backend="triton", call="trivial kernel, grid (1,)",
                         ids="-", blocks=0, tokens=0), bare_launch(x)))
    except ImportError as exc:
        skipped.append({"case": "bare triton launch", "reason": f"ImportError: {exc}"})
    gpu = next((b for b in opts["backends"] if b != "torch"), None)
    reasons = []
    for extra in ({}, {"validate": False}) if gpu else ():
        kw = dict(extra, **({} if gpu == auto else {"backend": gpu}))
        try:
            replay = capture_graph(ops["gather"](src, dst, **kw), device)
        except Exception as exc:  # noqa: BLE001 - a capture that fails is reported, not fatal
            first = (str(exc).strip().splitlines() or [""])[0]
            reasons.append(f"{kw or 'defaults'}: {type(exc).__name__}: {first}")
            try:
                torch.cuda.synchronize(device)
            except Exception:  # noqa: BLE001 - the capture's own error is the one reported
                pass
            continue
        call = "graph.replay() of gather(" + (", ".join(f"{k}={v!r}" for k, v in kw.items()) or
                                              "defaults") + ")"
        out.append((dict(base, op="gather", backend=gpu, call=call, ids="device tensor",
                         graph=True, capture_failures=reasons or None), replay))
        break
    else:
        skipped.append({"case": "cuda graph replay", "reason": "; ".join(reasons) or "no GPU backend"})
    return out


def run_calls(opts: dict[str, Any], env: dict[str, Any], progress: bool = True) -> tuple[list, list]:
    """Time every case of :func:`cases`; returns (rows, skipped). Each row is a
    :func:`kvflow.bench.schema.make_row` row whose times are host seconds per call (``gbps``,
    ``ratio`` are None: no bandwidth is measured) plus ``host_us``, ``host_us_p10``,
    ``host_us_p90`` (microseconds per call), ``calls``, ``repeats``, ``call``, ``ids``,
    ``drain_us``, ``queue_bound``."""
    import torch

    from .kernel_case import check_errors
    from .schema import make_row
    from .timing import median, percentile
    device = torch.device(opts["device"])
    skipped: list = []
    todo = cases(opts, device, skipped)
    bar = cli.progress(len(todo), "calls", progress)
    rows = cli.rows(env, opts)
    for fields, fn in todo:
        if opts.get("threads"):  # numba's OpenMP resets torch's count
            torch.set_num_threads(opts["threads"])
        try:
            issue(fn, opts["warmup"], device)
            got = [issue(fn, opts["calls"], device) for _ in range(opts["repeats"])]
            check_errors()
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, not fatal
            skipped.append({**{k: v for k, v in fields.items() if k != "spec"},
                            "reason": f"{type(exc).__name__}: {exc}"})
            bar.update(1)
            continue
        per = [h for h, _ in got]
        host_s, drain_s = median(per), median([d for _, d in got])
        spec = fields.pop("spec")
        row = make_row(env, spec=spec, payload_bytes=fields["blocks"] * spec.bytes_per_block,
                       times_s=per, ceiling_s=None, seed=opts["seed"],
                       config={k: opts[k] for k in ("calls", "repeats", "warmup", "device")},
                       **fields)
        row.update(gbps=None, host_us=host_s * 1e6, host_us_p10=percentile(per, 0.1) * 1e6,
                   host_us_p90=percentile(per, 0.9) * 1e6, calls=opts["calls"],
                   repeats=opts["repeats"], drain_us=drain_s * 1e6,
                   queue_bound=drain_s > max(50e-6, 10 * host_s))
        rows.append(row)
        bar.update(1)
    bar.close()
    return rows, skipped


def _case_name(r: dict) -> str:
    return f"{r['call']}" + (" (graph)" if r.get("graph") else "")


def format_table(rows: list[dict]) -> str:
    """Text table: op, backend, call, ids, host microseconds per call (p10, p90), drain."""
    head = f"{'op':8} {'backend':8} {'call':44} {'ids':14} {'us/call':>8} {'p10':>8} {'p90':>8} {'drain us':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:8} {r['backend']:8} {_case_name(r)[:44]:44} {r['ids']:14} "
                     f"{r['host_us']:8.2f} {r['host_us_p10']:8.2f} {r['host_us_p90']:8.2f} "
                     f"{r['drain_us']:9.1f}" + ("  QUEUE-BOUND" if r["queue_bound"] else ""))
    return "\n".join(lines)


def calls_table(rows: list[dict]) -> list[str]:
    """Markdown of the study's rows (the report's section of a ``calls`` result file)."""
    from .kernel_report import md_table
    r0 = rows[0]
    body = [[r["op"], r["backend"], f"`{r['call']}`", r["ids"],
             f"{r['host_us']:.2f} ({r['host_us_p10']:.2f}–{r['host_us_p90']:.2f})",
             f"{r['calls']} x {r['repeats']}", "yes" if r["queue_bound"] else "no"] for r in rows]
    payload = max(r["payload_bytes"] for r in rows)
    return ([f"**Host time per call**: wall clock of back-to-back calls with no sync inside, "
             f"divided by the calls; median (p10–p90) over the repeats, microseconds. Payload "
             f"{payload / 1024:g} KiB ({r0['geometry']}, {r0['dtype']}): small, so the device "
             f"queue is not the limit (`queue-bound` says where it was anyway).", ""]
            + md_table(["op", "backend", "call", "ids", "host us per call", "calls", "queue-bound"],
                       body))


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p)
    p.add_argument("--ops", type=cli.csv(), help="comma list of gather,scatter,copy (default: all)")
    p.add_argument("--backends", type=cli.csv(),
                   help="comma list (default: triton,torch on CUDA; numba,torch on a CPU)")
    p.add_argument("--calls", type=int, help="calls per timed loop (quick 300, full 2000)")
    p.add_argument("--repeats", type=int, help="timed loops per case (quick 3, full 5)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 20)")
    p.add_argument("--tokens", type=int, help="tokens per call (default 32: 2 blocks of 16)")
    p.add_argument("--dtype", help="cache dtype (default bfloat16)")
    for name, val in GEOMETRY.items():
        p.add_argument("--" + name.replace("_", "-"), type=int,
                       help=f"cache geometry (default {val})")


def run(args) -> int:
    from .schema import env_info
    opts = cli.resolve(args, "calls")
    for name, val in GEOMETRY.items():
        opts[name] = opts.get(name) or val
    opts["ops"] = opts.get("ops") or list(OPS)
    unknown = sorted(set(opts["ops"]) - set(OPS))
    if unknown:
        raise SystemExit(f"kvflow.bench calls: --ops: unknown {','.join(unknown)}; known: {','.join(OPS)}")
    if not opts.get("backends"):
        opts["backends"] = ["triton" if opts["device"].startswith("cuda") else "numba", "torch"]
    env = env_info(opts["device"])
    t0 = time.perf_counter()
    rows, skipped = run_calls(opts, env, progress=not args.no_progress)
    print(format_table(rows))
    for s in skipped:
        print("skipped:", ", ".join(f"{k}={v}" for k, v in s.items()), file=sys.stderr)
    cli.finish(args, opts, env, rows, {"skipped": skipped}, t0=t0)
    return 0
