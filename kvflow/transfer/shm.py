"""Names and clean-up of kvflow's shared-memory segments (no torch import: the router uses it).

A segment is a file ``/dev/shm/kvflow-<role>-<pid>-<hex>``: the owner's pid lets anyone find
segments whose owner is dead (:func:`clean_stale_segments`); the random part keeps names unique
per instance even when a pid is reused.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("kvflow.transfer.shm")

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_NAME = re.compile(r"^kvflow-[a-z]+-(\d+)-[0-9a-f]{8,}$")


def shm_path(name: str) -> str:
    """Path of segment ``name``; rejects names that are not kvflow segment names."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"shm_name must look like 'kvflow-<role>-<pid>-<hex>', got {name!r}")
    return os.path.join(SHM_DIR, name)


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_segments() -> list[str]:
    """Unlink kvflow segments whose owner process is gone; returns the names removed."""
    removed = []
    for entry in os.listdir(SHM_DIR):
        m = _NAME.match(entry)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    if removed:
        log.info("removed stale shared-memory segments of dead owners: %s", removed)
    return removed


def unlink_segment(name: str) -> bool:
    """Remove segment ``name`` if it exists; True when something was removed."""
    try:
        os.unlink(shm_path(name))
        return True
    except FileNotFoundError:
        return False
