"""Keep NIXL's UCX listeners on ``--host``'s interface: :func:`bind_ucx_to_host` sets
``UCX_NET_DEVICES`` (unless the user did) to the interface owning ``--host``'s address, found
with the standard library. See docs/nixl.md, "Listeners on `--host` only".
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path
from typing import MutableMapping

SIOCGIFADDR = 0x8915
WILDCARD = ("", "*", "0.0.0.0", "::")


def interface_addresses() -> dict[str, list[str]]:
    """Each interface's primary IPv4 address and IPv6 addresses, by interface name."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = [socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])]
            except OSError:  # no IPv4 address
                out[name] = []
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hexaddr, *_, name = line.split()
        out.setdefault(name, []).append(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    return out


def address_of(host: str):
    """``host``'s IP address (a name is resolved), None for a wildcard. ValueError (naming
    ``--host`` and the value) when it resolves to no address."""
    if host in WILDCARD:
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
        except (socket.gaierror, IndexError, ValueError) as exc:
            raise ValueError(f"--host {host!r} does not resolve to an address ({exc}); NIXL's "
                             f"UCX listeners cannot be bound to it") from None
    return None if ip.is_unspecified else ip


def interface_of(host: str) -> str | None:
    """The interface owning ``host``'s address (any loopback address is ``lo``'s), None for a
    wildcard; ValueError (naming ``--host``) when no interface has it or it resolves to none."""
    ip = address_of(host)
    if ip is None:
        return None
    addrs = interface_addresses()
    for name, have in addrs.items():
        owned = [ipaddress.ip_address(a) for a in have]
        if ip in owned or (ip.is_loopback and any(a.is_loopback for a in owned)):
            return name
    known = ", ".join(f"{n} {' '.join(a) or '(no address)'}" for n, a in addrs.items())
    raise ValueError(f"--host {host!r}: no network interface of this host has address {ip} "
                     f"(interfaces: {known}); NIXL's UCX listeners cannot be bound to it")


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """UCX names (``mlx5_0:1``) of this host's RDMA ports."""
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in base.iterdir()
                  for port in (dev / "ports").glob("*"))


def bind_ucx_to_host(host: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``env["UCX_NET_DEVICES"]`` to ``host``'s interface (plus the RDMA ports unless it is
    loopback) before the NIXL agent is made; returns it, or None where ``env`` has one or ``host``
    is a wildcard. ValueError as :func:`interface_of`."""
    if env.get("UCX_NET_DEVICES"):
        return None
    name = interface_of(host)
    if name is None:
        return None
    value = ",".join([name] + ([] if address_of(host).is_loopback else rdma_ports()))
    env["UCX_NET_DEVICES"] = value
    return value
