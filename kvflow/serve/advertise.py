"""The address a process tells its peers to dial (``--advertise-host``).

A socket bound to ``--host 0.0.0.0`` listens on every interface, but ``0.0.0.0`` is no address
another host can connect to: every message that tells a peer where to connect (the router's
control address handed to its children and printed for ``--router-url``, D's data address in
``Register``, ``/health``) carries the advertised host instead: ``--advertise-host`` if given,
else ``--host`` unless that is a wildcard, else this host's address on its default route.
"""

from __future__ import annotations

import socket

#: Bind addresses that mean "every interface".
WILDCARDS = ("0.0.0.0", "")


def default_route_address() -> str:
    """This host's IPv4 address on its default route (no packet is sent: a UDP socket is only
    connected), or the address its hostname resolves to, or 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any remote address
            addr = s.getsockname()[0]
            if addr not in WILDCARDS:
                return addr
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_host(host: str, advertise_host: str | None = None) -> str:
    """The host peers dial for sockets bound to ``host``.

    Parameters
    ----------
    host : str
        What the sockets bind to (``--host``).
    advertise_host : str or None
        ``--advertise-host``: used as given when set.

    Examples
    --------
    >>> advertised_host("10.0.0.5"), advertised_host("0.0.0.0", "10.0.0.5")
    ('10.0.0.5', '10.0.0.5')
    """
    if advertise_host:
        return advertise_host
    return default_route_address() if host in WILDCARDS else host
