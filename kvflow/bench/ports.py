"""Server processes on a loopback port without a port race: the one launcher of the studies
(:func:`kvflow.bench.server.started_server`) and the tests.

A port handed to a process started later can be taken meanwhile (``bind(0)``, close, pass the
number on: any ``connect()`` or ``bind(0)`` on the host may get it next; under load that cost a
test module 44 errors). Two rules close that race:

- :func:`free_port` picks outside the kernel's ephemeral range (``ip_local_port_range``), where
  no outgoing connection and no ``bind(0)`` of any process lands, and never twice in a process;
- :class:`Launch` starts the command on such a port and, when the process exits because its port
  was taken after all (the port cannot be bound now, or the output says "is in use"), starts it
  again on another, at most ``attempts`` times; it counts the server healthy only when the
  process it started is the one listening on the port (:func:`listening`, from ``/proc``).

:func:`serve_cmd` is the ``make_cmd`` of ``python -m kvflow.serve``; its flags are the serve
CLI's own (``python -m kvflow.serve --help``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

_handed: set[int] = set()  # ports free_port gave out in this process


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """``host:port`` can be bound by a listening TCP socket now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range (the larger side
    of it; so no ``connect()`` or ``bind(0)`` of another process takes it meanwhile) and not
    handed out before by this process. Another process may still bind it: start servers with
    :class:`Launch`.

    Raises
    ------
    RuntimeError
        No free port found after 200 tries.
    """
    lo, hi = _ephemeral_range()
    below, above = (max(1024, lo - 12768), lo), (hi + 1, 65536)
    span = max(below, above, key=lambda r: r[1] - r[0])
    for _ in range(200):
        if span[1] - span[0] >= 1000:
            port = random.randrange(*span)
        else:  # the ephemeral range covers (nearly) every port: take one the kernel picks
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        if port not in _handed and port_free(port, host):
            _handed.add(port)
            return port
    raise RuntimeError(f"no free TCP port on {host} in {span[0]}..{span[1] - 1} after 200 tries")


def _addr(hexaddr: str) -> str:
    """``/proc/net/tcp{,6}``'s address column (host-order 32-bit words) as text."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    return str(ipaddress.ip_address(words)) if len(raw) == 16 else socket.inet_ntoa(words)


def listening(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` holds in state LISTEN (its fds'
    ``socket:[inode]`` links matched against ``/proc/net/tcp`` and ``tcp6``); [] once it is
    gone."""
    proc = Path("/proc", str(pid))  # its sockets; whether it lives is kvflow.segments' to say
    inodes = set()
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:  # exited
        return []
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                host, port = f[1].split(":")
                out.append((_addr(host), int(port, 16)))
    return sorted(out)


class Launch:
    """``make_cmd(port)`` started on :func:`free_port`'s port, again on another port when the
    first was taken (bounded by ``attempts``); ``popen`` gets the rest of Popen's arguments.
    ``log_path``: each attempt's stdout and stderr go there (truncated at each attempt); None:
    inherited, and a taken port is known by the bind test alone."""

    def __init__(self, make_cmd: Callable[[int], list[str]], *, host: str = "127.0.0.1",
                 attempts: int = 5, log_path: str | None = None,
                 pick: Callable[[], int] = free_port, **popen) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.make_cmd, self.host, self.attempts, self.pick = make_cmd, host, attempts, pick
        self.log_path, self.popen = log_path, popen
        self.taken: list[int] = []  # ports found taken, in order
        self._start()

    def _start(self) -> None:
        self.port = self.pick()
        self.url = f"http://{self.host}:{self.port}"
        out = open(self.log_path, "w") if self.log_path else None
        try:
            to_log = {"stdout": out, "stderr": subprocess.STDOUT} if out else {}
            self.proc = subprocess.Popen(self.make_cmd(self.port), **{**self.popen, **to_log})
        finally:
            if out is not None:
                out.close()

    def output(self) -> str:
        """This attempt's output ('' when inherited)."""
        return Path(self.log_path).read_text() if self.log_path else ""

    def _taken(self) -> bool:
        return f" {self.port} is in use" in self.output() or not port_free(self.port, self.host)

    def poll(self, ok: Callable[[], bool]) -> bool:
        """One look: True when the process listens on its port and ``ok()`` (say, /health is
        200); restarts it on a new port when it exited because its port was taken.

        Raises
        ------
        RuntimeError
            The process exited for another reason, or its port was taken ``attempts`` times
            (naming the ports).
        """
        if self.proc.poll() is not None:
            if self.proc.returncode != 0 and self._taken():
                self.taken.append(self.port)
                if len(self.taken) < self.attempts:
                    self._start()
                    return False
                raise RuntimeError(f"ports {self.taken} were each taken by another process "
                                   f"before the server bound them ({self.attempts} attempts)")
            raise RuntimeError(f"the server exited with code {self.proc.returncode} before "
                               f"{self.url} was ready:\n{self.output()[-3000:]}")
        # a server of another process on this port would answer too: ours must hold it
        return any(p == self.port for _, p in listening(self.proc.pid)) and ok()


def http_ok(url: str, path: str = "/health") -> bool:
    """GET ``url + path`` answers 200 (False on any connection error)."""
    import httpx
    try:
        return httpx.get(url + path, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(launch: Launch, timeout: float, path: str = "/health") -> None:
    """Poll ``launch`` (:meth:`Launch.poll`) until its ``path`` is 200.

    Raises
    ------
    RuntimeError
        As :meth:`Launch.poll`, or after ``timeout`` seconds (naming the url).
    """
    deadline = time.monotonic() + timeout
    while not launch.poll(lambda: http_ok(launch.url, path)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{launch.url}{path} was not 200 within {timeout} s")
        time.sleep(0.1)


def serve_cmd(*args: str, host: str = "127.0.0.1") -> Callable[[int], list[str]]:
    """``make_cmd`` for :class:`Launch`: ``python -m kvflow.serve --host host --port P *args``."""
    return lambda port: [sys.executable, "-m", "kvflow.serve", "--host", host, "--port",
                         str(port), *args]
