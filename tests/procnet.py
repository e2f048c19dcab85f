"""A process's listening TCP sockets and CPU time, read from /proc (Linux; no psutil)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path


def _addr(hexaddr: str) -> str:
    """``/proc/net/tcp{,6}``'s address column (host-order 32-bit words) as text."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    return str(ipaddress.ip_address(words)) if len(raw) == 16 else socket.inet_ntoa(words)


def listening(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` holds in state LISTEN (its
    fds' ``socket:[inode]`` links matched against ``/proc/net/tcp`` and ``tcp6``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                host, port = f[1].split(":")
                out.append((_addr(host), int(port, 16)))
    return sorted(out)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (``/proc/<pid>/stat``), all its
    threads."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
