"""The child instances of ``--role all`` (``--config-json``): spawning, watching, stopping them
(docs/reliability.md, "Stop"); a child's one-line start-up error is printed once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

from .config import ServeConfig
from .output import say
from .startup import PREFIX, bind_error

log = logging.getLogger("kvflow.serve.procs")

STOP_TIMEOUT_S = 30.0  # seconds stop_all waits after SIGTERM before SIGKILL


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for the HTTP server, bound before anything is spawned. Raises
    :class:`StartupError` naming ``--port`` or ``--host`` when ``host:port`` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        code = None if isinstance(exc, socket.gaierror) else exc.errno
        raise bind_error("--port", port, host, port, code, exc.strerror) from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


class Children:
    """The instance processes this server started."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.roles: dict[int, str] = {}
        self.stderr_tail: dict[int, deque[str]] = {}
        self.fatal: dict[int, str] = {}  # a child's one-line start-up error, held back
        self._readers: list[threading.Thread] = []
        self.hurry = False  # a second interrupt: stop_all kills at once instead of waiting

    def spawn(self, role: str, cfg: ServeConfig, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start instance ``role`` with config ``cfg`` (its ``role`` field); ``env`` (default
        ``os.environ``) is the child's environment."""
        cmd = [sys.executable, "-m", "kvflow.serve", "--config-json", cfg.to_json()]
        # its own session: a terminal's Ctrl-C reaches only this server, which stops it
        proc = subprocess.Popen(cmd, env=os.environ if env is None else env,
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        self.procs[proc.pid] = proc
        self.roles[proc.pid] = role
        tail = self.stderr_tail[proc.pid] = deque(maxlen=20)
        reader = threading.Thread(target=_tee, args=(proc.stderr, tail, self.fatal, proc.pid),
                                  daemon=True, name=f"stderr-{role}-{proc.pid}")
        reader.start()
        self._readers.append(reader)
        log.info("started %s instance, pid %d", role, proc.pid)
        return proc

    def alive(self, pid: int) -> bool | None:
        """True/False for a child of ours, None for a process we did not start."""
        proc = self.procs.get(pid)
        return None if proc is None else proc.poll() is None

    def exited(self) -> list[tuple[int, str, int]]:
        """``(pid, role, exit code)`` of every child that has exited."""
        return [(pid, self.roles[pid], proc.returncode) for pid, proc in self.procs.items()
                if proc.poll() is not None]

    def last_stderr(self, pid: int, wait_s: float = 2.0) -> list[str]:
        """The last (up to 20) lines a child wrote to stderr (waits for its pipe to close)."""
        for t in self._readers:
            if t.name.endswith(f"-{pid}"):
                t.join(wait_s)
        return list(self.stderr_tail.get(pid, ()))

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S, note_every_s: float = 5.0) -> None:
        """SIGTERM every child, wait up to ``timeout_s`` for all to exit (naming those still
        running every ``note_every_s``), SIGKILL the rest, reap all."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        deadline, next_note = t0 + timeout_s, t0 + note_every_s
        while True:
            running = [p for p in self.procs.values() if p.poll() is None]
            now = time.monotonic()
            if not running or now >= deadline or self.hurry:
                break
            if now >= next_note:
                log.warning("stopping: waiting for %s to exit (%.0f s; killed after %g s)",
                            ", ".join(f"the {self.roles[p.pid]} instance (pid {p.pid})"
                                      for p in running), now - t0, timeout_s)
                next_note += note_every_s
            with contextlib.suppress(subprocess.TimeoutExpired):
                running[0].wait(min(0.05, max(0.0, deadline - now)))
        for proc in running:
            if self.hurry:
                log.warning("instance pid %d: a second interrupt; killing it", proc.pid)
            else:
                log.warning("instance pid %d ignored SIGTERM for %g s; killing it", proc.pid,
                            timeout_s)
            proc.kill()
            proc.wait()
        for t in self._readers:
            t.join(1.0)


def _tee(pipe, tail: deque, fatal: dict[int, str], pid: int) -> None:
    """Copy a child's stderr to ours, keeping the last lines in ``tail``; its one-line error goes
    to ``fatal[pid]`` instead."""
    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            tail.append(line.rstrip("\n"))
            if line.startswith(PREFIX):
                fatal[pid] = line[len(PREFIX):].strip()
                continue
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()
    finally:
        pipe.close()


def instance_env(role: str, device: str, prefill_device: int, decode_device: int) -> dict[str, str] | None:
    """Environment of one instance child: on CUDA ``CUDA_VISIBLE_DEVICES`` makes ``cuda:0`` its GPU,
    P and D seeing each other's too (ValueError for an ordinal not visible here); on CPU the
    inherited one with :data:`CPU_ENV` unless one of :data:`OPENMP_WAIT_VARS` is set."""
    if not str(device).startswith("cuda"):
        mine = any(name in os.environ for name in OPENMP_WAIT_VARS)  # the user chose a wait
        return dict(os.environ) if mine else {**CPU_ENV, **os.environ}
    from kvflow.devices import parent_cards, worker_env_for_cards
    p, d = parent_cards("cuda", [prefill_device]) + parent_cards("cuda", [decode_device])
    cards = {"decode": [d, p], "prefill": [p, d]}.get(role, [p])
    return worker_env_for_cards("cuda", cards)


#: Environment defaults of CPU instances: OpenMP workers sleep, not spin, when idle (spinning
#: ones held the cores the router and D needed). Any of :data:`OPENMP_WAIT_VARS` replaces it.
CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
#: OpenMP variables that choose how idle workers wait (libgomp's, Intel OpenMP's)
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


async def watch_children(children, ctl, server, failed: list[str]) -> None:
    """A child that exits before it registered can never serve: print one line (its error,
    else its last stderr line) and stop the server."""
    seen: set[int] = set()
    while True:
        await asyncio.sleep(0.2)
        if failed:
            server.should_exit = True
            continue
        for pid, role, code in children.exited():
            if pid in seen:
                continue
            seen.add(pid)
            if pid in ctl.registered_pids or ctl.ready():
                if pid in children.fatal:  # later deaths are the control plane's: say it once
                    say(f"{PREFIX}the {role} instance (pid {pid}) stopped: {children.fatal[pid]}",
                        sys.stderr)
                continue
            tail = await asyncio.get_running_loop().run_in_executor(None, children.last_stderr, pid)
            why = children.fatal.get(pid) or next((ln.strip() for ln in reversed(tail) if ln.strip()),
                                                  "nothing on stderr")
            failed.append(f"the {role} instance (pid {pid}) {_exit_text(code)} before "
                          f"registering: {why}")
            ctl.errors.append(failed[-1])
            say(PREFIX + failed[-1], sys.stderr)
            server.should_exit = True
            break
