"""Mixed load for the served bench: running decodes beside arriving long prompts.

``--mix-decodes N`` starts ``N`` *running* requests (prompts of ``--mix-prompt-len`` tokens,
``--mix-output-len`` output tokens, all sent at once) before the measured workload (the long
prompts of ``--prompt-len`` at ``--rate``), which begins ``--mix-delay-s`` later, once the
running requests decode. Per (mode, rate) step the running requests are served alone once
(a warm-up, dropped: a fresh server's first steps are slower), then beside the workload, then
alone again (the baseline). The rows add, for the running requests (ms, nearest rank):

- ``running_tpot_ms_{p50,p99}`` and ``running_itl_ms_{p50,p99}`` beside the workload, and the
  same under ``running_alone_`` for the baseline;
- ``running_tpot_ratio_p50/p99`` = beside / alone: what the long prompts' prefill and KV
  movement cost the decodes that were already running. Colocated, a long prefill stalls every
  running decode (one engine); disaggregated, only the KV landing on D can (the cost kvflow's
  transfer adds, issue #29).

TPOT and ITL as in :mod:`kvflow.bench.loadgen` (TPOT = (E2E - TTFT) / (outputs - 1)).
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import loadgen

KEYS = ("mix_decodes", "mix_prompt_len", "mix_output_len", "mix_delay_s")


def add_arguments(p) -> None:
    """The mixed-load flags of the ``serve`` study."""
    p.add_argument("--mix-decodes", type=int, default=0,
                   help="running requests served beside the workload (0: no mixed load)")
    p.add_argument("--mix-prompt-len", default="32", help="their prompt tokens: N or A:B")
    p.add_argument("--mix-output-len", default="64", help="their output tokens: N or A:B")
    p.add_argument("--mix-delay-s", type=float, default=0.5,
                   help="seconds from the running requests' send to the workload's first")


def check(opts: dict[str, Any]) -> None:
    """Refuse bad mixed-load flags in one line (SystemExit naming the flag and value)."""
    n = opts.get("mix_decodes") or 0
    if n < 0:
        raise SystemExit(f"serve: --mix-decodes must be >= 0, got {n}")
    if n and not (opts.get("mix_delay_s") or 0) >= 0:
        raise SystemExit(f"serve: --mix-delay-s must be >= 0, got {opts.get('mix_delay_s')}")
    if n:
        for key in ("mix_prompt_len", "mix_output_len"):
            try:
                lo, _ = loadgen.parse_length(opts[key], key)
            except ValueError as exc:
                raise SystemExit(f"serve: --{key.replace('_', '-')}: {exc}") from None
            if key == "mix_output_len" and lo < 2:
                raise SystemExit(f"serve: --mix-output-len must be >= 2 tokens (a TPOT needs "
                                 f"two), got {opts[key]!r}")


def running_workload(opts: dict[str, Any]) -> list[loadgen.Request]:
    """The running requests (seeded apart from the workload's)."""
    return loadgen.build_workload(opts["mix_decodes"], opts["mix_prompt_len"],
                                  opts["mix_output_len"], seed=opts["seed"] + 7919)


def running_stats(results: list[loadgen.Result], prefix: str) -> dict[str, float | None]:
    """``{prefix}tpot_ms_p50/p99`` and ``{prefix}itl_ms_p50/p99`` of the running requests."""
    ok = [r for r in results if r.ok]
    out: dict[str, float | None] = {}
    for name, xs in (("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
                     ("itl", [x for r in ok for x in r.itl_s])):
        s = loadgen._stats(xs)
        out[f"{prefix}{name}_ms_p50"], out[f"{prefix}{name}_ms_p99"] = s["p50"], s["p99"]
    out[f"{prefix}completed"] = len(ok)
    return out


def measure_mixed(url: str, opts: dict[str, Any], work: list, offsets: list[float],
                  on_done=None) -> tuple[list, float, dict[str, list]]:
    """Serve the running requests alone (warm-up), beside ``work`` (sent at ``offsets`` after
    ``--mix-delay-s``), then alone (the baseline). Returns the workload's results, its duration (s, first workload send
    to the last finish of either) and ``{"alone": [...], "beside": [...]}``, the running
    requests' results (:func:`fields`)."""
    running = running_workload(opts)
    kw = dict(model=opts["model"], concurrency=opts["concurrency"] + len(running),
              timeout=opts["request_timeout"])
    asyncio.run(loadgen.run_load(url, running, [0.0] * len(running), **kw))  # warm-up, dropped
    delay = opts["mix_delay_s"]
    both, dur = asyncio.run(loadgen.run_load(
        url, running + work, [0.0] * len(running) + [delay + t for t in offsets],
        on_done=on_done, **kw))
    alone, _ = asyncio.run(loadgen.run_load(url, running, [0.0] * len(running), **kw))
    return both[len(running):], max(0.0, dur - delay), {"alone": alone,
                                                          "beside": both[:len(running)]}


def fields(running: dict[str, list]) -> dict[str, Any]:
    """A row's running-request fields (module docstring) from :func:`measure_mixed`'s
    results (pooled over server starts)."""
    alone, beside = running["alone"], running["beside"]
    out = {**running_stats(alone, "running_alone_"), **running_stats(beside, "running_")}
    for q in ("p50", "p99"):
        a, b = out[f"running_alone_tpot_ms_{q}"], out[f"running_tpot_ms_{q}"]
        out[f"running_tpot_ratio_{q}"] = b / a if a and b is not None else None
    out["running_errors"] = sorted({r.error for r in alone + beside if r.error})[:5]
    return out


def format_running(rows: list[dict]) -> str:
    """Headline of a mixed load, per (mode, rate): TTFT p50 of the workload beside the running
    requests' TPOT p50/p99 alone and beside it and their ratio; "" when no row has it."""
    rows = [r for r in rows if r.get("running_tpot_ratio_p99") is not None
            or r.get("running_alone_tpot_ms_p50") is not None]
    if not rows:
        return ""
    f = lambda v, w, d=2: f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"  # noqa: E731
    head = (f"{'mode':10} {'rate':>6} {'TTFT p50':>9} {'running TPOT p50':>17} {'p99':>8} "
            f"{'alone p50':>10} {'p99':>8} {'ratio p50':>10} {'p99':>6}")
    lines = ["running requests (TPOT ms) beside the workload vs alone:", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['backend']:10} {f(r['rate'], 6)} {f(r['ttft_ms_p50'], 9)} "
                     f"{f(r['running_tpot_ms_p50'], 17)} {f(r['running_tpot_ms_p99'], 8)} "
                     f"{f(r['running_alone_tpot_ms_p50'], 10)} "
                     f"{f(r['running_alone_tpot_ms_p99'], 8)} "
                     f"{f(r['running_tpot_ratio_p50'], 10, 3)} {f(r['running_tpot_ratio_p99'], 6, 3)}")
    for r in rows:
        for e in r.get("running_errors") or []:
            lines.append(f"  {r['backend']} running error: {e}")
    return "\n".join(lines)
