"""The one server launcher of the studies: ``python -m kvflow.serve`` on a free loopback port,
healthy before use, stopped with SIGINT (SIGKILL after 15 s) afterwards.

Server flags are the serve CLI's own (``--mode``, ``--kv-connector``, ``--kv-connector-config``,
``--layerwise-min-tokens``, ...; ``python -m kvflow.serve --help``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url``/health until HTTP 200.

    Raises
    ------
    RuntimeError
        If the server process exits first, or after ``timeout`` seconds (naming the url).
    """
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before {url}/health was 200")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url}/health was not 200 within {timeout} s")


@contextlib.contextmanager
def started_server(mode: str = "disagg", extra_args: str | list[str] = "", timeout: float = 120.0,
                   log_path: str | None = None) -> Iterator[str]:
    """Start ``python -m kvflow.serve --mode mode [extra_args]`` on a free port; yield its URL.

    ``log_path`` takes the server's stdout and stderr (default: inherited)."""
    port = free_port()
    extra = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
    cmd = [sys.executable, "-m", "kvflow.serve", "--host", "127.0.0.1", "--port", str(port),
           "--mode", mode, *extra]
    log = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT if log else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout, proc)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log:
            log.close()
