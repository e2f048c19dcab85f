"""PNG plots of the report (matplotlib, Agg backend; one file per figure, named after the result
file): GB/s vs payload with the same-run ceiling per (layout, dtype) and op; transfer GB/s vs
payload with each connector's ceiling; TTFT and TPOT CDFs per serving mode; bars of the
prefill slowdown (contention) or overlap figures (layerwise rows)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _log_x(ax) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _label(r: dict) -> str:
    return r["backend"] + (f" ctas={r['max_ctas']}" if r.get("max_ctas") is not None else "")


def kernels_png(stem: str, rows: list[dict], img_dir: Path) -> list[Path]:
    """One PNG per (layout, dtype): a panel per op, GB/s vs payload MiB per backend, and the
    ceiling (same-run ``copy_``) dashed."""
    plt = _plt()
    out = []
    groups = defaultdict(list)
    for r in rows:
        groups[(r["layout"], r["dtype"])].append(r)
    for (layout, dtype), rs in groups.items():
        ops = list(dict.fromkeys(r["op"] for r in rs))
        fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6), squeeze=False)
        for ax, op in zip(axes[0], ops):
            ors = [r for r in rs if r["op"] == op]
            ceil = sorted({(r["payload_bytes"], r["ceiling_gbps"]) for r in ors})
            ax.plot([b / 2**20 for b, _ in ceil], [g for _, g in ceil], "k--", label="ceiling (copy_)")
            for lab in dict.fromkeys(_label(r) for r in ors):
                pts = sorted((r["payload_bytes"], r["gbps"]) for r in ors if _label(r) == lab)
                ax.plot([b / 2**20 for b, _ in pts], [g for _, g in pts], "o-", ms=3, label=lab)
            _log_x(ax)
            ax.set_title(f"{op} · {layout} · {dtype}", fontsize=9)
            ax.set_xlabel("payload (MiB)")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = img_dir / f"{stem}-{layout}-{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def transfer_png(stem: str, rows: list[dict], img_dir: Path) -> list[Path]:
    """Transfer GB/s vs payload per connector, with the loopback ceiling dashed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for lab in dict.fromkeys(r["backend"] for r in rows):
        pts = sorted((r["payload_bytes"], r["gbps"]) for r in rows if r["backend"] == lab)
        style = "k--" if rows and any(r["op"] == "ceiling" and r["backend"] == lab for r in rows) else "o-"
        ax.plot([b / 2**20 for b, _ in pts], [g for _, g in pts], style, ms=3, label=lab)
    _log_x(ax)
    ax.set_xlabel("payload (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("P->D transfer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = img_dir / f"{stem}-transfer.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def serve_png(stem: str, rows: list[dict], img_dir: Path) -> list[Path]:
    """TTFT and TPOT CDFs, one line per (mode, rate)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for r in rows:
            xs = sorted(r.get(key) or [])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{r['backend']} @ {r.get('rate')} req/s")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = img_dir / f"{stem}-serve-cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


BAR_KEYS = ("hidden_frac", "hidden_fraction", "slowdown", "exposed_s", "exposed_ms")


def _bar_label(r: dict) -> str:
    ctas = r.get("max_ctas", (r.get("config") or {}).get("max_ctas"))
    name = r["backend"] if r["op"] == "contention" else f"{r['op']} ({r['backend']})"
    return name + (f" ctas={ctas}" if ctas is not None else "")


def bars_png(stem: str, rows: list[dict], img_dir: Path, tag: str) -> list[Path]:
    """Grouped bars of the first of :data:`BAR_KEYS` the rows carry, per (label, tokens)."""
    key = next((k for k in BAR_KEYS if any(isinstance(r.get(k), (int, float)) for r in rows)), None)
    if key is None:
        return []
    plt = _plt()
    rows = [r for r in rows if isinstance(r.get(key), (int, float))]
    labels = list(dict.fromkeys(_bar_label(r) for r in rows))
    toks = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(labels) * len(toks)), 3.6))
    width = 0.8 / max(1, len(labels))
    for i, lab in enumerate(labels):
        vals = {r["tokens"]: r.get(key) for r in rows if _bar_label(r) == lab}
        ax.bar([j + i * width for j in range(len(toks))], [vals.get(t) or 0 for t in toks],
               width, label=lab)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(toks))], [str(t) for t in toks])
    ax.set_xlabel("tokens")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = img_dir / f"{stem}-{tag}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_file(stem: str, kinds: dict[str, list[dict]], img_dir: Path) -> list[Path]:
    """Every plot of one result file (rows already split by kind by the report)."""
    out = []
    if kinds.get("kernels"):
        out += kernels_png(stem, kinds["kernels"], img_dir)
    if kinds.get("transfer"):
        out += transfer_png(stem, kinds.get("ceiling", []) + kinds["transfer"], img_dir)
    if kinds.get("serve"):
        out += serve_png(stem, kinds["serve"], img_dir)
    if kinds.get("contention"):
        out += bars_png(stem, kinds["contention"], img_dir, "contention")
    if kinds.get("other"):
        out += bars_png(stem, kinds["other"], img_dir, "overlap")
    return out
