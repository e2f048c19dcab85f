"""kvflow.connector.transport.nixl_net: ``--host`` to the interface UCX may listen on
(UCX_NET_DEVICES), read from this host's interfaces with the standard library (no NIXL needed)."""

from __future__ import annotations

import ipaddress

import pytest

from kvflow.connector.transport import nixl_net
from kvflow.connector.transport.nixl_net import bind_ucx_to_host, interface_addresses, interface_of

#: TEST-NET-2 (RFC 5737): no interface of a test host has it.
NOWHERE = "198.51.100.77"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.3", "localhost"])
def test_a_loopback_host_is_lo(host):
    assert interface_of(host) == "lo"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*", ""])
def test_a_wildcard_host_has_no_interface(host):
    assert interface_of(host) is None
    env = {}
    assert bind_ucx_to_host(host, env) is None and env == {}


def test_an_address_of_no_interface_is_refused_naming_host_and_value():
    with pytest.raises(ValueError) as exc:
        interface_of(NOWHERE)
    msg = str(exc.value)
    assert msg.startswith(f"--host '{NOWHERE}': no network interface of this host has address "
                          f"{NOWHERE} (interfaces: lo 127.0.0.1")
    assert msg.endswith("); NIXL's UCX listeners cannot be bound to it")


def test_a_name_that_does_not_resolve_is_refused():
    with pytest.raises(ValueError, match=r"^--host 'no-such-host\.invalid' does not resolve to "
                                         r"an address \(.*\); NIXL's UCX listeners cannot be "
                                         r"bound to it$"):
        interface_of("no-such-host.invalid")


def test_loopback_binds_lo_and_a_user_setting_wins():
    env = {}
    assert bind_ucx_to_host("127.0.0.1", env) == "lo"
    assert env == {"UCX_NET_DEVICES": "lo"}
    env = {"UCX_NET_DEVICES": "eth7"}
    assert bind_ucx_to_host("127.0.0.1", env) is None and env == {"UCX_NET_DEVICES": "eth7"}


def test_a_network_address_keeps_the_rdma_ports(tmp_path, monkeypatch):
    for dev, ports in (("mlx5_0", [1]), ("mlx5_1", [1, 2])):
        for p in ports:
            (tmp_path / dev / "ports" / str(p)).mkdir(parents=True)
    assert nixl_net.rdma_ports(str(tmp_path)) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    own = [(name, a) for name, addrs in interface_addresses().items() for a in addrs
           if ipaddress.ip_address(a).version == 4 and not ipaddress.ip_address(a).is_loopback]
    if not own:
        pytest.skip("this host has no IPv4 address besides loopback")
    name, addr = own[0]
    monkeypatch.setattr(nixl_net, "rdma_ports", lambda: ["mlx5_0:1"])
    env = {}
    assert bind_ucx_to_host(addr, env) == f"{name},mlx5_0:1" == env["UCX_NET_DEVICES"]
