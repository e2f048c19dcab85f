"""The address a process tells its peers to dial (``--advertise-host``): never a wildcard such
as ``0.0.0.0``."""

from __future__ import annotations

import contextlib
import socket

WILDCARDS = ("0.0.0.0", "")  # bind addresses that mean "every interface"


def default_route_address() -> str:
    """This host's IPv4 address on its default route (no packet sent), else its hostname's, else
    127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        with contextlib.suppress(OSError):
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any remote address
            addr = s.getsockname()[0]
            if addr not in WILDCARDS:
                return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_host(host: str, advertise_host: str | None = None) -> str:
    """The host peers dial for sockets bound to ``host``: ``advertise_host`` when given, else
    ``host`` unless it is a wildcard, else :func:`default_route_address`."""
    if advertise_host:
        return advertise_host
    return default_route_address() if host in WILDCARDS else host
