"""Start test processes so that every process they start is reaped (the vLLM tests' engines).

A vLLM OpenAI server starts its engine core (and its workers) as child processes; ending only the
server's pid left those re-parented to init and still running after the test session (issue 26).
:func:`spawn` starts each command as the leader of a new session (so of a new process group);
:func:`reap` ends the whole group, and every descendant seen before the group was signalled (one
that left the group with ``setsid`` is still found through its parent chain), SIGTERM first, then
SIGKILL after ``grace_s``. :data:`GROUPS` lists every group started, for the session check in
``tests/conftest.py`` (:func:`survivors`). Linux only: reads ``/proc``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

#: every :func:`spawn`ed leader of this test session, by its process-group id (= its pid)
GROUPS: dict[int, subprocess.Popen] = {}


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state letter) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in (...) may hold spaces
    return int(fields[1]), int(fields[2]), fields[0]


def _table() -> dict[int, tuple[int, int, str]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st
    return table


def live(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet waited for, counts as gone)."""
    st = _stat(pid)
    return st is not None and st[2] not in "ZX"


def descendants(pid: int) -> set[int]:
    """Pids of every live process below ``pid`` (children, their children, ...)."""
    table = _table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _, state) in table.items()
                    if ppid in frontier and state not in "ZX" and p not in found}
        found |= frontier
    return found


def survivors(groups: set[int] | None = None) -> set[int]:
    """Pids of live processes in any of ``groups`` (default :data:`GROUPS`)."""
    groups = set(GROUPS) if groups is None else groups
    return {p for p, (_, pgrp, state) in _table().items() if pgrp in groups and state not in "ZX"}


def spawn(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """``subprocess.Popen(cmd, start_new_session=True, **popen_kw)``, its group recorded."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kw)
    GROUPS[proc.pid] = proc  # a session leader's pid is its group id
    return proc


def reap_all(grace_s: float = 5.0) -> list[str]:
    """Reap every :data:`GROUPS` leader whose group (or the leader) still runs; returns one line
    per group that had to be reaped (its pid and command), empty when every test reaped its own."""
    left = []
    for pgid, proc in GROUPS.items():
        if proc.poll() is None or survivors({pgid}):
            left.append(f"group {pgid} ({' '.join(map(str, proc.args))[:120]}): "
                        f"{sorted(survivors({pgid}))} still running")
            reap(proc, grace_s)
    return left


def _signal_all(pgid: int, pids: set[int], sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def reap(proc: subprocess.Popen, grace_s: float = 20.0) -> set[int]:
    """End ``proc`` (a :func:`spawn`ed leader), its group and its descendants: SIGTERM, then
    SIGKILL to what still runs after ``grace_s`` seconds; waits for ``proc`` itself.

    Returns the pids that needed SIGKILL (empty after a clean stop).

    Raises
    ------
    RuntimeError
        A process still runs 10 s after SIGKILL (names the pids).
    """
    pgid = proc.pid
    tree = descendants(proc.pid)  # before any signal: once the leader dies they re-parent
    tree |= survivors({pgid})
    if proc.poll() is None or tree:
        _signal_all(pgid, tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        tree = {p for p in tree if live(p)}
        if proc.returncode is not None and not tree and not survivors({pgid}):
            return set()
        time.sleep(0.05)
    killed = {p for p in tree | survivors({pgid}) if live(p)}
    if proc.poll() is None:
        killed.add(proc.pid)
    _signal_all(pgid, killed, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := {p for p in killed | survivors({pgid}) if p != proc.pid and live(p)}):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(left)} still run 10 s after SIGKILL")
        time.sleep(0.05)
    return killed
