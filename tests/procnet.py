"""A process's CPU time, read from /proc (Linux; no psutil). Its listening sockets:
:func:`kvflow.bench.ports.listening`."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (``/proc/<pid>/stat``), all its
    threads."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
