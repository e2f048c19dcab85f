"""PNG plots of the report (matplotlib, Agg backend; one file per figure, named after the result
file).

Every figure carries its result file's device, commit and date (the title, and the PNG's
``Title`` text chunk), and every series has its own colour + marker + line style
(:func:`series_style`); ceilings are black without markers, each ceiling of one axes in its own
line style. Figures: GB/s and the ratio to the same-run ceiling vs payload (kernels, connectors,
GPU-to-GPU copies); TTFT and TPOT CDFs (serve); bars of the prefill slowdown (contention) or of
overlap figures (layerwise and served rows), hidden fractions clipped to [0, 1].
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
CEILING_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))
HATCHES = ("", "//", "..", "xx", "\\\\", "oo")


def series_style(i: int) -> dict:
    """Plot kwargs of the ``i``-th series: unique (colour, marker, line style) for
    i < 10 x 8 x 4 (colours change fastest, then markers, then line styles)."""
    return {"color": COLORS[i % len(COLORS)],
            "marker": MARKERS[(i // len(COLORS)) % len(MARKERS)],
            "linestyle": LINESTYLES[(i // (len(COLORS) * len(MARKERS))) % len(LINESTYLES)],
            "ms": 4}


def ceiling_style(i: int) -> dict:
    """Plot kwargs of the ``i``-th ceiling of one axes: black, no marker, its own dashes."""
    return {"color": "black", "linestyle": CEILING_STYLES[i % len(CEILING_STYLES)], "lw": 1.3}


def provenance(env: dict) -> str:
    """'<device> · commit <commit> · <date>' of a result file's ``env``."""
    return f"{env.get('device', '?')} · commit {env.get('commit', '?')} · {env.get('date', '?')}"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _log_x(ax) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _save(fig, path: Path, title: str, env: dict) -> Path:
    """Title the figure with ``title`` and the provenance, write it, close it."""
    prov = provenance(env)
    fig.suptitle(f"{title}\n{prov}", fontsize=9)
    fig.tight_layout()
    import io

    from PIL import Image, PngImagePlugin
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    _plt().close(fig)
    info = PngImagePlugin.PngInfo()
    info.add_text("Title", prov)
    info.add_text("Description", title)
    # 256 colours: a third of the bytes of RGBA for line plots, no visible difference
    Image.open(buf).convert("RGB").quantize(256).save(path, pnginfo=info, optimize=True)
    return path


def _label(r: dict) -> str:
    variant = (r.get("config") or {}).get("variant")
    return (r["backend"] + (f" ctas={r['max_ctas']}" if r.get("max_ctas") is not None else "")
            + (f" ({variant})" if variant and variant != "in_process" else ""))


def _bandwidth_axes(ax_gbps, ax_ratio, rows: list[dict], ceilings: list[tuple[str, list]],
                    prefix: str = "", ratio_label: str = "ratio to the same-run ceiling") -> None:
    """GB/s (ceilings in black) on ``ax_gbps`` and the ratio to the same-run ceiling on
    ``ax_ratio``, vs payload MiB, one series per :func:`_label`; ``prefix="as_called_"`` plots
    the as-called figures, and ``ax_gbps=None`` only the ratio."""
    for i, (name, pts) in enumerate(ceilings if ax_gbps is not None else []):
        pts = sorted(pts)
        ax_gbps.plot([b / 2**20 for b, _ in pts], [g for _, g in pts], label=f"ceiling: {name}",
                     **ceiling_style(i))
    ax_ratio.axhline(1.0, **ceiling_style(0), label="ceiling = 1")
    for i, lab in enumerate(dict.fromkeys(_label(r) for r in rows)):
        mine = sorted((r["payload_bytes"], r[prefix + "gbps"], r[prefix + "ratio"])
                      for r in rows if _label(r) == lab)
        x = [b / 2**20 for b, _, _ in mine]
        if ax_gbps is not None:
            ax_gbps.plot(x, [g for _, g, _ in mine], label=lab, **series_style(i))
        if any(q is not None for _, _, q in mine):
            ax_ratio.plot(x, [q for _, _, q in mine], label=lab, **series_style(i))
    for ax, ylab in ((ax_gbps, "GB/s"), (ax_ratio, ratio_label)):
        if ax is None:
            continue
        _log_x(ax)
        ax.set_xlabel("payload (MiB)")
        ax.set_ylabel(ylab, fontsize=8)
        ax.grid(alpha=0.3)


def kernels_png(stem: str, rows: list[dict], img_dir: Path, env: dict) -> list[Path]:
    """One PNG per (layout, dtype): a column per op; GB/s vs payload per backend with the
    same-run ``copy_`` ceiling on top, the ratio to it below. Rows with as-called figures get
    three rows of axes: as-called GB/s, as-called ratio, then device time's ratio (the same
    ceiling); rows made before them get the two rows of device time."""
    plt = _plt()
    out = []
    groups = defaultdict(list)
    for r in rows:
        groups[(r["layout"], r["dtype"])].append(r)
    for (layout, dtype), rs in groups.items():
        ops = list(dict.fromkeys(r["op"] for r in rs))
        both = any(r.get("as_called_ratio") is not None for r in rs)
        fig, axes = plt.subplots(3 if both else 2, len(ops), figsize=(4.4 * len(ops), 9.2 if both else 6.4),
                                 squeeze=False)
        for k, op in enumerate(ops):
            ors = [r for r in rs if r["op"] == op]
            ceil = list({(r["payload_bytes"], r["ceiling_gbps"]) for r in ors if r["ceiling_gbps"]})
            if both:
                _bandwidth_axes(axes[0][k], axes[1][k], ors, [("copy_", ceil)], "as_called_",
                                "as called: ratio to the same-run ceiling")
                _bandwidth_axes(None, axes[2][k], ors, [], "", "device time: ratio to the ceiling")
            else:
                _bandwidth_axes(axes[0][k], axes[1][k], ors, [("copy_", ceil)])
            axes[0][k].set_title(f"{op} · {layout} · {dtype}" + (" · as called" if both else ""),
                                 fontsize=9)
        axes[0][0].legend(fontsize=6)
        what = "as called (GB/s, ratio) and device time (ratio)" if both else "GB/s and ratio"
        out.append(_save(fig, img_dir / f"{stem}-{layout}-{dtype}.png",
                         f"kernels: {what} to the same-run copy_ ceiling ({rs[0]['geometry']})", env))
    return out


def transfer_png(stem: str, rows: list[dict], img_dir: Path, env: dict) -> list[Path]:
    """Connector GB/s vs payload with each ceiling (black, its own dashes), and the ratio of each
    connector to its own ceiling."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    ceil = defaultdict(list)
    for r in rows:
        if r["op"] == "ceiling":
            ceil[r["backend"]].append((r["payload_bytes"], r["gbps"]))
    moved = [r for r in rows if r["op"] != "ceiling"]
    _bandwidth_axes(a, b, moved, list(ceil.items()))
    a.set_title("P->D transfer", fontsize=9)
    b.set_title("ratio to the connector's ceiling", fontsize=9)
    a.legend(fontsize=7)
    return [_save(fig, img_dir / f"{stem}-transfer.png", "connectors: GB/s and ratio to the ceiling", env)]


def bandwidth_png(stem: str, rows: list[dict], img_dir: Path, env: dict) -> list[Path]:
    """Other rows with a same-run ceiling (e.g. GPU-to-GPU copies): GB/s and ratio vs payload."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    name = (rows[0].get("config") or {}).get("ceiling", "copy_")
    ceil = list({(r["payload_bytes"], r["ceiling_gbps"]) for r in rows if r["ceiling_gbps"]})
    _bandwidth_axes(a, b, rows, [(name, ceil)])
    a.legend(fontsize=6)
    ops = ", ".join(dict.fromkeys(r["op"] for r in rows))
    return [_save(fig, img_dir / f"{stem}-bandwidth.png", f"{ops}: GB/s and ratio to the ceiling", env)]


def serve_png(stem: str, rows: list[dict], img_dir: Path, env: dict) -> list[Path]:
    """TTFT and TPOT CDFs, one line per (mode, rate)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for i, r in enumerate(rows):
            xs = sorted(r.get(key) or [])
            if xs:
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
                st = series_style(i)
                ax.step(xs, ys, where="post", color=st["color"], linestyle=st["linestyle"],
                        label=f"{r['backend']} @ {r.get('rate')} req/s")
                ax.plot(xs[-1:], ys[-1:], marker=st["marker"], color=st["color"], ms=4)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [_save(fig, img_dir / f"{stem}-serve-cdf.png", "served requests: TTFT and TPOT CDFs", env)]


#: Bar quantities, first found wins: (row key, axis label, clip to [0, 1]).
BAR_KEYS = (("hidden_frac", "fraction of the transfer hidden", True),
            ("slowdown", "prefill slowdown (beside / alone - 1)", False),
            ("exposed_ms", "exposed transfer (ms)", False),
            ("exposed_s", "exposed transfer (s)", False))


def _bar_label(r: dict) -> str:
    ctas = r.get("max_ctas", (r.get("config") or {}).get("max_ctas"))
    name = r["backend"] if r["op"] in ("contention", "serve_ipc_gpu") else f"{r['op']} ({r['backend']})"
    return name + (f" ctas={ctas}" if ctas is not None else "")


def bars_png(stem: str, rows: list[dict], img_dir: Path, tag: str, env: dict) -> list[Path]:
    """Grouped bars of the first of :data:`BAR_KEYS` the rows carry, per (label, tokens).
    A clipped quantity outside [0, 1] is drawn at the bound and the title says how many were."""
    key = next((k for k in BAR_KEYS if any(isinstance(r.get(k[0]), (int, float)) for r in rows)), None)
    if key is None:
        return []
    key, ylabel, clip = key
    plt = _plt()
    rows = [r for r in rows if isinstance(r.get(key), (int, float))]
    if key == "hidden_frac":  # defined only where copies run beside the prefill
        rows = [r for r in rows if r["op"] in ("layerwise_event", "layerwise_signal")]
    labels = list(dict.fromkeys(_bar_label(r) for r in rows))
    toks = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(labels) * len(toks)), 4.2))
    width = 0.8 / max(1, len(labels))
    clipped = 0
    for i, lab in enumerate(labels):
        vals = {r["tokens"]: r[key] for r in rows if _bar_label(r) == lab}
        ys = [vals.get(t, 0.0) for t in toks]
        if clip:
            clipped += sum(not 0.0 <= y <= 1.0 for y in ys)
            ys = [min(1.0, max(0.0, y)) for y in ys]
        ax.bar([j + i * width for j in range(len(toks))], ys, width, label=lab,
               color=COLORS[i % len(COLORS)], hatch=HATCHES[(i // len(COLORS)) % len(HATCHES)],
               edgecolor="black", lw=0.4)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(toks))], [str(t) for t in toks])
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    title = f"{tag}: {ylabel}"
    if clipped:
        title += f"\n{clipped} value{'s' if clipped > 1 else ''} outside [0, 1] drawn at the bound"
        if env.get("device_type") == "cpu":
            title += " (CPU: the copies share the prefill's cores; not a measure of overlap)"
    return [_save(fig, img_dir / f"{stem}-{tag}.png", title, env)]


def plot_file(stem: str, kinds: dict[str, list[dict]], img_dir: Path, env: dict) -> list[Path]:
    """Every plot of one result file (rows already split by kind by the report)."""
    out = []
    if kinds.get("kernels"):
        out += kernels_png(stem, kinds["kernels"], img_dir, env)
    if kinds.get("transfer"):
        out += transfer_png(stem, kinds.get("ceiling", []) + kinds["transfer"], img_dir, env)
    if kinds.get("serve"):
        out += serve_png(stem, kinds["serve"], img_dir, env)
    if kinds.get("contention"):
        out += bars_png(stem, kinds["contention"], img_dir, "contention", env)
    other = kinds.get("other") or []
    copies = [r for r in other if r.get("ratio") is not None and r.get("gbps")
              and not r["op"].startswith(("layerwise", "signal", "serve", "copy_", "ceiling"))]
    if copies:
        out += bandwidth_png(stem, copies, img_dir, env)
    if other:
        out += bars_png(stem, other, img_dir, "overlap", env)
    return out
