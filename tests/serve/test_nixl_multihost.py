"""docs/tutorials/multihost.md, run: its router, decode and prefill commands on three loopback
addresses standing in for three hosts (127.0.0.2-4), then its curl checks through httpx.
Skipped where NIXL is not installed or the OS has no 127.0.0.2."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvflow.bench.ports import free_port
from kvflow.connector.transport.nixl_agent import nixl_available

DOC = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "multihost.md"
HOSTS = {"ROUTER": "127.0.0.2", "PREFILL": "127.0.0.3", "DECODE": "127.0.0.4"}


def _loopback_aliases() -> bool:
    try:
        with socket.socket() as s:
            s.bind((HOSTS["DECODE"], 0))
        return True
    except OSError:
        return False


pytestmark = [pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
              pytest.mark.skipif(not _loopback_aliases(), reason="no 127.0.0.2-4 here")]


def doc_commands() -> list[str]:
    """The page's ``python -m kvflow.serve`` lines, in order (router, decode, prefill)."""
    return re.findall(r"^((?:\w+=\S+ )*python -m kvflow\.serve .*)$", DOC.read_text(), re.M)


def test_the_tutorials_three_commands_serve_across_three_addresses():
    cmds = doc_commands()
    assert [c.split("--role ")[1].split()[0] for c in cmds] == ["router", "decode", "prefill"]
    port, cport = free_port(), free_port()
    procs = []
    try:
        for cmd in cmds:
            cmd = cmd.replace("8000", str(port)).replace("5555", str(cport))
            for name, addr in HOSTS.items():
                cmd = cmd.replace(f"${name}", addr)
            words = shlex.split(cmd)
            env = dict(os.environ)
            while "=" in words[0]:  # leading VAR=value
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            extra = [] if "router" in words else ["--num-blocks", "64", "--max-model-len", "256"]
            procs.append(subprocess.Popen([sys.executable, *words[1:], *extra], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        client = httpx.Client(base_url=f"http://{HOSTS['ROUTER']}:{port}", timeout=30)
        deadline = time.monotonic() + 120
        h: dict = {}
        while time.monotonic() < deadline:
            try:
                h = client.get("/health").json()
                if h["status"] == "ok":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert h.get("status") == "ok", h
        assert h["control_addr"] == f"tcp://{HOSTS['ROUTER']}:{cport}"
        d = next(i for i in h["instances"] if i["role"] == "decode")
        p = next(i for i in h["instances"] if i["role"] == "prefill")
        assert d["data_addr"].startswith(f"tcp://{HOSTS['DECODE']}:")
        assert d["kv_connector"] == p["kv_connector"] == "nixl"
        assert d["paired_with"] == [p["id"]] and p["paired_with"] == [d["id"]]
        r = client.post("/v1/completions", json={"prompt": "Hello from three hosts",
                                                 "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["kvflow"]["kv_connector"] == "nixl"
        assert len(r.json()["choices"][0]["token_ids"]) >= 1
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
