"""Is an instance's process still running? A router on the same host (and pid namespace) as
an instance it did not start can see the answer at once, instead of waiting for heartbeats to
stop: a killed decode instance is then noticed within one monitor tick (0.1 s), not after
``--dead-after-s``.

:func:`host_id` names this host and pid namespace (Linux: the kernel's boot id and the pid
namespace's inode); every instance sends it in :class:`~kvflow.protocol.Register`. Only when
the router's and the instance's ids are equal (and not empty) are pids comparable.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """``"<boot id>/<pid namespace inode>"``, or ``""`` where /proc does not tell (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_exited(pid: int) -> bool:
    """True when ``pid`` (on this host) has exited: no such process, or a zombie nobody has
    reaped yet (its sockets are already closed). False while it runs, or when unsure."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's running process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
