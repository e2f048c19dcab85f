"""TTFT and transfer ms of kvflow's vLLM connector (transports tcp, nixl and ipc-push) beside
vLLM's NixlConnector (needs the ``nixl`` package) and ExampleConnector (safetensors files in a
shared folder), on a CPU host; same prompts, one run.

``PYTHONPATH=. python -m bench.vllm.pd [--reps N] [--phases ...]`` (repo root, the vLLM venv with
``nixl`` and ``nixl-cu12``) writes ``bench/results/raw/vllm-pd-cpu-<date>.json``; ``--table FILE``
prints a result's markdown table.

Phases, one system's engines at a time (idle CPU engines poll busily): ``colocated``, ``tcp``,
``nixl``, ``ipc-push`` (kvflow's connector), ``example``, ``vllm_nixl``; every P/D pair behind
kvflow's proxy (which passes P's transfer params on as they are, so it fronts vLLM's connectors
too). Both NIXL users run UCX over TCP (``UCX_TLS=tcp``). Per length and round, ``reps`` random
prompts after one warm-up; every other round runs the phases in reverse order (a drifting load
falls on every phase alike). Every engine runs with ``OMP_WAIT_POLICY=PASSIVE``
(:class:`tests.vllm_pd.Procs`); one kept-alive ``httpx.Client`` times every request (a new
client costs 25-60 ms here, its SSL context). Per prompt: TTFT (client send -> first streamed
token, ms); greedy tokens through the proxy again against colocated's
(``<phase>_tokens_match``); transfer ms: kvflow's from D's log line (D's whole pull), the
NixlConnector's mean ``vllm:nixl_xfer_time_seconds`` over the prompt's READs, the
ExampleConnector's save and load (:mod:`bench.vllm.timed_example`). Summaries: median, p10, p90
per length; the 1-minute load average at every prompt (``<phase>_load_1min``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from kvflow.bench.ports import free_port
from kvflow.integrations.vllm.tiny_llama import build
from tests.vllm_pd import Procs, complete, engine_cmd, kvflow_config, metric, tokens

LENGTHS = (128, 512, 1000)
TRANSPORTS = ("tcp", "nixl", "ipc-push")  # kvflow.integrations.vllm.config.TRANSPORTS
PULL = r"pulled \d+ blocks \(\d+ bytes\) of \S+ in ([\d.]+) ms over "


CLIENT = httpx.Client(timeout=120)


def stream_ttft(url: str, body: dict, t0: float | None = None) -> float:
    """ms from ``t0`` (default: now) to the first streamed chunk of ``url``."""
    t0 = time.perf_counter() if t0 is None else t0
    with CLIENT.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True)) as r:
        ttft = None
        for chunk in r.iter_lines():
            if ttft is None and chunk.startswith("data:"):
                ttft = (time.perf_counter() - t0) * 1e3
    if ttft is None:
        raise RuntimeError(f"{url}: no streamed token")
    return ttft


class LogTail:
    """The numbers a regex finds in a process log since the last call."""

    def __init__(self, procs: Procs, name: str, pattern: str) -> None:
        self.procs, self.name, self.pattern, self.seen = procs, name, pattern, 0

    def new(self) -> list[float]:
        found = [float(x) for x in re.findall(self.pattern, self.procs.log(self.name))]
        out, self.seen = found[self.seen:], len(found)
        return out


def start_pd(procs: Procs, model: str, p_kv: dict, d_kv: dict,
             env: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """Engines P and D with these ``--kv-transfer-config`` values (and per-engine ``env``)
    and kvflow's proxy X in front of them; their URLs."""
    ports = {k: free_port() for k in ("P", "D", "X")}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in ports}
    for k, kv in (("P", p_kv), ("D", d_kv)):
        procs.start(k, engine_cmd(model, ports[k], kv), **(env or {}).get(k, {}))
    procs.start("X", [sys.executable, "-m", "kvflow.integrations.vllm.proxy",
                      "--prefill", url["P"], "--decode", url["D"], "--port", str(ports["X"])])
    return url


def through_proxy(name: str, url: dict[str, str], prompt: list[int]) -> dict:
    """TTFT through the proxy, then the greedy tokens of the same prompt through it again."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return {f"{name}_ttft_ms": stream_ttft(url["X"], body),
            f"{name}_tokens": tokens(complete(url["X"], prompt, 8))}


def _kvflow_phase(t: str):
    def start(procs: Procs, model: str, tmp: pathlib.Path) -> dict[str, str]:
        kv_port = free_port()
        return start_pd(procs, model,
                        kvflow_config("kv_producer", kvflow_port=kv_port, transport=t),
                        kvflow_config("kv_consumer", transport=t))

    def measure(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
        tail.setdefault("pull", LogTail(procs, "D", PULL + t))
        key = f"kvflow_{t.replace('-', '_')}"  # ipc-push: kvflow_ipc_push_*
        row = through_proxy(key, url, prompt)
        time.sleep(0.3)  # let the log line land
        row[f"{key}_transfer_ms"] = tail["pull"].new()[:1]  # the second: a prefix hit
        return row
    return start, measure


def _colocated_start(procs: Procs, model: str, tmp: pathlib.Path) -> dict[str, str]:
    port = free_port()
    procs.start("REF", engine_cmd(model, port, None))
    return {"REF": f"http://127.0.0.1:{port}"}


def _colocated(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return {"colocated_ttft_ms": stream_ttft(url["REF"], body),  # first: no prefix hit
            "colocated_tokens": tokens(complete(url["REF"], prompt, 8))}


def _example_start(procs: Procs, model: str, tmp: pathlib.Path) -> dict[str, str]:
    """vLLM's ExampleConnector on P and D (``kv_both``): P saves every prompt's KV to
    safetensors files in a shared folder, D loads the blocks of a prompt it finds there."""
    (tmp / "example-store").mkdir()
    example = {"kv_connector": "TimedExampleConnector",
               "kv_connector_module_path": "bench.vllm.timed_example", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-store")}}
    return start_pd(procs, model, example, example)


def _example(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
    tail.setdefault("save", LogTail(procs, "P", r"timed-example: save ([\d.]+) ms"))
    tail.setdefault("load", LogTail(procs, "D", r"timed-example: load ([\d.]+) ms"))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    row = {"example_ttft_ms": stream_ttft(url["X"], body)}
    time.sleep(0.3)
    row["example_save_ms"] = sum(tail["save"].new())
    row["example_load_ms"] = sum(tail["load"].new())
    row["example_tokens"] = tokens(complete(url["X"], prompt, 8))
    time.sleep(0.3)
    tail["save"].new(), tail["load"].new()  # the second request's, not counted
    return row


def _vllm_nixl_start(procs: Procs, model: str, tmp: pathlib.Path) -> dict[str, str]:
    """vLLM's own NixlConnector (``kv_both``; each engine's side channel on its own port)."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    env = {k: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} for k in ("P", "D")}
    return start_pd(procs, model, nixl, nixl, env)


XFER = "vllm:nixl_xfer_time_seconds"


def _vllm_nixl(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
    """Transfer ms: the mean of D's ``vllm:nixl_xfer_time_seconds`` over this prompt's READs
    (vLLM publishes the connector's stats with its periodic log: waited for, up to 15 s)."""
    before = (metric(url["D"], XFER + "_sum"), metric(url["D"], XFER + "_count"))
    row = through_proxy("vllm_nixl", url, prompt)
    deadline = time.monotonic() + 15
    while (n := metric(url["D"], XFER + "_count") - before[1]) < 1 and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    total = metric(url["D"], XFER + "_sum") - before[0]
    row["vllm_nixl_transfer_ms"] = [total / n * 1e3] if n else []
    return row


#: One system at a time (its engines alone on the host), each over the same prompts.
PHASES = {"colocated": (_colocated_start, _colocated),
          **{t: _kvflow_phase(t) for t in TRANSPORTS},
          "example": (_example_start, _example), "vllm_nixl": (_vllm_nixl_start, _vllm_nixl)}


def run_phase(name: str, model: str, lengths: list[int], reps: int,
              seed: int = 1800) -> list[dict]:
    """Start phase ``name``'s engines, measure ``reps`` prompts per length after a warm-up one,
    stop them. Prompts depend only on ``seed``: every phase of a round sees the same."""
    start, measure = PHASES[name]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"kvflow-vllm-bench-{name}-"))
    procs, tail, rows = Procs(tmp), {}, []
    try:
        url = start(procs, model, tmp)
        procs.wait_healthy(url)
        g = torch.Generator().manual_seed(seed)
        for n in lengths:
            for rep in range(reps + 1):  # rep 0 warms up
                prompt = torch.randint(8, 512, (n,), generator=g).tolist()
                row = {"tokens": n, "rep": rep, f"{name}_load_1min": os.getloadavg()[0],
                       **measure(url, procs, tail, prompt)}
                if rep:
                    rows.append(row)
                print(name, row if rep else f"warm-up {n}", flush=True)
    finally:
        procs.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per length: ``{metric: {median, p10, p90}}`` over the prompts (transfer: every pull)."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        rs = [r for r in rows if r["tokens"] == n]
        s: dict = {"tokens": n, "prompts": len(rs)}
        for k in rs[0]:
            if k.endswith("_ms") or k.endswith("_load_1min"):
                vals = [v for r in rs for v in (r[k] if isinstance(r[k], list) else [r[k]])]
                q = statistics.quantiles(vals, n=10, method="inclusive")
                s[k] = {"median": statistics.median(vals), "p10": q[0], "p90": q[8]}
        for k in rs[0]:  # every baseline's greedy tokens against the colocated engine's
            if k.endswith("_tokens") and k != "colocated_tokens" and "colocated_tokens" in rs[0]:
                s[k + "_match"] = all(r[k] == r["colocated_tokens"] for r in rs)
        out.append(s)
    return out


def markdown(result: dict) -> str:
    """A result's summary as a markdown table: a row per metric (ms), a column per length."""
    summary = result["summary"]
    keys = [k for k in summary[0] if k.endswith("_ms")]
    head = "| ms, median (p10-p90) | " + " | ".join(f"{s['tokens']} tokens"
                                                    for s in summary) + " |"
    lines = [head, "|---" * (len(summary) + 1) + "|"]
    for k in keys:
        cells = [f"{s[k]['median']:.1f} ({s[k]['p10']:.1f}-{s[k]['p90']:.1f})" for s in summary]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10,
                    help="prompts per length and round (after a warm-up)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of the five phases, in reverse order every other round (a "
                         "drifting load on a shared host then falls on every phase alike)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt tokens")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"phases to run, of {','.join(PHASES)}")
    ap.add_argument("--table", metavar="JSON",
                    help="print the markdown table of a result file and exit")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(pathlib.Path(args.table).read_text())))
        return
    phases = args.phases.split(",")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"--phases: unknown {unknown}; choose from {','.join(PHASES)}")
    if args.reps < 2:
        ap.error(f"--reps must be >= 2 (a p10/p90 needs several prompts), got {args.reps}")
    lengths = [int(x) for x in args.lengths.split(",")]
    model = str(build(pathlib.Path(tempfile.mkdtemp(prefix="kvflow-vllm-bench-")) / "tiny-llama"))
    load_before = os.getloadavg()
    merged: dict[tuple[int, int, int], dict] = {}
    for rnd in range(args.rounds):
        order = phases if rnd % 2 == 0 else phases[::-1]
        for name in order:
            for row in run_phase(name, model, lengths, args.reps, seed=1800 + rnd):
                merged.setdefault((rnd, row["tokens"], row["rep"]), {"round": rnd}).update(row)
    rows = list(merged.values())
    import nixl_cu12
    import vllm
    from importlib.metadata import version
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    out = {"bench": "vllm-pd", "device": f"cpu ({cpu}, {os.cpu_count()} cores, "
                                        f"{torch.get_num_threads()} torch threads)",
           "vllm": vllm.__version__, "torch": torch.__version__,
           "nixl": version("nixl-cu12"), "nixl_module": nixl_cu12.__name__,
           "ucx_tls": os.environ.get("UCX_TLS", "tcp"),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "model": "random 2-layer Llama (hidden 128, 2 KV heads, head_dim 32), float32, "
                    "block_size 32", "max_tokens": 8, "reps": args.reps,
           "rounds": args.rounds,
           "baselines": "vllm NixlConnector (UCX over TCP); vllm ExampleConnector (safetensors "
                        "files in a shared folder)",
           "phases": "one system's engines at a time: " + ", ".join(phases),
           "summary": summarize(rows), "rows": rows}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path("bench/results/raw") / f"vllm-pd-cpu-{stamp}.json"  # not report schema
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    print(path)


if __name__ == "__main__":
    main()
