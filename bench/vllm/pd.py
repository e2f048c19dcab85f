"""TTFT and transfer ms of kvflow's vLLM connector beside vLLM's own ExampleConnector (the one
vLLM connector that moves KV between two engines on a CPU host), same prompts, same run.

``python -m bench.vllm.pd`` (from the repo root, in the vLLM venv); writes
``bench/results/raw/vllm-pd-cpu-<date>.json``. Engines: a plain vLLM engine (colocated TTFT), a
kvflow P/D pair behind kvflow's proxy, an ExampleConnector P/D pair (P saves the prompt's KV to
safetensors files in a shared folder, D loads them; driven the same way: P with max_tokens=1,
then D; kvflow also through its proxy). TTFT: client send -> first streamed token, ms. Transfer: kvflow, D's pull (gather on P,
ZMQ, scatter on D); ExampleConnector, P's save + D's load (both logged by
:mod:`bench.vllm.timed_example`).
"""

from __future__ import annotations

import datetime
import json
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
REPS = 3


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


def new_ms(text: str, pattern: str, seen: int) -> tuple[list[float], int]:
    found = [float(x) for x in re.findall(pattern, text)]
    return found[seen:], len(found)


def main() -> None:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvflow-vllm-bench-"))
    model = str(build(tmp / "tiny-llama"))
    store = tmp / "example-store"
    store.mkdir()
    procs = Procs(tmp)
    ports = {k: free_port() for k in ("REF", "KP", "KD", "X", "EP", "ED", "kv")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items() if k != "kv"}
    example = {"kv_connector": "TimedExampleConnector",
               "kv_connector_module_path": "bench.vllm.timed_example", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    try:
        procs.start("REF", engine_cmd(model, ports["REF"], None))
        procs.start("KP", engine_cmd(model, ports["KP"], kvflow_config(
            "kv_producer", kvflow_port=ports["kv"])))
        procs.start("KD", engine_cmd(model, ports["KD"], kvflow_config("kv_consumer")))
        procs.start("EP", engine_cmd(model, ports["EP"], example))
        procs.start("ED", engine_cmd(model, ports["ED"], example))
        procs.start("X", [sys.executable, "-m", "kvflow.integrations.vllm.proxy", "--prefill",
                          url["KP"], "--decode", url["KD"], "--port", str(ports["X"])])
        procs.wait_healthy(url)
        g = torch.Generator().manual_seed(1800)
        rows, seen = [], {"pull": 0, "save": 0, "load": 0}
        for n in LENGTHS:
            for rep in range(REPS + 1):  # rep 0 warms up
                prompt = torch.randint(8, 512, (n,), generator=g).tolist()
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
                colocated = stream_ttft(url["REF"], body)  # first: no prefix hit
                ref_tokens = tokens(complete(url["REF"], prompt, 8))
                kvflow = stream_ttft(url["X"], body)
                # kvflow driven as the baseline is (client -> P, then client -> D), no proxy
                prompt2 = prompt[::-1]
                body2 = dict(body, prompt=prompt2)
                t0 = time.perf_counter()
                params = httpx.post(f"{url['KP']}/v1/completions", timeout=120, json=dict(
                    body2, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
                    ).json()["kv_transfer_params"]
                kvflow_direct = stream_ttft(url["KD"], dict(body2, kv_transfer_params=params), t0)
                t0 = time.perf_counter()
                complete(url["EP"], prompt, 1)
                example_ttft = stream_ttft(url["ED"], body, t0)
                ex_tokens = tokens(complete(url["ED"], prompt, 8))
                time.sleep(0.3)  # let the log lines land
                pull, seen["pull"] = new_ms(procs.log("KD"), r"pulled \d+ blocks \(\d+ bytes\) "
                                            r"of \S+ in ([\d.]+) ms", seen["pull"])
                save, seen["save"] = new_ms(procs.log("EP"), r"timed-example: save ([\d.]+) ms",
                                            seen["save"])
                load, seen["load"] = new_ms(procs.log("ED"), r"timed-example: load ([\d.]+) ms",
                                            seen["load"])
                if rep:
                    rows.append({"tokens": n, "rep": rep, "colocated_ttft_ms": colocated,
                                 "kvflow_ttft_ms": kvflow, "kvflow_direct_ttft_ms": kvflow_direct,
                                 "kvflow_transfer_ms": sum(pull) / max(len(pull), 1),
                                 "example_ttft_ms": example_ttft,
                                 "example_save_ms": sum(save), "example_load_ms": sum(load),
                                 "example_tokens_match_colocated": ex_tokens == ref_tokens})
                print(rows[-1] if rep else f"warm-up {n}", flush=True)
    finally:
        procs.close()
    summary = []
    for n in LENGTHS:
        r = [x for x in rows if x["tokens"] == n]
        med = {k: statistics.median(x[k] for x in r) for k in r[0]
               if k.endswith("_ms")}
        summary.append({"tokens": n, **med,
                        "example_tokens_match": all(x["example_tokens_match_colocated"]
                                                    for x in r)})
    import vllm
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    out = {"bench": "vllm-pd", "device": f"cpu ({cpu}, {torch.get_num_threads()} threads)",
           "vllm": vllm.__version__, "torch": torch.__version__, "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": "random 2-layer Llama (hidden 128, 2 KV heads, head_dim 32), float32, "
                    "block_size 32", "max_tokens": 8, "reps": REPS,
           "baseline": "vllm ExampleConnector (safetensors files in a shared folder)",
           "summary_median": summary, "rows": rows}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path("bench/results/raw") / f"vllm-pd-cpu-{stamp}.json"  # not report schema
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    print(path)


if __name__ == "__main__":
    main()
