"""A `python -m kvflow.serve` process for tests: start on a free port (again on another when
the port was taken: :class:`kvflow.bench.ports.Launch`), wait for /health 200, query it, stop it
with a signal and check that nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time

import httpx

from kvflow.bench.ports import Launch, http_ok, serve_cmd
from kvflow.segments import process_exited

SMALL = ["--max-model-len", "512", "--memory-budget-mb", "32", "--max-num-batched-tokens", "256"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across exec, as SIG_IGN is


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
        log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-serve-", suffix=".log", delete=False)
        log.close()
        small = SMALL if "--num-blocks" not in args else SMALL[:2] + SMALL[4:]  # no budget then
        self.launch = Launch(serve_cmd(*small, *args), log_path=log.name,
                             env=dict(os.environ, **(env or {})),
                             preexec_fn=_ignore_sigint if sigint_ignored else None)
        self._client: httpx.Client | None = None
        self.t_start = time.monotonic()
        self.seen_pids: set[int] = set()
        self.seen_shm: set[str] = set()

    @property
    def proc(self) -> subprocess.Popen:
        return self.launch.proc

    @property
    def port(self) -> int:
        return self.launch.port

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def client(self) -> httpx.Client:
        """A client of :attr:`url` (a new one when a retry moved the server to another port)."""
        if self._client is None or str(self._client.base_url).rstrip("/") != self.url:
            if self._client is not None:
                self._client.close()
            self._client = httpx.Client(base_url=self.url, timeout=60)
        return self._client

    def output(self) -> str:
        return self.launch.output()

    def wait_healthy(self, timeout: float = 150.0) -> float:
        """Seconds from the start until /health was 200, from this server's own process.

        Raises
        ------
        RuntimeError
            The server exited (its output attached), or its port was taken at every attempt.
        TimeoutError
            No /health 200 within ``timeout`` seconds of the start.
        """
        deadline = self.t_start + timeout
        while time.monotonic() < deadline:
            if self.launch.poll(lambda: http_ok(self.url)):
                self.health()
                return time.monotonic() - self.t_start
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
            if self._client is not None:
                self._client.close()


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
