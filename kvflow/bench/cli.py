"""What every study's command line shares: list parsers, the preset / device / output flags,
option resolution, the result file (rows saved as measured, :mod:`kvflow.bench.record`), the
progress bar, and the one-line message for a missing
extra. Nothing here imports a GPU package (``--help`` of every study works without them)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

#: Which ``pip install 'kvflow[...]'`` extra provides an optional module.
EXTRAS = {"matplotlib": "bench", "tqdm": "bench", "pytest_benchmark": "bench",
          "zmq": "serve", "httpx": "serve", "msgspec": "serve", "triton": "gpu"}


def require(module: str, study: str):
    """Import ``module`` or exit with one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS.get(module.split(".")[0], "dev")
        raise SystemExit(f"kvflow.bench {study}: needs {module.split('.')[0]}: "
                         f"pip install 'kvflow[{extra}]'") from None


def csv(kind=str):
    """Parser of a comma list of ``kind``; for ints, 'none' (and 0) mean None (no cap)."""
    def parse(text: str) -> list:
        out = []
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            if kind is int and item.lower() in ("none", "0"):
                out.append(None)
                continue
            try:
                out.append(kind(item))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a {kind.__name__}")
        return out
    return parse


def tokens(text: str) -> list[int]:
    """Parser of request sizes in tokens: ``16,1K,64K``."""
    out = []
    for given in text.split(","):
        item = given.strip().upper()
        mult = 1024 if item.endswith("K") else 1
        try:
            n = int(item[:-1] if mult > 1 else item) * mult
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{given.strip()!r} is not a token count >= 1 "
                                             f"(e.g. 16,1K,64K)")
        out.append(n)
    return out


def positive_int(text: str) -> int:
    """Parser of an int >= 1 (``--block-size``)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return n


def add_common(p: argparse.ArgumentParser, *, device: bool = True, presets: bool = True) -> None:
    """``--quick``/``--full``, ``--device``, ``--threads``, ``--seed``, ``--out-dir``,
    ``--name``, ``--no-progress``."""
    if presets:
        g = p.add_mutually_exclusive_group()
        g.add_argument("--quick", dest="preset", action="store_const", const="quick",
                       help="small CPU preset (< 60 s on 2 cores; what CI runs); the default")
        g.add_argument("--full", dest="preset", action="store_const", const="full",
                       help="the H200 preset (minutes)")
    if device:
        p.add_argument("--device", default=None,
                       help="'cuda' or 'cpu' (default: cuda if available, else cpu)")
        p.add_argument("--threads", type=int,
                       help="CPU threads for torch and numba alike (default: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of block ids and data (default 0)")
    p.add_argument("--out-dir", default="bench/results", help="folder of result files")
    p.add_argument("--name", default=None, help="result file prefix (default: the study)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar and no line per row")


def resolve(args: argparse.Namespace, study: str) -> dict[str, Any]:
    """The study's preset (``--quick`` unless ``--full``) overlaid with the flags given (a bad
    ``--device`` is refused before torch is imported)."""
    from .presets import preset
    opts = preset(study, getattr(args, "preset", None))
    for key, val in vars(args).items():
        if key.startswith("_"):
            continue
        if val is not None or key not in opts:
            opts[key] = val
    opts["preset"] = getattr(args, "preset", None) or "quick"
    for key, least in (("reps", 1), ("warmup", 0), ("num_blocks", 1)):
        if isinstance(opts.get(key), int) and opts[key] < least:
            raise SystemExit(f"{study}: --{key.replace('_', '-')} must be >= {least}, got "
                             f"{opts[key]}")
    if "device" in opts and opts["device"] is not None:
        check_device(study, opts["device"])
    if "device" in opts and opts["device"] is None:
        import torch
        opts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.get("threads"):
        set_threads(opts["threads"])
    return opts


def check_device(study: str, device: str) -> None:
    """Refuse a ``--device`` this machine cannot run, in one line (SystemExit).

    Raises
    ------
    SystemExit
        ``device`` is not ``cpu``, ``cuda`` or ``cuda:N``, or CUDA is asked for without a
        CUDA build of torch and a visible GPU.
    """
    import re
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise SystemExit(f"kvflow.bench {study}: --device {device!r}: use cpu, cuda or cuda:N")
    if device == "cpu":
        return
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"kvflow.bench {study}: --device {device}: this torch "
                         f"({torch.__version__}) sees no CUDA GPU; use --device cpu")


def set_threads(n: int) -> None:
    """Same CPU thread count for torch and numba (a fair CPU comparison; also avoids OpenMP
    spin-waiting when other processes share the cores)."""
    import torch
    torch.set_num_threads(n)
    try:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def finish(args, opts: dict, env: dict, rows: list, extra_env: dict | None = None,
           t0: float | None = None) -> Path:
    """Write the study's result file (``<out-dir>/<name>-<device>-<date>.json``) holding the
    command line that made it; print and return its path."""
    from .record import sink_of
    from .schema import command_line, measured_options, result_path, write_results
    extra = dict(extra_env or {})
    if t0 is not None:
        extra["wall_s"] = time.perf_counter() - t0
    env = dict(env, command=command_line(getattr(args, "_argv", None)), kind=args.study,
               options=measured_options(opts), **extra)
    sink = sink_of(rows)
    if sink is not None:  # rows saved as measured: the result file replaces the .partial.jsonl
        path = sink.write(env)
    else:
        path = write_results(result_path(args.out_dir, args.name or args.study, env), env, rows)
    print(f"wrote {path} ({len(rows)} rows)")
    return path


def rows(env: dict, opts: dict | None = None) -> list:
    """The study's row list: rows appended are saved at once and shown
    (:func:`kvflow.bench.record.rows`)."""
    from .record import rows as _rows
    return _rows(env, opts)


class _NoBar:
    def __init__(self, *a, **k) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr when it is a terminal, else a silent stand-in (as when disabled or
    tqdm is absent; a log then gets the per-row lines of :mod:`kvflow.bench.record`)."""
    if enabled and sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            pass
    return _NoBar()
