"""The served benchmarks' headline and per-hop breakdown, from the ``kvflow`` objects of the
responses (``hops_ms``, :mod:`kvflow.serve.timings`).

Headline: TTFT(disaggregated) / TTFT(colocated) per prompt length, medians over every prompt
of every server start, with the time to the second token (TTST) beside it, so a transfer that
no longer delays the first token (P's token is streamed at once) still shows.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

#: the hops that add up to TTFT, then those from P's first token to the second token out
TTFT_HOPS = ("router_in", "d_allocate", "to_p", "p_queue", "p_prefill",
             "first_token_to_router", "router_out")
TTST_HOPS = ("kv_after_first_token", "d_second_token", "second_token_to_router",
             "second_router_out")
SHORT = {"router_in": "rtr in", "d_allocate": "D alloc", "to_p": "->P", "p_queue": "P queue",
         "p_prefill": "P prefill", "first_token_to_router": "tok1->R", "router_out": "R out",
         "kv_after_first_token": "KV after", "d_second_token": "D step",
         "second_token_to_router": "tok2->R", "second_router_out": "R out2"}


def hop_medians(kvflows: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Hop -> median ms over the responses' ``kvflow.hops_ms`` that have it."""
    seen: dict[str, list[float]] = {}
    for kv in kvflows:
        for hop, ms in (kv.get("hops_ms") or {}).items():
            seen.setdefault(hop, []).append(float(ms))
    return {hop: statistics.median(v) for hop, v in seen.items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(v: float | None, w: int, spec: str = ".2f") -> str:
    return f"{'-':>{w}}" if v is None else f"{v:>{w}{spec}}"


def headline(groups: list[dict[str, Any]], reference: str = "colocated",
             key: str = "tokens") -> str:
    """The headline table: per (tokens, mode) the median TTFT and TTST (ms), their ratio to
    ``reference`` of the same length, samples and token identity.

    Parameters
    ----------
    groups : list of dict
        ``{"tokens": int, "mode": str, "kvflows": [kvflow dicts], "starts": int,
        "identical": bool or None}``, one per (tokens, mode).
    reference : str
        The mode the ratios divide by (same ``key`` value).
    key : str
        The field that groups rows besides the mode: ``"tokens"`` (prompt length) or
        ``"rate"`` (requests/s).
    """
    ref = {g[key]: hop_medians(g["kvflows"]) for g in groups if g["mode"] == reference}
    head = (f"  {key:>6} {'mode':22} {'n':>3} {'starts':>6} {'TTFT ms':>9} "
            f"{'TTFT/col':>8} {'TTST ms':>9} {'TTST/col':>8} {'identical':>9}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for g in groups:
        m, r = hop_medians(g["kvflows"]), ref.get(g[key], {})
        same = g.get("identical")
        lines.append(f"  {g[key]:>6} {g['mode']:22} {len(g['kvflows']):>3} "
                     f"{g.get('starts', 1):>6} {_f(m.get('ttft'), 9)} "
                     f"{_f(_ratio(m.get('ttft'), r.get('ttft')), 8, '.3f')} "
                     f"{_f(m.get('ttst'), 9)} {_f(_ratio(m.get('ttst'), r.get('ttst')), 8, '.3f')} "
                     f"{'-' if same is None else str(same):>9}")
    return "\n".join(lines)


def breakdown(groups: list[dict[str, Any]], key: str = "tokens") -> str:
    """Per (tokens, mode) the median of every hop (ms): the TTFT hops (router in, D allocate,
    router -> P, P's queue, P's prefill, first token -> router, router out), then the hops to
    the second token (KV done after P's token, D's first decode step, second token -> router,
    router out)."""
    hops = TTFT_HOPS + TTST_HOPS
    head = f"  {key:>6} {'mode':22} " + " ".join(f"{SHORT[h]:>9}" for h in hops)
    lines = [head, "  " + "-" * (len(head) - 2)]
    for g in groups:
        m = hop_medians(g["kvflows"])
        lines.append(f"  {g[key]:>6} {g['mode']:22} "
                     + " ".join(_f(m.get(h), 9, ".3f") for h in hops))
    return "\n".join(lines)


def report(groups: list[dict[str, Any]], reference: str = "colocated",
           key: str = "tokens") -> str:
    """:func:`headline` and :func:`breakdown` with their legends."""
    return ("TTFT / TTST: the router's (request in -> first / second token out), medians over "
            "every prompt and server start\n" + headline(groups, reference, key)
            + "\nper-hop medians (ms; kvflow.hops_ms: the TTFT hops add up to TTFT, the last four "
              "run from P's first token to the second token out)\n" + breakdown(groups, key))


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown of served result rows that carry ``hops_ms`` (medians per tokens and mode):
    the headline (TTFT and TTST against the colocated row of the same length), then every hop.
    """
    ref = {r["tokens"]: r["hops_ms"] for r in rows if r["backend"] == "colocated"}
    out = ["| tokens | mode | TTFT ms | TTFT / colocated | TTST ms | TTST / colocated | "
           "token-identical |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m, c = r["hops_ms"], ref.get(r["tokens"], {})
        tt, ts = _ratio(m.get("ttft"), c.get("ttft")), _ratio(m.get("ttst"), c.get("ttst"))
        out.append(f"| {r['tokens']} | {r['backend']} | {m.get('ttft', 0):.2f} | "
                   f"{'-' if tt is None else f'{tt:.3f}'} | {m.get('ttst', 0):.2f} | "
                   f"{'-' if ts is None else f'{ts:.3f}'} | {r.get('identical', '-')} |")
    hops = TTFT_HOPS + TTST_HOPS
    out += ["", "Per-hop medians (ms, `kvflow.hops_ms`): the first seven add up to TTFT; the "
            "last four run from P's first token to the second token out.", "",
            "| tokens | mode | " + " | ".join(SHORT[h] for h in hops) + " |",
            "|---|---|" + "---|" * len(hops)]
    for r in rows:
        m = r["hops_ms"]
        out.append(f"| {r['tokens']} | {r['backend']} | "
                   + " | ".join("-" if m.get(h) is None else f"{m[h]:.3f}" for h in hops) + " |")
    return out + [""]
