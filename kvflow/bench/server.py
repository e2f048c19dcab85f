"""The one server launcher of the studies: ``python -m kvflow.serve`` on a free loopback port
(:mod:`kvflow.bench.ports`: no port race), healthy before use, stopped afterwards by
:meth:`Server.stop` (SIGINT; SIGKILL to every process of its tree still running after 15 s; then
the ``kvflow-*`` segments those left are unlinked).

While it runs, the server is registered with :func:`kvflow.bench.record.on_exit`, so a study
that the watchdog or a second signal ends at once (``os._exit``) stops it too: no orphan process,
no segment left in /dev/shm. Server flags are the serve CLI's own (``--mode``,
``--kv-connector``, ``--kv-connector-config``, ``--layerwise-min-tokens``, ...;
``python -m kvflow.serve --help``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from typing import Iterator

from kvflow.segments import process_tree

from .ports import Launch, serve_cmd, wait_healthy

#: Seconds a server has to stop after SIGINT in a normal stop (it takes ~0.5 s at load 10).
STOP_GRACE_S = 15.0
#: The same after a second signal or the watchdog (the study is ending at once).
HURRY_GRACE_S = 3.0


def _signal(pids: set[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _running(tree: dict[int, int | None]) -> set[int]:
    """The pids of ``tree`` (pid -> start time) still running as the same process (a pid that
    was reused by another process is not one of them: it is never signalled)."""
    from kvflow.segments import process_exited, process_start_time
    return {p for p, start in tree.items()
            if not process_exited(p) and process_start_time(p) == start}


def unlink_segments_of(pids: set[int]) -> list[str]:
    """Unlink the ``kvflow-*`` segments whose owner is one of ``pids`` and has exited (what a
    SIGKILLed instance leaves); returns their names."""
    from kvflow.segments import DEAD, SHM_DIR, owner_state, parse_name, unlink
    removed = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(SHM_DIR)):
            parsed = parse_name(entry)
            if (parsed is not None and parsed.owner.pid in pids
                    and owner_state(parsed.owner) == DEAD and unlink(entry)):
                removed.append(entry)
    return removed


class Server:
    """A started ``python -m kvflow.serve`` (``proc``, ``url``) and its stop, which two threads
    may call at once (the study's ``finally`` and the watchdog), and more than once."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        self.tree: dict[int, int | None] = {}  # pid -> start time, filled at the stop

    def stop(self, grace_s: float = STOP_GRACE_S) -> set[int]:
        """SIGINT to the server (a second call sends it again: the server hurries); SIGKILL to
        every process of its tree still running after ``grace_s`` s; then unlink the segments
        of its processes. Returns the pids that needed SIGKILL (empty after a clean stop)."""
        proc = self.proc
        if proc.poll() is None:
            from kvflow.segments import process_start_time
            for pid in process_tree(proc.pid):  # before the signal: its children re-parent
                self.tree.setdefault(pid, process_start_time(pid))
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s  # no lock: a hurried call must not wait on this one
        while _running(self.tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = _running(self.tree)
        _signal(killed, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        deadline = time.monotonic() + 10
        while _running(self.tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        removed = unlink_segments_of(set(self.tree))
        if killed or removed:
            from .record import say
            say(f"kvflow.bench: the server (pid {proc.pid}) did not stop within {grace_s:g} s: "
                f"killed pids {sorted(killed)}, unlinked segments {removed}")
        return killed


@contextlib.contextmanager
def started_server(mode: str = "disagg", extra_args: str | list[str] = "", timeout: float = 120.0,
                   log_path: str | None = None) -> Iterator[str]:
    """Start ``python -m kvflow.serve --mode mode [extra_args]`` on a free port
    (:class:`~kvflow.bench.ports.Launch`: again on another when the port was taken); yield its
    URL once healthy; stop it on the way out (:meth:`Server.stop`), also when the study is
    interrupted.

    ``log_path`` takes the server's stdout and stderr (default: inherited)."""
    from .record import on_exit
    extra = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
    launch = Launch(serve_cmd("--mode", mode, *extra), log_path=log_path, start_new_session=True)
    server = Server(launch.proc, launch.url)

    def stop(grace_s: float = STOP_GRACE_S) -> None:
        server.proc, server.url = launch.proc, launch.url  # the attempt that is running
        server.stop(grace_s)

    with on_exit(lambda: stop(HURRY_GRACE_S)):
        try:
            wait_healthy(launch, timeout)
            yield launch.url
        finally:
            stop()
