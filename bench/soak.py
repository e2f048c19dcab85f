"""Soak test of the served PD path: a bounded load generator over loopback (httpx async).

``python bench/soak.py --minutes 10`` starts ``python -m kvflow.serve`` (disagg, ipc, prefix
caching, max_model_len 2304) unless ``--url`` names a running server, then keeps ``--clients``
concurrent clients busy for ``--minutes``: prompts of 1..2048 tokens (byte tokenizer: one
character = one token), streaming, and about ``--abort-frac`` of requests closed by the client
after a random delay. After the load it drains, then reports and writes JSON to
``bench/results/raw/soak-<date>.json`` (its own format, not the row schema):

- requests, ok, errors (HTTP status != 200 or an error event), aborted (closed on purpose);
- hung requests: no answer within ``--client-timeout-s``;
- leaked blocks: every instance's ``num_blocks - free_blocks`` from ``/health`` after the drain;
- server restarts: instance pids before vs after (a changed or missing pid counts one);
- p50/p99 TTFT and TPOT in ms of the completed requests (client side).

Pass = 0 leaked, 0 hung, 0 restarts, every request completed or got an error. ``--quick``: 8
clients, 12 s, prompts <= 256 tokens, for CI (``tests/test_reliability_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx

WORDS = ("prefill decode block cache layer token transfer lease abort paged attention "
         "head kernel copy gather scatter").split()


def make_prompt(rng: random.Random, n_tokens: int) -> str:
    """Text of exactly ``n_tokens - 1`` bytes (the byte tokenizer adds <bos>)."""
    out = []
    while sum(map(len, out)) < n_tokens:
        out.append(rng.choice(WORDS) + " ")
    return "".join(out)[: max(n_tokens - 1, 1)]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)


def note(stats: dict, status, text: str) -> None:
    """Count an error message (digits blanked, so ids and counts group together)."""
    key = f"{status}: " + "".join("#" if c.isdigit() else c for c in text)[:140]
    stats["messages"][key] = stats["messages"].get(key, 0) + 1


async def one(client, rng, stats, args) -> None:
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


async def drive(url: str, args) -> dict:
    stats = {"requests": 0, "ok": 0, "errors": 0, "aborted": 0, "hung": 0, "statuses": {},
             "messages": {},
             "ttft": [], "tpot": []}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        before = (await client.get("/health")).json()
        end = time.monotonic() + args.minutes * 60

        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < end:
                await one(client, rng, stats, args)

        await asyncio.gather(*(worker(i) for i in range(args.clients)))
        after, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:  # drain: leases run out, aborts land
            after = (await client.get("/health")).json()
            if all(i["free_blocks"] == i["num_blocks"] for i in after["instances"]):
                break
            await asyncio.sleep(0.5)
    pids0 = {i["role"]: i["pid"] for i in before["instances"]}
    pids1 = {i["role"]: i["pid"] for i in after["instances"]}
    return {"requests": stats["requests"], "ok": stats["ok"], "errors": stats["errors"],
            "aborted": stats["aborted"], "hung": stats["hung"], "error_kinds": stats["statuses"],
            "error_messages": dict(sorted(stats["messages"].items(), key=lambda kv: -kv[1])[:8]),
            "leaked_blocks": sum(i["num_blocks"] - i["free_blocks"] for i in after["instances"]),
            "server_restarts": sum(pids1.get(r) != p for r, p in pids0.items()),
            "ttft_p50_ms": pct(stats["ttft"], 0.5), "ttft_p99_ms": pct(stats["ttft"], 0.99),
            "tpot_p50_ms": pct(stats["tpot"], 0.5), "tpot_p99_ms": pct(stats["tpot"], 0.99),
            "instances": before["instances"]}


def start_server(port: int, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvflow.serve", "--port", str(port), "--max-model-len", "2304",
           "--memory-budget-mb", "256", "--enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy in 300 s; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=2048, help="longest prompt (tokens)")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens per request")
    p.add_argument("--abort-frac", type=float, default=0.1)
    p.add_argument("--client-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 clients, 12 s, prompts <= 256 tokens, <= 8 new tokens")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/raw/soak-<date>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.minutes, args.max_prompt = 8, 12 / 60, min(args.max_prompt, 256)
        args.max_tokens = min(args.max_tokens, 8)
    for name in ("minutes", "clients", "max_prompt", "max_tokens", "client_timeout_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    proc = None
    url = args.url
    if url is None:
        os.makedirs("bench/results/raw", exist_ok=True)
        proc = start_server(args.port, os.path.join(tempfile.gettempdir(), "kvflow-soak-server.log"))
        url = f"http://127.0.0.1:{args.port}"
    try:
        t0 = time.monotonic()
        res = asyncio.run(drive(url, args))
        res.update(minutes=args.minutes, clients=args.clients, max_prompt=args.max_prompt,
                   abort_frac=args.abort_frac, wall_s=round(time.monotonic() - t0, 1),
                   date=datetime.datetime.now().isoformat(timespec="seconds"))
        res["pass"] = (res["leaked_blocks"] == 0 and res["hung"] == 0 and res["server_restarts"] == 0
                       and res["ok"] + res["errors"] + res["aborted"] == res["requests"])
    finally:
        if proc is not None:
            proc.send_signal(2)
            proc.wait(30)
    out = args.out or f"bench/results/raw/soak-{datetime.date.today().isoformat()}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "instances"}, indent=1))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
