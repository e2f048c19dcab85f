"""TTFT and transfer ms of kvflow's vLLM connector, transports tcp, nixl and ipc, beside
vLLM's own ExampleConnector (the one vLLM connector that moves KV between two engines on a CPU
host without other packages), on the same prompts in one run.

``PYTHONPATH=. python -m bench.vllm.pd [--reps N]`` (from the repo root, in the vLLM venv, with
``nixl-cu12`` installed); writes ``bench/results/raw/vllm-pd-cpu-<date>.json``. Five phases, one
system's engines at a time (vLLM's idle CPU engines poll busily: seven engines on two cores
measured their contention, at a load average of 12-16): a plain vLLM engine (colocated TTFT), a
kvflow P/D pair behind kvflow's proxy per transport, an ExampleConnector P/D pair (P saves the
prompt's KV to safetensors files in a shared folder, D loads them). NIXL runs over UCX's TCP
transport (``UCX_TLS=tcp``, the network path; on one host UCX would otherwise take shared
memory); ipc moves the KV through D's shared-memory staging cache (one host only).

Per prompt length and round, ``reps`` distinct random prompts (after one warm-up); ``rounds``
rounds of the five phases, every other one in reverse order. TTFT, client send ->
first streamed token, ms: colocated; kvflow through its proxy; kvflow and ExampleConnector
driven directly (client -> P with ``max_tokens=1``, then client -> D; the direct kvflow prompt
is the reversed one, so no prefix hit). Transfer ms: kvflow, D's whole pull as D's log line
gives it (tcp: P's gather, ZMQ frames, D's scatter; nixl: the ZMQ check with P, the READ and its
wait; ipc: the ZMQ ask, P's copy into D's staging, D's copy out); ExampleConnector, P's save + D's load (:mod:`bench.vllm.timed_example`). Summaries:
median, p10, p90 over the prompts of a length. The 1-minute load average is sampled at every
prompt (``<phase>_load_1min``): the host's cores are shared with other work.
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

from kvflow.integrations.vllm.tiny_llama import build
from tests.vllm_pd import Procs, complete, engine_cmd, free_port, kvflow_config, tokens

LENGTHS = (128, 512, 1000)
TRANSPORTS = ("tcp", "nixl", "ipc")
PULL = r"pulled \d+ blocks \(\d+ bytes\) of \S+ in ([\d.]+) ms over "


def stream_ttft(url: str, body: dict, t0: float | None = None) -> float:
    """ms from ``t0`` (default: now) to the first streamed chunk of ``url``."""
    t0 = time.perf_counter() if t0 is None else t0
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True),
                      timeout=120) as r:
        ttft = None
        for chunk in r.iter_lines():
            if ttft is None and chunk.startswith("data:"):
                ttft = (time.perf_counter() - t0) * 1e3
    if ttft is None:
        raise RuntimeError(f"{url}: no streamed token")
    return ttft


def direct_ttft(p_url: str, d_url: str, body: dict) -> float:
    """Client -> P (``max_tokens=1``, KV kept for D), then client -> D with P's params."""
    t0 = time.perf_counter()
    answer = httpx.post(f"{p_url}/v1/completions", timeout=120, json=dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})).json()
    return stream_ttft(d_url, dict(body, kv_transfer_params=answer["kv_transfer_params"]), t0)


class LogTail:
    """The numbers a regex finds in a process log since the last call."""

    def __init__(self, procs: Procs, name: str, pattern: str) -> None:
        self.procs, self.name, self.pattern, self.seen = procs, name, pattern, 0

    def new(self) -> list[float]:
        found = [float(x) for x in re.findall(self.pattern, self.procs.log(self.name))]
        out, self.seen = found[self.seen:], len(found)
        return out


def _kvflow_phase(t: str):
    def start(procs: Procs, model: str, tmp: pathlib.Path) -> dict[str, str]:
        ports = {k: free_port() for k in ("P", "D", "X", "kv")}
        url = {k: f"http://127.0.0.1:{ports[k]}" for k in ("P", "D", "X")}
        procs.start("P", engine_cmd(model, ports["P"], kvflow_config(
            "kv_producer", kvflow_port=ports["kv"], transport=t)))
        procs.start("D", engine_cmd(model, ports["D"], kvflow_config("kv_consumer",
                                                                     transport=t)))
        procs.start("X", [sys.executable, "-m", "kvflow.integrations.vllm.proxy",
                          "--prefill", url["P"], "--decode", url["D"], "--port", str(ports["X"])])
        return url

    def measure(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        row = {f"kvflow_{t}_ttft_ms": stream_ttft(url["X"], body),
               f"kvflow_{t}_direct_ttft_ms": direct_ttft(url["P"], url["D"],
                                                         dict(body, prompt=prompt[::-1]))}
        time.sleep(0.3)  # let the log lines land
        tail.setdefault("pull", LogTail(procs, "D", PULL + t))
        row[f"kvflow_{t}_transfer_ms"] = tail["pull"].new()  # proxy pull, direct pull
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
    (tmp / "example-store").mkdir()
    example = {"kv_connector": "TimedExampleConnector",
               "kv_connector_module_path": "bench.vllm.timed_example", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-store")}}
    ports = {k: free_port() for k in ("EP", "ED")}
    for k in ports:
        procs.start(k, engine_cmd(model, ports[k], example))
    return {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}


def _example(url: dict[str, str], procs: Procs, tail: dict, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    row = {"example_direct_ttft_ms": direct_ttft(url["EP"], url["ED"], body),
           "example_tokens": tokens(complete(url["ED"], prompt, 8))}
    time.sleep(0.3)
    tail.setdefault("save", LogTail(procs, "EP", r"timed-example: save ([\d.]+) ms"))
    tail.setdefault("load", LogTail(procs, "ED", r"timed-example: load ([\d.]+) ms"))
    row["example_save_ms"] = sum(tail["save"].new())
    row["example_load_ms"] = sum(tail["load"].new())
    return row


#: One system at a time (its engines alone on the host), each over the same prompts.
PHASES = {"colocated": (_colocated_start, _colocated), "tcp": _kvflow_phase("tcp"),
          "nixl": _kvflow_phase("nixl"), "ipc": _kvflow_phase("ipc"),
          "example": (_example_start, _example)}


def run_phase(name: str, model: str, lengths: list[int], reps: int,
              seed: int = 1800) -> list[dict]:
    """Start phase ``name``'s engines, measure ``reps`` prompts per length (after one warm-up
    prompt per length), stop them. Prompts depend only on ``seed``: every phase of a round
    sees the same."""
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
        if "example_tokens" in rs[0] and "colocated_tokens" in rs[0]:
            s["example_tokens_match"] = all(r["example_tokens"] == r["colocated_tokens"]
                                            for r in rs)
        out.append(s)
    return out


def markdown(result: dict) -> str:
    """The summary of a result file as a markdown table: one row per metric (ms), one column
    per prompt length, ``median (p10-p90)``."""
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
           "ucx_tls": os.environ.get("UCX_TLS", "tcp"), "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "model": "random 2-layer Llama (hidden 128, 2 KV heads, head_dim 32), float32, "
                    "block_size 32", "max_tokens": 8, "reps": args.reps,
           "rounds": args.rounds,
           "baseline": "vllm ExampleConnector (safetensors files in a shared folder)",
           "phases": "one system's engines at a time: " + ", ".join(phases),
           "summary": summarize(rows), "rows": rows}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path("bench/results/raw") / f"vllm-pd-cpu-{stamp}.json"  # not report schema
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    print(path)


if __name__ == "__main__":
    main()
