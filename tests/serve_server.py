"""A `python -m kvflow.serve` process for tests: start on a free port, wait for /health 200,
query it, stop it with a signal and check that nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from kvflow.segments import process_exited

SMALL = ["--max-model-len", "512", "--memory-budget-mb", "32", "--max-num-batched-tokens", "256"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across exec, as SIG_IGN is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """The process runs (a zombie counts as gone)."""
    return not process_exited(pid)


def heartbeats_after(health: dict, since: float, t_ask: float) -> bool:
    """Every instance's counts in ``health`` (asked for at ``t_ask``) come from a heartbeat sent
    after ``since`` (this process's monotonic clock): the router keeps each instance's last
    one, which may predate the work a test just did."""
    return all(t_ask - i["heartbeat_age_s"] > since for i in health["instances"])


class Server:
    def __init__(self, *args: str, env: dict | None = None, sigint_ignored: bool = False) -> None:
        """Start ``python -m kvflow.serve`` with ``args``; ``sigint_ignored``: with SIGINT
        ignored on entry, as a non-interactive shell starts a background job (``cmd &``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-serve-", suffix=".log", delete=False)
        small = SMALL if "--num-blocks" not in args else SMALL[:2] + SMALL[4:]  # no budget then
        cmd = [sys.executable, "-m", "kvflow.serve", "--port", str(self.port), *small, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(env or {})),
                                     preexec_fn=_ignore_sigint if sigint_ignored else None)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.t_start = time.monotonic()
        self.seen_pids: set[int] = set()
        self.seen_shm: set[str] = set()

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait_healthy(self, timeout: float = 150.0) -> float:
        deadline = self.t_start + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = self.client.get("/health", timeout=2)
                if r.status_code == 200:
                    self.remember(r.json())
                    return time.monotonic() - self.t_start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no /health 200 within {timeout} s:\n{self.output()}")

    def remember(self, health: dict) -> None:
        for inst in health["instances"]:
            self.seen_pids.add(inst["pid"])
            if inst["shm_name"]:
                self.seen_shm.add(inst["shm_name"])

    def health(self) -> dict:
        h = self.client.get("/health").json()
        self.remember(h)
        return h

    def instance(self, role: str) -> dict:
        return next(i for i in self.health()["instances"] if i["role"] == role)

    def free_blocks(self) -> dict[str, int]:
        return {i["role"]: i["free_blocks"] for i in self.health()["instances"]}

    def total_blocks(self) -> dict[str, int]:
        return {i["role"]: i["num_blocks"] for i in self.health()["instances"]}

    def fresh_health(self, since: float) -> dict | None:
        """/health if every instance's counts come from a heartbeat sent after ``since``
        (:func:`heartbeats_after`), else None."""
        t_ask = time.monotonic()
        h = self.health()
        return h if heartbeats_after(h, since, t_ask) else None

    def wait_settled(self, want: dict[str, int], timeout: float = 5.0,
                     idle: bool = False) -> dict[str, tuple[int, int]]:
        """Wait until one fresh /health shows ``want`` free blocks per role (and, with
        ``idle``, nothing running); return the last {role: (free_blocks, num_running)} seen."""
        since = time.monotonic()
        deadline = since + timeout
        got: dict[str, tuple[int, int]] = {}
        while True:
            h = self.fresh_health(since)
            if h is not None:
                got = {i["role"]: (i["free_blocks"], i["num_running"]) for i in h["instances"]}
                if all(got.get(r, (None, 0))[0] == n for r, n in want.items()) and \
                        (not idle or all(run == 0 for _, run in got.values())):
                    return got
            if time.monotonic() >= deadline:
                return got
            time.sleep(0.05)

    def wait_free_blocks(self, want: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
        return {r: free for r, (free, _) in self.wait_settled(want, timeout).items()}

    def requests_total(self, outcome: str) -> float:
        """``kvflow_requests_total{outcome=...}`` from /metrics (0 before the first)."""
        for ln in self.client.get("/metrics").text.splitlines():
            if ln.startswith(f'kvflow_requests_total{{outcome="{outcome}"}}'):
                return float(ln.split()[-1])
        return 0.0

    def complete(self, **body):
        return self.client.post("/v1/completions", json=body)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.client.close()


@contextlib.contextmanager
def healthy(servers: dict[str, "Server"]):
    """Wait until every server of ``servers`` is healthy, yield them, and stop them all after
    (also when a start fails)."""
    try:
        for srv in servers.values():
            srv.wait_healthy()
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()
