"""Rows, table lines and the plot of the interference study (:mod:`kvflow.bench.interference`).

D rows (``op="interference_decode"``): ``payload_bytes`` are the KV bytes landed in the
measured window, ``time_s`` the window's seconds, so ``gbps`` is the KV GB/s achieved and
``ratio`` its fraction of the same-run ``copy_`` ceiling of the same bytes; ``tpot_p50_s`` /
``tpot_p99_s`` and their ratios to the no-transfer baseline of the same run
(``tpot_p50_ratio``, ``tpot_p99_ratio``; exactly 1.0 on the baseline row); ``copy_alone_gbps``
and ``copy_alone_ratio``: one unit's copy with nothing beside it, vs the ceiling.
P rows (``op="interference_prefill"``): ``time_s`` is prefill start to the last copy's end,
``gbps`` the KV bytes over it, ``prefill_ratio`` the prefill's seconds over the prefill alone
(exactly 1.0 on the ``none`` row), ``total_ratio`` the same for the total.
Raw seconds in ``samples`` (``tpot_s`` of every step; ``prefill_s`` of every run).
Both: ``max_ctas`` (None: full grid), ``ctas`` (the CTAs of one copy launch,
:func:`~.interference_lane.grid_ctas`; P: of layer 0's), ``sms`` (the device's), ``sms_used_max``
(:func:`~.interference_lane.sms_used_at_most`), ``landed`` (the copied bytes equal their source;
None without copies), ``skipped`` (a reason, on a row with no figures).
"""

from __future__ import annotations

from pathlib import Path

from .interference_lane import NONE, Config, grid_ctas, sms_used_at_most
from .schema import make_row
from .timing import median, percentile


def _common(cfg: Config, sms: int, rate) -> dict:
    return {"max_ctas": cfg.max_ctas, "label": cfg.label, "rate_gbps": rate, "sms": sms,
            "sms_used_max": sms_used_at_most(cfg, sms), "skipped": cfg.skipped}


def skipped_row(env: dict, side: str, cfg: Config, spec, sms: int, config: dict) -> dict:
    """A row of ``side`` ("decode" or "prefill") that says why ``cfg`` was not measured
    (``skipped``): ``time_s`` 0.0 (nothing timed), every other figure None."""
    row = make_row(env, op=f"interference_{side}", backend=cfg.backend, spec=spec, tokens=0,
                   blocks=0, payload_bytes=0, times_s=[0.0], ceiling_s=None, config=config,
                   side=side, **_common(cfg, sms, None))
    row.update(gbps=None, samples={})  # time_s 0.0: nothing was timed
    return row


def decode_row(env: dict, b, cfg: Config, rate, res: dict, base: dict | None, ceil_unit: float | None,
               alone_unit: float | None, sms: int, config: dict, seed: int) -> dict:
    """The row of one D-side measurement ``res`` (:meth:`DecodeBench.measure`); ``base`` is the
    baseline's row (None: this is the baseline)."""
    units, tpot = res["units"], res["tpot_s"]
    p50, p99 = percentile(tpot, 0.5), percentile(tpot, 0.99)
    r50 = 1.0 if base is None else p50 / base["tpot_p50_s"]
    r99 = 1.0 if base is None else p99 / base["tpot_p99_s"]
    payload = units * b.unit_bytes
    return make_row(
        env, op="interference_decode", backend=cfg.backend, spec=b.spec,
        tokens=units * b.s.arrival_tokens, blocks=units * b.unit_blocks, payload_bytes=payload,
        times_s=[res["window_s"]], ceiling_s=ceil_unit * units if ceil_unit and units else None,
        config=config, seed=seed, side="decode", **_common(cfg, sms, rate),
        ctas=grid_ctas(cfg, b.cache, b.dev, b.s.arrival_op, b.unit_blocks, (0, b.spec.num_layers)),
        units=units, units_forgone=res["forgone"], unit_bytes=b.unit_bytes, steps=len(tpot),
        samples={"tpot_s": tpot},
        tpot_p50_s=p50, tpot_p99_s=p99, tpot_mean_s=sum(tpot) / len(tpot),
        tpot_p50_ratio=r50, tpot_p99_ratio=r99, landed=res["landed"],
        ceiling_unit_s=ceil_unit, copy_alone_s=alone_unit,
        copy_alone_gbps=b.unit_bytes / alone_unit / 1e9 if alone_unit else None,
        copy_alone_ratio=ceil_unit / alone_unit if ceil_unit and alone_unit else None)


def prefill_row(env: dict, pb, cfg: Config, runs: list[dict], alone_s: float | None,
                ceil_s: float | None, copies_s: float | None, sms: int, config: dict,
                seed: int) -> dict:
    """The row of one prompt length and configuration (``runs``: :meth:`PrefillBench.run`
    results); ``alone_s`` is the median prefill alone (None: this is the alone row)."""
    pre = median([r["prefill_s"] for r in runs])
    tot = [r["total_s"] for r in runs]
    moved = cfg.backend != NONE
    landed = [r["landed"] for r in runs]
    return make_row(
        env, op="interference_prefill", backend=cfg.backend, spec=pb.spec, tokens=pb.tokens,
        blocks=pb.nb, payload_bytes=pb.payload if moved else 0, times_s=tot,
        ceiling_s=ceil_s if moved else None, config=config, seed=seed, side="prefill",
        **_common(cfg, sms, None), ctas=grid_ctas(cfg, pb.d, pb.dev, "copy", pb.nb, (0, 1)), prefill_s=pre, samples={"prefill_s": [r["prefill_s"] for r in runs]},
        prefill_alone_s=pre if alone_s is None else alone_s,
        prefill_ratio=1.0 if alone_s is None else pre / alone_s,
        total_ratio=1.0 if alone_s is None else median(tot) / alone_s,
        exposed_s=median(tot) - pre, landed=all(landed) if moved else None,
        copy_alone_s=copies_s,
        copy_alone_gbps=pb.payload / copies_s / 1e9 if copies_s else None,
        copy_alone_ratio=ceil_s / copies_s if ceil_s and copies_s else None)


def _g(x, scale=1.0, fmt=".3g") -> str:
    return "-" if x is None else format(x * scale, fmt)


def line(row: dict) -> str:
    """One table line of a row (after :data:`HEAD` of its side)."""
    rate = row["rate_gbps"]
    if row.get("skipped"):
        return f"{row['side']:8} {row['label']:16} skipped: {row['skipped']}"
    if row["op"] == "interference_decode":
        return (f"{'decode':8} {row['label']:16} {_g(row['ctas']):>6} "
                f"{('max' if rate is None else _g(rate)):>8} "
                f"{_g(row['gbps']):>8} {_g(row['ratio']):>6} {_g(row['copy_alone_gbps']):>8} "
                f"{_g(row['tpot_p50_s'], 1e3):>8} {_g(row['tpot_p99_s'], 1e3):>8} "
                f"{row['tpot_p50_ratio']:>7.3f} {row['tpot_p99_ratio']:>7.3f}")
    return (f"{'prefill':8} {row['label']:16} {_g(row['ctas']):>6} {row['tokens']:>8} "
            f"{_g(row['gbps']):>8} "
            f"{_g(row['ratio']):>6} {_g(row['copy_alone_gbps']):>8} {_g(row['prefill_s'], 1e3):>8} "
            f"{_g(row['time_s'], 1e3):>8} {row['prefill_ratio']:>7.3f} {row['total_ratio']:>7.3f}")


HEAD = {"decode": f"{'side':8} {'copies':16} {'ctas':>6} {'rate':>8} {'GB/s':>8} {'/ceil':>6} {'alone':>8} "
                  f"{'p50 ms':>8} {'p99 ms':>8} {'p50 x':>7} {'p99 x':>7}",
        "prefill": f"{'side':8} {'copies':16} {'ctas':>6} {'tokens':>8} {'GB/s':>8} {'/ceil':>6} {'alone':>8} "
                   f"{'pre ms':>8} {'tot ms':>8} {'pre x':>7} {'tot x':>7}"}


def markdown(rows: list[dict]) -> list[str]:
    """The report's tables of the study's rows: D side (TPOT beside KV landing at a rate) and
    P side (prefill beside layerwise copies); ratios are to the same run's no-transfer row."""
    from .kernel_report import md_table
    out = []
    for side, head in (("decode", ["copies", "SMs at most", "rate GB/s", "KV GB/s", "/ceil",
                                   "TPOT p50 ms", "TPOT p99 ms", "p50 x", "p99 x"]),
                       ("prefill", ["copies", "SMs at most", "tokens", "KV GB/s", "/ceil",
                                    "prefill ms", "prefill x", "total x"])):
        mine = [r for r in rows if r["op"] == f"interference_{side}" and not r.get("skipped")]
        if not mine:
            continue
        if side == "decode":
            body = [[r["label"], r["sms_used_max"], _g(r["rate_gbps"]), _g(r["gbps"]),
                     _g(r["ratio"]), _g(r["tpot_p50_s"], 1e3), _g(r["tpot_p99_s"], 1e3),
                     f"{r['tpot_p50_ratio']:.3f}", f"{r['tpot_p99_ratio']:.3f}"] for r in mine]
        else:
            body = [[r["label"], r["sms_used_max"], r["tokens"], _g(r["gbps"]), _g(r["ratio"]),
                     _g(r["prefill_s"], 1e3), f"{r['prefill_ratio']:.3f}",
                     f"{r['total_ratio']:.3f}"] for r in mine]
        out += [f"**Interference, {side} side**", ""] + md_table(head, body)
    return out


def plot(rows: list[dict], env: dict, path: Path) -> Path:
    """PNG of TPOT p50 and p99 ratio (to the no-transfer baseline) vs the KV GB/s achieved, one
    series per copy configuration, each starting at the baseline (0 GB/s, 1.0); titled with the
    device, torch / triton versions, commit and date (also the PNG's ``Title`` text)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import provenance, series_style
    dec = [r for r in rows if r["op"] == "interference_decode" and not r.get("skipped")]
    base = next((r for r in dec if r["backend"] == NONE), None)
    series: dict[str, list[dict]] = {}
    for r in dec:
        if r["backend"] != NONE:
            series.setdefault(r["label"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, q in zip(axes, ("p50", "p99")):
        for i, (label, rs) in enumerate(series.items()):
            pts = sorted([(0.0, 1.0)] * (base is not None) +
                         [(r["gbps"] or 0.0, r[f"tpot_{q}_ratio"]) for r in rs])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **series_style(i))
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_xlabel("KV landing in D's cache, GB/s achieved")
        ax.set_title(f"TPOT {q} / no transfer", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TPOT ratio")
    if series:
        axes[1].legend(fontsize=7)
    prov = (f"{provenance(env)} · torch {env.get('torch')} · triton {env.get('triton')}")
    c = (base or {}).get("config", {})
    fig.suptitle(f"Decode TPOT while KV lands ({c.get('model')}, batch {c.get('batch')} at "
                 f"{c.get('context')} tokens, {c.get('arrival_op')} of {c.get('arrival_tokens')}-"
                 f"token requests)\n{prov}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Title": prov})
    plt.close(fig)
    return path
