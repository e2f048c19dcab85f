"""One results schema for every benchmark (CLI and pytest-benchmark suites alike).

A result file is JSON: ``{"schema": SCHEMA_VERSION, "complete": bool, "interrupted": signal name
or null, "env": env_info(), "rows": [row, ...]}`` (``complete`` false: a SIGINT or SIGTERM stopped
the study and ``rows`` are those measured before it, :mod:`kvflow.bench.record`).
A row (see :func:`make_row`) always carries the fields of ``ROW_FIELDS``; extra keys are allowed
(e.g. ``prefill_ms`` for overlap studies). Ratios are to a ceiling measured in the same run on the
same device (``dst.copy_(src)`` of the same payload bytes); docs/design.md, "Measuring".
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

ROW_FIELDS = (
    "op", "backend", "layout", "dtype", "geometry", "tokens", "blocks", "payload_bytes",
    "time_s", "time_p10_s", "time_p90_s", "gbps", "ceiling_gbps", "ratio", "baseline_ratio",
    "device", "torch", "triton", "numba", "commit", "date", "config", "seed",
)


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001 - absent package
        return None


def git_commit(repo: str | os.PathLike | None = None) -> str:
    """Short commit of the checkout (``+dirty`` if it has uncommitted changes), or 'unknown'.

    ``KVFLOW_COMMIT`` wins when set (a copy of the tree without ``.git``, e.g. on a lent GPU).
    """
    if os.environ.get("KVFLOW_COMMIT"):
        return os.environ["KVFLOW_COMMIT"]
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha or "unknown") + ("+dirty" if sha and dirty else "")
    except Exception:  # noqa: BLE001
        return os.environ.get("KVFLOW_COMMIT", "unknown")


def device_name(device: Any = "cpu") -> str:
    """'NVIDIA H200' for a CUDA device, else the CPU model and core count."""
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} cores)"


@functools.lru_cache(maxsize=None)
def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else None
    except Exception:  # noqa: BLE001
        return None


def env_info(device: Any = "cpu") -> dict[str, Any]:
    """Device, driver and library versions, commit and date for a result file or row."""
    import torch
    return {
        "device": device_name(device),
        "device_type": torch.device(device).type,
        "driver": _driver() if torch.device(device).type == "cuda" else None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def make_row(env: dict[str, Any], *, op: str, backend: str, spec: Any, tokens: int, blocks: int,
             payload_bytes: int, times_s: list[float], ceiling_s: float | None,
             baseline_s: float | None = None, config: dict | None = None, seed: int | None = None,
             **extra: Any) -> dict[str, Any]:
    """Build one row from raw timings (seconds, one per repetition).

    ``gbps = payload_bytes / median / 1e9``; ``ratio = ceiling_time / median`` (the fraction of
    the same-run copy ceiling reached); ``baseline_ratio = baseline_time / median`` (speed-up over
    the baseline a user would otherwise pick).
    """
    ts = sorted(times_s)
    med = ts[len(ts) // 2]
    pick = lambda q: ts[min(len(ts) - 1, int(q * len(ts)))]  # noqa: E731
    geometry = (f"L{spec.num_layers}xH{spec.num_kv_heads}xD{spec.head_dim}xB{spec.block_size}"
                if spec is not None else None)
    row = {
        "op": op, "backend": backend,
        "layout": getattr(spec, "layout", None),
        "dtype": str(spec.dtype).removeprefix("torch.") if spec is not None else None,
        "geometry": geometry, "tokens": tokens, "blocks": blocks, "payload_bytes": payload_bytes,
        "time_s": med, "time_p10_s": pick(0.1), "time_p90_s": pick(0.9),
        "gbps": payload_bytes / med / 1e9 if med > 0 else None,
        "ceiling_gbps": payload_bytes / ceiling_s / 1e9 if ceiling_s else None,
        "ratio": ceiling_s / med if ceiling_s and med > 0 else None,
        "baseline_ratio": baseline_s / med if baseline_s and med > 0 else None,
        "device": env["device"], "torch": env["torch"], "triton": env["triton"],
        "numba": env["numba"], "commit": env["commit"], "date": env["date"],
        "config": config or {}, "seed": seed,
    }
    row.update(extra)
    return row


def as_called_fields(times_s: list[float], payload_bytes: int, ceiling_s: float | None,
                     baseline_s: float | None = None, *, calls: int | None = None) -> dict[str, Any]:
    """The as-called figures of a row, from seconds per call of each batch of back-to-back
    calls (:func:`kvflow.bench.timing.time_as_called`).

    Same definitions as :func:`make_row`: ``as_called_gbps = payload_bytes / median / 1e9``,
    ``as_called_ratio = ceiling_s / median`` (the same-run ``copy_`` ceiling, device time: the
    fraction of the hardware's copy rate a caller gets), ``as_called_baseline_ratio =
    baseline_s / median`` (``baseline_s``: the torch backend's as-called median);
    ``as_called_calls`` is the number of calls per batch.
    """
    ts = sorted(times_s)
    med = ts[len(ts) // 2]
    pick = lambda q: ts[min(len(ts) - 1, int(q * len(ts)))]  # noqa: E731
    return {"as_called_s": med, "as_called_p10_s": pick(0.1), "as_called_p90_s": pick(0.9),
            "as_called_gbps": payload_bytes / med / 1e9 if med > 0 else None,
            "as_called_ratio": ceiling_s / med if ceiling_s and med > 0 else None,
            "as_called_baseline_ratio": baseline_s / med if baseline_s and med > 0 else None,
            "as_called_calls": calls}


def write_results(path: str | os.PathLike, env: dict[str, Any], rows: list[dict[str, Any]], *,
                  interrupted: str | None = None) -> Path:
    """Write a result file (creating folders; atomically: a temporary file, then
    :func:`os.replace`); returns its path.

    ``interrupted``: the signal that stopped the study ("SIGINT", "SIGTERM"); the file then
    holds ``"complete": false, "interrupted": ...`` and the rows measured before it
    (:mod:`kvflow.bench.record`); else ``"complete": true, "interrupted": null``.
    """
    from . import load
    if "load" not in env:  # the host's load over the measurement (kvflow.bench.load)
        env = dict(env, load=load.finish())
    # a busy host flags the file (env.load.busy): every row in it; the rows stay as measured
    # (the same as the .partial.jsonl's)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA_VERSION, "complete": interrupted is None,
                               "interrupted": interrupted, "env": env, "rows": rows}, indent=1))
    os.replace(tmp, path)
    return path


def is_partial(data: dict[str, Any]) -> bool:
    """True for a result file a signal stopped (files made before the field are complete)."""
    return data.get("complete", True) is False


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read a result file, checking its schema version and required row fields."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
    for i, row in enumerate(data["rows"]):
        missing = [f for f in ROW_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: rows[{i}] lacks {missing}")
    return data


#: flags that choose where a result goes or how it prints, not what is measured: left out of
#: ``env["command"]`` and ``env["options"]`` so a result file names no one machine's paths
OUTPUT_FLAGS = {"--out-dir": 1, "--out": 1, "--no-progress": 0}


def command_line(argv: list[str] | None = None) -> str:
    """The command that produced a result file, as a user would retype it
    (``python -m kvflow.bench kernels --quick``), less :data:`OUTPUT_FLAGS`; stored in
    ``env["command"]``."""
    import shlex
    import sys
    argv, kept = list(sys.argv[1:] if argv is None else argv), []
    while argv:
        a = argv.pop(0)
        flag = a.split("=", 1)[0]
        if flag in OUTPUT_FLAGS:
            del argv[:OUTPUT_FLAGS[flag] if "=" not in a else 0]
        else:
            kept.append(a)
    return " ".join(["python -m kvflow.bench", *map(shlex.quote, kept)])


def measured_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` less the :data:`OUTPUT_FLAGS` (``out_dir``, ``out``, ``no_progress``)."""
    return {k: v for k, v in opts.items() if f"--{k.replace('_', '-')}" not in OUTPUT_FLAGS}


def slug(text: str) -> str:
    """File-name-safe lower-case form: 'NVIDIA H200' -> 'nvidia-h200'."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")[:48] or "unknown"


def result_path(out_dir: str | os.PathLike, name: str, env: dict[str, Any]) -> Path:
    """``<out_dir>/<name>-<device slug>-<YYYYMMDD-HHMMSS>.json`` (date from ``env["date"]``)."""
    dev = "cpu" if env.get("device_type") == "cpu" else slug(env["device"])
    stamp = env["date"][:19].replace("-", "").replace(":", "").replace("T", "-")
    return Path(out_dir) / f"{name}-{dev}-{stamp}.json"
