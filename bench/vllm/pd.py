"""TTFT and transfer ms of kvflow's vLLM connector, transport tcp and transport nixl, beside
vLLM's own ExampleConnector (the one vLLM connector that moves KV between two engines on a CPU
host without other packages), on the same prompts in one run.

``PYTHONPATH=. python -m bench.vllm.pd [--reps N]`` (from the repo root, in the vLLM venv, with
``nixl-cu12`` installed); writes ``bench/results/raw/vllm-pd-cpu-<date>.json``. Engines: a plain
vLLM engine (colocated TTFT), a kvflow P/D pair per transport, each behind kvflow's proxy, and
an ExampleConnector P/D pair (P saves the prompt's KV to safetensors files in a shared folder,
D loads them). NIXL runs over UCX's TCP transport (``UCX_TLS=tcp``, the network path; on one
host UCX would otherwise take shared memory).

Per prompt length, ``reps`` distinct random prompts (after one warm-up). TTFT, client send ->
first streamed token, ms: colocated; kvflow through its proxy; kvflow and ExampleConnector
driven directly (client -> P with ``max_tokens=1``, then client -> D; the direct kvflow prompt
is the reversed one, so no prefix hit). Transfer ms: kvflow, D's whole pull as D's log line
gives it (tcp: P's gather, ZMQ frames, D's scatter; nixl: the ZMQ check with P, the READ and its
wait); ExampleConnector, P's save + D's load (:mod:`bench.vllm.timed_example`). Summaries:
median, p10, p90 over the prompts of a length. The 1-minute load average is sampled at every
prompt: the host's cores are shared with other work.
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
TRANSPORTS = ("tcp", "nixl")
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


def start(procs: Procs, model: str, store: pathlib.Path) -> dict[str, str]:
    names = ["REF", "EP", "ED"] + [f"{r}{t}" for t in TRANSPORTS for r in ("P", "D", "X")]
    ports = {k: free_port() for k in names + [f"kv{t}" for t in TRANSPORTS]}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in names}
    example = {"kv_connector": "TimedExampleConnector",
               "kv_connector_module_path": "bench.vllm.timed_example", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    procs.start("REF", engine_cmd(model, ports["REF"], None))
    for t in TRANSPORTS:
        procs.start(f"P{t}", engine_cmd(model, ports[f"P{t}"], kvflow_config(
            "kv_producer", kvflow_port=ports[f"kv{t}"], transport=t)))
        procs.start(f"D{t}", engine_cmd(model, ports[f"D{t}"], kvflow_config(
            "kv_consumer", transport=t)))
        procs.start(f"X{t}", [sys.executable, "-m", "kvflow.integrations.vllm.proxy",
                              "--prefill", url[f"P{t}"], "--decode", url[f"D{t}"],
                              "--port", str(ports[f"X{t}"])])
    procs.start("EP", engine_cmd(model, ports["EP"], example))
    procs.start("ED", engine_cmd(model, ports["ED"], example))
    procs.wait_healthy(url)
    return url


def one_prompt(url: dict[str, str], tails: dict[str, LogTail], prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    row = {"tokens": len(prompt), "load_1min": os.getloadavg()[0],
           "colocated_ttft_ms": stream_ttft(url["REF"], body)}  # first: no prefix hit
    ref_tokens = tokens(complete(url["REF"], prompt, 8))
    for t in TRANSPORTS:
        row[f"kvflow_{t}_ttft_ms"] = stream_ttft(url[f"X{t}"], body)
        row[f"kvflow_{t}_direct_ttft_ms"] = direct_ttft(url[f"P{t}"], url[f"D{t}"],
                                                        dict(body, prompt=prompt[::-1]))
    row["example_direct_ttft_ms"] = direct_ttft(url["EP"], url["ED"], body)
    row["example_tokens_match_colocated"] = tokens(complete(url["ED"], prompt, 8)) == ref_tokens
    time.sleep(0.3)  # let the log lines land
    for t in TRANSPORTS:
        row[f"kvflow_{t}_transfer_ms"] = tails[t].new()  # proxy pull, direct pull
    row["example_save_ms"] = sum(tails["save"].new())
    row["example_load_ms"] = sum(tails["load"].new())
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Per length: ``{metric: {median, p10, p90}}`` over the prompts (transfer: every pull)."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        rs = [r for r in rows if r["tokens"] == n]
        s: dict = {"tokens": n, "prompts": len(rs)}
        for k in rs[0]:
            if k.endswith("_ms") or k == "load_1min":
                vals = [v for r in rs for v in (r[k] if isinstance(r[k], list) else [r[k]])]
                q = statistics.quantiles(vals, n=10, method="inclusive")
                s[k] = {"median": statistics.median(vals), "p10": q[0], "p90": q[8]}
        s["example_tokens_match"] = all(r["example_tokens_match_colocated"] for r in rs)
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="prompts per length (after a warm-up)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt tokens")
    args = ap.parse_args()
    if args.reps < 2:
        ap.error(f"--reps must be >= 2 (a p10/p90 needs several prompts), got {args.reps}")
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvflow-vllm-bench-"))
    model = str(build(tmp / "tiny-llama"))
    (tmp / "example-store").mkdir()
    procs = Procs(tmp)
    load_before = os.getloadavg()
    try:
        url = start(procs, model, tmp / "example-store")
        tails = {t: LogTail(procs, f"D{t}", PULL + t) for t in TRANSPORTS}
        tails["save"] = LogTail(procs, "EP", r"timed-example: save ([\d.]+) ms")
        tails["load"] = LogTail(procs, "ED", r"timed-example: load ([\d.]+) ms")
        g = torch.Generator().manual_seed(1800)
        rows = []
        for n in lengths:
            for rep in range(args.reps + 1):  # rep 0 warms up
                row = one_prompt(url, tails, torch.randint(8, 512, (n,), generator=g).tolist())
                if rep:
                    rows.append(row)
                print(row if rep else f"warm-up {n}", flush=True)
    finally:
        procs.close()
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
           "baseline": "vllm ExampleConnector (safetensors files in a shared folder)",
           "summary": summarize(rows), "rows": rows}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path("bench/results/raw") / f"vllm-pd-cpu-{stamp}.json"  # not report schema
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    print(path)


if __name__ == "__main__":
    main()
