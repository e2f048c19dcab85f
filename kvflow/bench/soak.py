"""Soak of the served PD path: minutes of concurrent streaming clients, some closing early.

Starts ``python -m kvflow.serve`` (disagg, default connector, prefix caching, max_model_len
2304) unless ``--url`` names a running server, then keeps ``--clients`` concurrent clients busy
for ``--minutes``: prompts of 1..2048 tokens (byte tokenizer: one character = one token),
streaming, and about ``--abort-frac`` of requests closed by the client after a random delay.
Every ``--window-s`` seconds of load (and at its end) one ``op="soak_window"`` row is saved as
it is measured (:mod:`kvflow.bench.record`): the window's index and bounds (``t0_s``/``t1_s``,
seconds from the load's start), requests started in it, those that ended in it (ok, errors,
aborted, hung), requests in flight at its end, the p50/p99 TTFT and TPOT (ms) of its
completions, the blocks in use at its end (every instance's ``num_blocks - free_blocks``) and
the server restarts so far. The first SIGINT or SIGTERM stops the soak with the windows
measured and stops the server it started. After the load it drains, then writes the last row
(:mod:`kvflow.bench.schema`, ``op="soak"``) with:

- requests, ok, errors (HTTP status != 200 or an error event), aborted (closed on purpose);
- hung requests: no answer within ``--client-timeout-s``;
- leaked blocks: every instance's ``num_blocks - free_blocks`` from ``/health`` after the drain;
- server restarts: instance pids before vs after (a changed or missing pid counts one);
- p50/p99 TTFT and TPOT in ms of the completed requests (client side).

Pass = 0 leaked, 0 hung, 0 restarts, every request completed or got an error; the exit status
is 1 otherwise. ``--quick``: 8 clients, 12 s in 4 s windows, prompts <= 256 tokens, for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

from . import cli
from .timing import percentile

WORDS = ("prefill decode block cache layer token transfer lease abort paged attention "
         "head kernel copy gather scatter").split()


def make_prompt(rng: random.Random, n_tokens: int) -> str:
    """Text of exactly ``n_tokens - 1`` bytes (the byte tokenizer adds <bos>)."""
    out = []
    while sum(map(len, out)) < n_tokens:
        out.append(rng.choice(WORDS) + " ")
    return "".join(out)[: max(n_tokens - 1, 1)]


def pct(xs: list[float], q: float) -> float | None:
    """Percentile ``q`` of ``xs`` seconds, in ms (None when empty)."""
    if not xs:
        return None
    return round(percentile(xs, q) * 1e3, 2)


def note(stats: dict, status, text: str) -> None:
    """Count an error message (digits blanked, so ids and counts group together)."""
    key = f"{status}: " + "".join("#" if c.isdigit() else c for c in text)[:140]
    stats["messages"][key] = stats["messages"].get(key, 0) + 1


async def one(client, rng, stats, args) -> None:
    import httpx
    n = rng.randint(1, args.max_prompt)
    body = {"prompt": make_prompt(rng, n), "max_tokens": rng.randint(1, args.max_tokens),
            "stream": True, "ignore_eos": True}
    abort_after = rng.uniform(0.0, 3.0) if rng.random() < args.abort_frac else None
    t0 = time.monotonic()
    stats["requests"] += 1
    try:
        async with asyncio.timeout(args.client_timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    stats["errors"] += 1
                    stats["statuses"][str(r.status_code)] = stats["statuses"].get(str(r.status_code), 0) + 1
                    note(stats, r.status_code, r.text)
                    return
                first = last = None
                count = 0
                async for line in r.aiter_lines():
                    if abort_after is not None and time.monotonic() - t0 > abort_after:
                        stats["aborted"] += 1
                        return  # closing the stream aborts the request on the server
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        stats["errors"] += 1
                        note(stats, "stream", json.dumps(chunk["error"]))
                        return
                    now = time.monotonic()
                    first = first or now
                    last = now
                    count += len(chunk["choices"][0]["token_ids"])
                stats["ok"] += 1
                stats["ttft"].append(first - t0)
                if count > 1:
                    stats["tpot"].append((last - first) / (count - 1))
    except TimeoutError:
        stats["hung"] += 1
    except httpx.HTTPError as exc:
        stats["errors"] += 1
        stats["statuses"][type(exc).__name__] = stats["statuses"].get(type(exc).__name__, 0) + 1


def _counts(stats: dict) -> dict:
    return {k: stats[k] if isinstance(stats[k], int) else len(stats[k])
            for k in ("requests", "ok", "errors", "aborted", "hung", "ttft", "tpot")}


def window_fields(stats: dict, before: dict, health0: dict, health: dict) -> dict:
    """One window's fields from the cumulative ``stats`` now, the counts of :func:`_counts` at
    its start (``before``), and ``/health`` at the load's start and now (see the module doc)."""
    now = _counts(stats)
    ended = {k: now[k] - before[k] for k in ("ok", "errors", "aborted", "hung")}
    return {"requests": now["requests"] - before["requests"], **ended,
            "in_flight": now["requests"] - sum(now[k] for k in ("ok", "errors", "aborted", "hung")),
            "ttft_p50_ms": pct(stats["ttft"][before["ttft"]:], 0.5),
            "ttft_p99_ms": pct(stats["ttft"][before["ttft"]:], 0.99),
            "tpot_p50_ms": pct(stats["tpot"][before["tpot"]:], 0.5),
            "tpot_p99_ms": pct(stats["tpot"][before["tpot"]:], 0.99),
            "used_blocks": sum(i["num_blocks"] - i["free_blocks"] for i in health["instances"]),
            "server_restarts": restarts(health0, health)}


def restarts(before: dict, after: dict) -> int:
    """Instances of ``before`` (a ``/health``) whose pid changed or is missing in ``after``."""
    pids0 = {i["role"]: i["pid"] for i in before["instances"]}
    pids1 = {i["role"]: i["pid"] for i in after["instances"]}
    return sum(pids1.get(r) != p for r, p in pids0.items())


async def drive(url: str, args, on_window=None) -> dict:
    """Run the load against ``url``; ``on_window(fields)`` gets each window's fields
    (:func:`window_fields` plus ``window``, ``t0_s``, ``t1_s``) as it ends. Returns the
    summary's fields (see the module doc)."""
    import httpx
    stats = {"requests": 0, "ok": 0, "errors": 0, "aborted": 0, "hung": 0, "statuses": {},
             "messages": {},
             "ttft": [], "tpot": []}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        before = (await client.get("/health")).json()
        start = time.monotonic()
        end = start + args.minutes * 60

        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < end:
                await one(client, rng, stats, args)

        async def windows() -> None:
            k, t0, counts, total = 0, 0.0, _counts(stats), end - start
            while total - t0 > 1e-3:
                t1 = t0 + args.window_s
                t1 = total if total - t1 < 1e-3 else t1  # no sliver of a window at the end
                await asyncio.sleep(max(0.0, start + t1 - time.monotonic()))
                health = (await client.get("/health")).json()
                fields = window_fields(stats, counts, before, health)
                counts = _counts(stats)
                if on_window is not None:
                    on_window(dict(fields, window=k, t0_s=round(t0, 3), t1_s=round(t1, 3)))
                k, t0 = k + 1, t1

        await asyncio.gather(windows(), *(worker(i) for i in range(args.clients)))
        after, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:  # drain: leases run out, aborts land
            after = (await client.get("/health")).json()
            if all(i["free_blocks"] == i["num_blocks"] for i in after["instances"]):
                break
            await asyncio.sleep(0.5)
    return {"requests": stats["requests"], "ok": stats["ok"], "errors": stats["errors"],
            "aborted": stats["aborted"], "hung": stats["hung"], "error_kinds": stats["statuses"],
            "error_messages": dict(sorted(stats["messages"].items(), key=lambda kv: -kv[1])[:8]),
            "leaked_blocks": sum(i["num_blocks"] - i["free_blocks"] for i in after["instances"]),
            "server_restarts": restarts(before, after),
            "ttft_p50_ms": pct(stats["ttft"], 0.5), "ttft_p99_ms": pct(stats["ttft"], 0.99),
            "tpot_p50_ms": pct(stats["tpot"], 0.5), "tpot_p99_ms": pct(stats["tpot"], 0.99),
            "instances": before["instances"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_common(p, device=False, presets=False)
    p.add_argument("--quick", action="store_true",
                   help="8 clients, 12 s, prompts <= 256 tokens, <= 8 new tokens (CI)")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--max-prompt", type=int, default=2048, help="longest prompt (tokens)")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens per request")
    p.add_argument("--abort-frac", type=float, default=0.1, help="share of requests closed early")
    p.add_argument("--client-timeout-s", type=float, default=300.0,
                   help="a request with no answer after this long counts as hung")
    p.add_argument("--window-s", type=float, default=30.0,
                   help="seconds of load per saved window row (default 30; --quick: 4)")
    p.add_argument("--server-args", default="", help="extra flags for the server it starts")


def run(args) -> int:
    from .schema import env_info, make_row
    from .server import started_server
    cli.require("httpx", "soak")
    if args.quick:
        args.clients, args.minutes, args.max_prompt = 8, 12 / 60, min(args.max_prompt, 256)
        args.max_tokens, args.window_s = min(args.max_tokens, 8), min(args.window_s, 4.0)
    for name in ("minutes", "clients", "max_prompt", "max_tokens", "client_timeout_s", "window_s"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    server = ["--max-model-len", "2304", "--memory-budget-mb", "256", "--enable-prefix-caching",
              *args.server_args.split()]
    log = os.path.join(tempfile.gettempdir(), f"kvflow-soak-server-{os.getpid()}.log")
    t0 = time.perf_counter()
    opts = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    env = env_info("cpu")
    config = {k: opts[k] for k in ("minutes", "clients", "max_prompt", "max_tokens", "abort_frac",
                                   "window_s")}
    rows = cli.rows(env, opts)

    def row(op: str, seconds: float, fields: dict) -> dict:
        return make_row(env, op=op, backend=args.url or "disagg", spec=None,
                        tokens=args.max_prompt, blocks=0, payload_bytes=0, times_s=[seconds],
                        ceiling_s=None, seed=args.seed, config=config, **fields)

    def on_window(fields: dict) -> None:
        rows.append(row("soak_window", fields["t1_s"] - fields["t0_s"], fields))

    if args.url:
        res = asyncio.run(drive(args.url, args, on_window))
    else:
        with started_server("disagg", server, timeout=300, log_path=log) as url:
            res = asyncio.run(drive(url, args, on_window))
    res["pass"] = (res["leaked_blocks"] == 0 and res["hung"] == 0 and res["server_restarts"] == 0
                   and res["ok"] + res["errors"] + res["aborted"] == res["requests"])
    rows.append(row("soak", time.perf_counter() - t0, res))
    print(json.dumps({k: v for k, v in res.items() if k != "instances"}, indent=1))
    cli.finish(args, opts, env, rows, t0=t0)
    return 0 if res["pass"] else 1
