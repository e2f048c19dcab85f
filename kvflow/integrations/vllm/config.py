"""``kv_connector_extra_config`` of ``KvflowConnector``: keys, defaults and start-up checks
(docs/tutorials/vllm.md, "Settings"). Imports nothing from vLLM."""

from __future__ import annotations

from typing import Any

DEFAULTS = {"kvflow_host": "127.0.0.1", "kvflow_port": 5601, "transport": "tcp",
            "lease_s": 60.0, "timeout_s": 30.0, "backend": "auto", "test_serve_delay_s": 0.0,
            "test_corrupt_kv": False, "staging_mb": 256}
#: The serving kinds' names (``kvflow.connector.KINDS``) of what each transport does.
TRANSPORTS = ("tcp", "nixl", "ipc-push")
#: Names of earlier releases: refused with the new name.
RENAMED = {"ipc": "ipc-push"}


def check_transport(transport: Any) -> str:
    """``transport`` if one of :data:`TRANSPORTS`, else ValueError (naming a renamed one's new
    name)."""
    if transport in RENAMED:
        raise ValueError(f"kv_connector_extra_config transport {transport!r} is now called "
                         f"{RENAMED[transport]!r} (P writes into D's staging cache, as serving's "
                         f"{RENAMED[transport]} kind); set transport {RENAMED[transport]!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"kv_connector_extra_config transport must be one of {TRANSPORTS}, "
                         f"got {transport!r}")
    return transport


def check_config(extra: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` with the defaults filled in; ValueError names the key and value
    of an unknown key or a bad value (``lease_s`` must exceed ``timeout_s``)."""
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; "
                         f"kvflow knows {sorted(DEFAULTS)}")
    conf = {**DEFAULTS, **extra}
    check_transport(conf["transport"])
    for key in ("timeout_s", "lease_s", "staging_mb"):
        try:
            conf[key] = float(conf[key])
        except (TypeError, ValueError):
            raise ValueError(f"kv_connector_extra_config {key} must be a number, got "
                             f"{conf[key]!r}") from None
    for key, unit in (("timeout_s", "seconds"), ("staging_mb", "MiB")):
        if not conf[key] > 0:
            raise ValueError(f"kv_connector_extra_config {key} must be > 0 {unit}, got "
                             f"{extra.get(key)!r}")
    if not conf["lease_s"] > conf["timeout_s"]:
        raise ValueError(f"kv_connector_extra_config lease_s ({conf['lease_s']:g} s) must be "
                         f"larger than timeout_s ({conf['timeout_s']:g} s)")
    from kvflow.kernels.registry import backend_names
    if conf["backend"] != "auto" and conf["backend"] not in backend_names():
        raise ValueError(f"kv_connector_extra_config backend must be 'auto' or one of "
                         f"{backend_names()}, got {conf['backend']!r}")
    return conf
