"""Load generator for an OpenAI-shaped ``/v1/completions`` server (``python -m kvflow.serve``).

Workload: ``num_requests`` requests whose prompt and output lengths come from a fixed value, a
uniform range ``"A:B"`` (tokens), or a JSON dataset file (a list of ``{"prompt": str | [int],
"max_tokens": int}``); arrivals are Poisson (exponential gaps of mean ``1/rate`` s), fixed-rate
(gaps of exactly ``1/rate`` s) or all at once (``rate=inf``). Prompts of a given length are token
ids (printable ASCII byte values 32..126, valid in a byte-level vocabulary and in any BPE
vocabulary of more than 127 entries), so the prompt length is exact.

Per request, from the server-sent-event stream (a ``data:`` chunk's ``token_ids``, or one token
for a chunk with text; :func:`chunk_tokens`):
TTFT = first token time - send time; ITL = the gaps between tokens; TPOT = (E2E - TTFT) /
(output tokens - 1); E2E = last event time - send time. Goodput is the number of requests per
second that meet both the TTFT and the TPOT SLO (DistServe, Zhong et al., OSDI 2024, Section 2;
sweeping ``rate`` gives DistServe's "maximum rate at a target SLO attainment").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Request:
    prompt: Any  # str or list[int]
    max_tokens: int
    prompt_tokens: int | None = None


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    kvflow: dict | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a single-token output."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def parse_length(text: str | int, name: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` -> (64, 256) (inclusive uniform range).

    Raises
    ------
    ValueError
        Naming ``name`` and the value, for anything else or a non-positive length.
    """
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo <= 0 or hi < lo:
        raise ValueError(f"{name}={text!r}: expected a positive token count N or a range A:B with 0 < A <= B")
    return lo, hi


def build_workload(num_requests: int, prompt_len: str, output_len: str, *, seed: int = 0,
                   dataset: str | None = None) -> list[Request]:
    """``num_requests`` requests (from ``dataset`` if given, cycled; else random lengths)."""
    rng = random.Random(seed)
    if dataset:
        items = json.loads(Path(dataset).read_text())
        if not isinstance(items, list) or not items or not all(
                isinstance(i, dict) and "prompt" in i for i in items):
            raise ValueError(f"dataset={dataset!r} must be a JSON list of objects with 'prompt'")
        return [Request(it["prompt"], int(it.get("max_tokens", 16)),
                        len(it["prompt"]) if isinstance(it["prompt"], list) else None)
                for it in (items[i % len(items)] for i in range(num_requests))]
    p_lo, p_hi = parse_length(prompt_len, "prompt_len")
    o_lo, o_hi = parse_length(output_len, "output_len")
    out = []
    for _ in range(num_requests):
        n = rng.randint(p_lo, p_hi)
        out.append(Request([rng.randint(32, 126) for _ in range(n)], rng.randint(o_lo, o_hi), n))
    return out


def arrival_offsets(n: int, rate: float, arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests at ``rate`` requests/s."""
    if arrival not in ("poisson", "fixed"):
        raise ValueError(f"arrival={arrival!r}: expected 'poisson' or 'fixed'")
    if not rate > 0:
        raise ValueError(f"rate={rate!r}: expected a positive number of requests/s (or inf)")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return out


def chunk_tokens(chunk: dict) -> int:
    """Output tokens in one stream chunk: its choices' ``token_ids`` (kvflow.serve and vLLM
    send them: a token whose text is empty, e.g. part of a UTF-8 character, still counts), else
    1 for a chunk with text."""
    choices = chunk.get("choices") or []
    if any("token_ids" in c for c in choices):
        return sum(len(c.get("token_ids") or []) for c in choices)
    return 1 if "".join(c.get("text") or "" for c in choices) else 0


async def send_one(client, url: str, req: Request, model: str, timeout: float) -> Result:
    """Send one streaming completion and time its events (greedy: temperature 0)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "stream": True}
    res = Result(ok=False, prompt_tokens=req.prompt_tokens)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body,
                                 timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("kvflow"):
                    res.kvflow = chunk["kvflow"]
                usage = chunk.get("usage") or {}
                if usage.get("prompt_tokens"):
                    res.prompt_tokens = usage["prompt_tokens"]
                got = chunk_tokens(chunk)
                if not got:
                    continue
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                res.output_tokens += got
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e_s = time.perf_counter() - t0
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = "stream ended without a token"
    return res


async def run_load(url: str, workload: list[Request], offsets: list[float], *, model: str,
                   concurrency: int = 64, timeout: float = 120.0,
                   on_done=None) -> tuple[list[Result], float]:
    """Send ``workload[i]`` at ``offsets[i]`` (at most ``concurrency`` in flight); returns the
    results in workload order and the wall duration in seconds (first send to last finish)."""
    import httpx
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def one(req: Request, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with sem:
                r = await send_one(client, url, req, model, timeout)
            if on_done:
                on_done(r)
            return r

        results = await asyncio.gather(*(one(r, t) for r, t in zip(workload, offsets)))
        return list(results), time.perf_counter() - start


def _stats(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(x * scale for x in xs)
    q = lambda p: s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]  # noqa: E731 nearest rank
    return {"mean": sum(s) / len(s), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99)}


def summarize(results: list[Result], duration_s: float, *, slo_ttft_ms: float,
              slo_tpot_ms: float) -> dict[str, Any]:
    """Latency statistics (ms; nearest-rank percentiles), throughput and goodput.

    A request meets the SLOs when it succeeded, TTFT <= ``slo_ttft_ms`` and TPOT <=
    ``slo_tpot_ms`` (a one-token output has no TPOT and meets that half). ``goodput_rps`` =
    such requests / ``duration_s``; ``slo_attainment`` = such requests / all requests.
    """
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft_s * 1e3 <= slo_ttft_ms
            and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)]
    out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": duration_s,
           "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
           "output_tok_s": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else None,
           "goodput_rps": len(good) / duration_s if duration_s > 0 else None,
           "slo_attainment": len(good) / len(results) if results else None,
           "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
           "errors": sorted({r.error for r in results if r.error})[:5]}
    for name, xs in (("ttft", [r.ttft_s for r in ok]), ("e2e", [r.e2e_s for r in ok]),
                     ("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
                     ("itl", [x for r in ok for x in r.itl_s])):
        for k, v in _stats(xs).items():
            out[f"{name}_ms_{k}"] = v
    return out
