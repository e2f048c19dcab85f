"""Result files -> ``docs/benchmarks.md`` + ``docs/img/*.png``.

The page is generated, never hand-edited: one section per device (its driver and library
versions, commit, date), then per result file the command that produced it and its tables
(kernels: as called, then device time, GB/s and ratio to the same-run ceiling per
op/layout/dtype, :mod:`kvflow.bench.kernel_report`; host time per call,
:mod:`kvflow.bench.calls`; contention; transfer; serve; interference; any other rows
generically) and plots (:mod:`kvflow.bench.plots`). A table never mixes devices: rows of two
devices in one result file raise, naming both. A headline table (the kernels' ratios at 1K and
16K tokens, NHD bf16) opens the page and is copied into the README between its headline
markers. A result file a signal stopped (``"complete": false``, :mod:`kvflow.bench.record`)
gets its section, labelled partial, but never feeds the headline.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from . import cli
from .interference_rows import markdown as interference_markdown, plot as interference_plot
from .ipc_served import today_flags
from .kernel_report import headline, kernel_tables, md_table as _md_table, update_readme
from .schema import is_partial, read_results
from .tables import contention_table, fmt as _fmt, reblock_table, serve_table, transfer_table

KERNEL_OPS = ("gather", "scatter", "copy")


def check_one_device(rows: list[dict], where: str) -> str:
    """The one device of ``rows``.

    Raises
    ------
    ValueError
        If two devices appear, naming both and ``where``.
    """
    devices = list(dict.fromkeys(r["device"] for r in rows))
    if len(devices) > 1:
        raise ValueError(f"{where}: refusing to mix devices in one table: "
                         f"{devices[0]!r} and {devices[1]!r}")
    return devices[0] if devices else ""


def generic_table(rows: list[dict]) -> list[str]:
    """Any other rows: the fixed fields plus every extra scalar field."""
    from .schema import ROW_FIELDS
    extra = [k for k in dict.fromkeys(k for r in rows for k in r)
             if k not in ROW_FIELDS and not isinstance(rows[0].get(k), (list, dict))]
    conf = [k for k in dict.fromkeys(k for r in rows for k in (r.get("config") or {}))
            if all(not isinstance((r.get("config") or {}).get(k), (list, dict)) for r in rows)]
    g = lambda v: _fmt(v, ".4g")  # noqa: E731 - small seconds stay readable
    head = ["op", "backend", *conf, "tokens", "time ms", "GB/s", *extra]
    cell = lambda v: today_flags(v) if isinstance(v, str) else g(v)  # noqa: E731
    body = [[r["op"], r["backend"], *[cell((r.get("config") or {}).get(k)) for k in conf], r["tokens"],
             g(r["time_s"] * 1e3), g(r["gbps"]), *[g(r.get(k)) for k in extra]] for r in rows]
    return _md_table(head, body)


#: Scripts that became studies: recorded command prefix -> study.
MOVED = {"python bench/ipc_gpu.py": "ipc", "python bench/layerwise_gpu.py": "layerwise",
         "python bench/soak.py": "soak"}


def current_command(cmd: str) -> str:
    """The ``python -m kvflow.bench`` command of today that reruns a recorded ``cmd`` (``cmd``
    itself when it still parses): a moved script becomes its study (``--smoke`` -> ``--quick``,
    no flag -> ``--full``), and ``--out`` / ``--out-dir PATH`` and ``--no-progress`` are dropped
    (where a run wrote its file and whether it drew a progress bar do not change a figure)."""
    import shlex
    prefix = "python -m kvflow.bench "
    for old, study in MOVED.items():
        if cmd.startswith(old):
            argv = shlex.split(cmd[len(old):])
            head = [study, "--quick" if "--smoke" in argv else "--full"]
            break
    else:
        if not cmd.startswith(prefix) or cmd.startswith(prefix + "report"):
            return cmd
        argv = shlex.split(cmd[len(prefix):])
        head = argv[:1]
        argv = argv[1:]
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--out-dir"):
            skip = True
        elif a not in ("--smoke", "--no-progress") and not a.startswith("--out-dir="):
            keep.append(a)
    return shlex.join(["python", "-m", "kvflow.bench", *head, *keep])


def file_section(path: Path, data: dict, md_dir: Path, img_dir: Path) -> list[str]:
    """Markdown of one result file: its command, host load, tables and plots."""
    from . import load, plots
    rows, env = data["rows"], data["env"]
    check_one_device(rows, str(path))
    cmd = env.get("command", "(not recorded)")
    now = current_command(cmd)
    out = [f"### `{path.name}`", "", f"Command: `{now}`"
           + (" (the result file records it in an earlier spelling)"
              if now != cmd else "")
           + (f" — {env['wall_s']:.0f} s wall" if env.get("wall_s") else "")
           + f" — commit {env.get('commit')}, {env.get('date')}", "",
           f"Host: {load.describe(env)}", ""]
    if (env.get("load") or {}).get("busy"):
        out += [f"**Busy host**: every row below was measured while the host was busy "
                f"({env['load']['busy_reason']}); its figures are not trusted.", ""]
    if is_partial(data):
        out += [f"**Partial**: stopped by {data.get('interrupted') or 'a signal'} after "
                f"{len(rows)} rows; the tables below hold only those rows.", ""]
    kinds = defaultdict(list)
    for r in rows:
        if "host_us" in r:
            kinds["calls"].append(r)
            continue
        if r.get("hops_ms"):
            kinds["served"].append(r)
            continue
        if "ratio_traffic" in r:
            kinds["reblock"].append(r)
            continue
        kinds[r["op"] if r["op"] in ("contention", "serve", "transfer", "ceiling") else
              "interference" if r["op"].startswith("interference_") else
              ("kernels" if r["op"] in KERNEL_OPS else "other")].append(r)
    if kinds["reblock"]:
        out += reblock_table(kinds["reblock"])
    if kinds["kernels"]:
        out += kernel_tables(kinds["kernels"])
    if kinds["calls"]:
        from .calls import calls_table
        out += calls_table(kinds["calls"])
    if kinds["contention"]:
        out += contention_table(kinds["contention"])
    if kinds["transfer"] or kinds["ceiling"]:
        out += transfer_table(kinds["ceiling"] + kinds["transfer"])
    if kinds["serve"]:
        out += serve_table(kinds["serve"])
    if kinds["served"]:
        from .hops import markdown
        out += markdown(kinds["served"])
    if kinds["interference"]:
        out += interference_markdown(kinds["interference"])
    if kinds["other"]:
        out += generic_table(kinds["other"])
    pngs = plots.plot_file(path.stem, kinds, img_dir, env)
    if kinds["interference"]:
        pngs.append(interference_plot(kinds["interference"], env, img_dir / f"{path.stem}.png"))
    for png in pngs:
        rel = os.path.relpath(png, md_dir)
        out += [f"![{png.stem}]({rel})", ""]
    for s in env.get("skipped") or []:
        out.append(f"- skipped: {', '.join(f'{k}={v}' for k, v in s.items())}")
    return out + [""]


def write_report(files: list[Path], out: Path, img_dir: Path, readme: Path | None = None) -> Path:
    """Write the report page for ``files``; returns ``out``. ``readme``: a file whose headline
    block (:func:`kvflow.bench.kernel_report.update_readme`) is rewritten too.

    Raises
    ------
    ValueError
        A result file whose rows name two devices (both named), or a bad schema.
    """
    from . import load
    loaded = [(Path(f), read_results(f)) for f in files]
    by_device = defaultdict(list)
    for path, data in loaded:
        by_device[check_one_device(data["rows"], str(path)) or data["env"]["device"]].append((path, data))
    out.parent.mkdir(parents=True, exist_ok=True)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# kvflow benchmarks", "",
             "Generated by `python -m kvflow.bench report` from the result files in "
             "`bench/results/` (`bench/results/README.md` says what each is); do not edit by hand. Every ratio is to a ceiling measured in the "
             "same run on the same device; rows of different devices never share a table. "
             "How to reproduce and read it: [tutorials/benchmarking.md](tutorials/benchmarking.md). "
             "Figures of other shapes live beside their guides: the NIXL connector's in "
             "[nixl.md](nixl.md), kvflow inside vLLM in [tutorials/vllm.md](tutorials/vllm.md) "
             "(raw files in `bench/results/raw/`).", "",
             "A study saves each row as it is measured; the first SIGINT or SIGTERM stops it "
             "and writes its result file with the rows so far, marked `\"complete\": false` "
             "and `\"interrupted\"` with the signal's name. Such a file's section below says "
             "**Partial** and how many rows it holds; it never feeds the headline. A run killed "
             "outright leaves `<result>.partial.jsonl`, which the report does not read.", ""]
    trusted, dropped = load.left_out([(p, d) for p, d in loaded if not is_partial(d)])
    top = headline(trusted)  # complete runs on an idle host only
    if dropped:
        lines += ["## Left out", "", *dropped, ""]
    if top:
        lines += ["## Headline", "",
                  "**As called** (the headline): back-to-back calls from Python with default "
                  "arguments, one sync per batch of calls, so wrapper work and any host sync "
                  "count. **Device time**: `validate=False`, per-call events with the device "
                  "queue filled first (only the kernels). Both over the same rotated ids and "
                  "buffers (cold L2), as ratios to the same device-time copy_ ceiling.", "", *top]
    for device in sorted(by_device, key=lambda d: ("(" in d, d)):  # GPUs before CPU names
        files_d = sorted(by_device[device], key=lambda pd: pd[0].name)
        env = files_d[-1][1]["env"]
        lines += [f"## {device}", "",
                  f"driver {env.get('driver') or '-'} · torch {env.get('torch')} · triton "
                  f"{env.get('triton')} · numba {env.get('numba')} · python {env.get('python')}", ""]
        for path, data in files_d:
            lines += file_section(path, data, out.parent, img_dir)
    out.write_text("\n".join(lines).rstrip() + "\n")
    if readme is not None:
        update_readme(readme, [(p, d) for p, d in loaded if not is_partial(d)])
    return out


def add_arguments(p) -> None:
    p.add_argument("files", nargs="*", help="result JSON files (default: <results>/*.json)")
    p.add_argument("--results", default="bench/results", help="folder read when no files given")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown file to write")
    p.add_argument("--img-dir", default="docs/img", help="folder of the PNG plots")
    p.add_argument("--readme", default="README.md",
                   help="file whose generated headline block is rewritten, if it has one")


def run(args) -> int:
    import sys
    cli.require("matplotlib", "report")
    files = [Path(f) for f in args.files] or sorted(Path(args.results).glob("*.json"))
    if not files:
        print(f"report: no result files in {args.results}", file=sys.stderr)
        return 1
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"report: no such result file: {', '.join(missing)}", file=sys.stderr)
        return 1
    out = write_report(files, Path(args.out), Path(args.img_dir), Path(args.readme))
    print(f"wrote {out}")
    page = out.read_text()
    for png in sorted(Path(args.img_dir).glob("*.png")):
        if f"{png.name})" not in page:
            print(f"report: {png} is not from these result files", file=sys.stderr)
    return 0
