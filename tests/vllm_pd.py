"""Start vLLM OpenAI servers (P, D, a plain reference engine) and kvflow's proxy as processes, for
tests/integrations/test_vllm_connector.py and bench/vllm_pd.py. CPU settings: float32, block_size 32 (vLLM's
CPU attention takes multiples of 32), eager mode, 1 GiB of KV cache per engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from kvflow.connector.transport.nixl_agent import tcp_tls

from tests.reap import reap, spawn

BLOCK_SIZE = 32


def engine_cmd(model: str, port: int, kv: dict | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
           "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024", "--enforce-eager",
           "--max-num-seqs", "8", "--served-model-name", "tiny"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def kvflow_config(role: str, **extra) -> dict:
    return {"kv_connector": "KvflowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": extra}


class Procs:
    """Processes started together, each the leader of its own process group
    (:func:`tests.reap.spawn`); :meth:`close` ends each group and every descendant (a vLLM
    server's engine core too, which ending the server's pid alone left running)."""

    def __init__(self, log_dir) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = log_dir

    def start(self, name: str, cmd: list[str], **env_extra: str) -> None:
        """Start ``cmd`` (with ``env_extra`` in its environment), its output into
        ``<log_dir>/<name>.log``. UCX_TLS=tcp: NIXL takes the network path (UCX's TCP), not
        shared memory, between the local engines. OMP_WAIT_POLICY=PASSIVE: engines that share
        the cores must not spin in libgomp's idle wait (one engine's spinning threads took the
        cores the other needed: 60-190 ms P/D TTFT at 128 tokens on 2 cores, against 26 ms).
        """
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   PYTHONWARNINGS="ignore", UCX_TLS=os.environ.get("UCX_TLS", tcp_tls()),
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **env_extra)
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs[name] = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def wait_healthy(self, urls: dict[str, str], timeout_s: float = 420.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(urls)
        while pending:
            for name, url in list(pending.items()):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited ({self.procs[name].returncode}):\n"
                                       f"{self.log(name)[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        pending.pop(name)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s} s: {sorted(pending)}")
            time.sleep(1)

    def close(self) -> None:
        """SIGTERM every group, then reap each (SIGKILL to what runs after 20 s)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            reap(p, grace_s=20.0)


def complete(url: str, prompt: list[int], max_tokens: int = 12, **kw) -> dict:
    """Greedy ``/v1/completions`` of a token-id prompt; returns the JSON answer."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def tokens(answer: dict) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def metric(url: str, name: str) -> float:
    """The value of the first sample ``name`` (a full sample name, e.g. a histogram's
    ``..._sum``) on ``url``'s ``/metrics``."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in {url}/metrics")


def kv_usage(url: str) -> float:
    """vLLM's ``kv_cache_usage_perc`` gauge (0.0: every block free)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("vllm:kv_cache_usage_perc not in /metrics")
