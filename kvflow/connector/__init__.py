"""Connectors: how a request's KV moves from a prefill instance (P) to a decode instance (D).

The kinds (``ipc-pull``, ``ipc-push``, ``tcp``, ``nixl``: one module each) are the entries of
:data:`kvflow.connector.kinds.KINDS`, tabled in docs/design.md, "Connectors". :func:`make_sender`
builds P's half, :func:`make_receiver` D's half, both from the registry; the contract is
:mod:`.base`. Serving code imports this package only, never a kind's module.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import kinds as _kinds
from .kinds import KINDS, Kind, Option, check_options, register_kind

__all__ = ["Arrival", "CONNECTORS", "DATA_MESSAGES", "Freed", "KINDS", "KVReceiver", "KVSender",
           "KVVerifyError", "Kept", "Kind", "LeaseLinks", "LentBlocks", "Option", "Peer",
           "PrefillJob", "Renewals", "SlotsTaken", "TransferError", "TransferStats", "bind_to_host",
           "check_options", "is_data_message", "lease_socket", "make_receiver",
           "make_sender", "register_kind", "resolve_connector", "scales_refusal"]

_LAZY = {"Arrival": "arrival", "is_data_message": "arrival", "DATA_MESSAGES": "messages",
         "LentBlocks": "lent", "Kept": "kept", "KVVerifyError": "verify", "Freed": "held",
         "Renewals": "lease", "LeaseLinks": "lease", "lease_socket": "lease", **dict.fromkeys((
             "KVReceiver", "KVSender", "Peer", "PrefillJob", "SlotsTaken", "TransferError",
             "TransferStats"), "base")}


def __getattr__(name: str) -> Any:  # the contract loads torch: import it on first use
    if name == "CONNECTORS":  # the kinds now registered, in order
        return _kinds.kind_names()
    if name in _LAZY:
        return getattr(importlib.import_module(f"kvflow.connector.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvflow.connector' has no attribute {name!r}")


def bind_to_host(kind: str, host: str) -> None:
    """Bind connector ``kind``'s own listeners (nixl: UCX's) to ``host`` by its ``bind_host`` hook,
    before its halves open them; ValueError names ``--host`` when no interface here has it."""
    hook = _kinds.resolve(kind).bind_host
    if hook:
        module, func = hook.split(":")
        getattr(importlib.import_module(module), func)(host)


def resolve_connector(name: str, device: str = "cpu") -> str:
    """The connector kind ``name`` means on ``device`` (``auto``:
    :data:`kvflow.connector.kinds.AUTO`); ValueError for a name neither ``auto`` nor a kind."""
    return _kinds.resolve(name, device).name


def scales_refusal(kind: str | None, spec: Any, who: str = "spec") -> str:
    """Why connector ``kind`` (None: none) cannot move caches of ``spec`` ('' when it can): an fp8
    ``scales="block_head"`` spec and a kind without ``block_scales`` (``who`` names the side)."""
    if kind not in KINDS or KINDS[kind].block_scales or not getattr(spec, "is_fp8", False) \
            or spec.scales != "block_head":
        return ""
    movers = " or ".join(_kinds.with_capability("block_scales"))
    return (f"scales='block_head' ({who}): the {kind} connector moves block bytes only, not an "
            f"fp8 cache's per-block scales; use {movers}, or scales='tensor'")


def _checked(name: str, spec: Any, device: Any, config: Any) -> tuple[Kind, dict[str, Any]]:
    kind = _kinds.resolve(name, device)
    options = check_options(kind.name, config)
    if why := scales_refusal(kind.name, spec):
        raise ValueError(why)
    return kind, options


def _build(kind: Kind, class_name: str, *args: Any, **kw: Any) -> Any:
    return getattr(importlib.import_module(kind.module), class_name)(*args, **kw)


def make_sender(name: str, spec: Any, device: Any = "cpu", *, config: dict[str, Any] | None = None,
                **kw: Any) -> Any:
    """P's half of connector ``name`` (a kind or ``auto``) for P's cache ``spec`` on ``device``
    (``config``: ``kv_connector_config``; ``kw``: as :class:`~kvflow.connector.base.KVSender`).
    Raises ValueError: unknown name or config key, a bad config value, or
    :func:`scales_refusal`'s refusal."""
    kind, options = _checked(name, spec, device, config)
    return _build(kind, kind.sender, spec, device, **_kinds.half_options(kind.name, options,
                                                                          "sender"), **kw)


def make_receiver(name: str, spec: Any = None, device: Any = "cpu", *,
                  backend: str = "auto", config: dict[str, Any] | None = None,
                  max_model_len: int = 2048, head_start: int | None = None) -> Any:
    """D's half of connector ``name`` for a cache of ``spec`` on ``device`` (``config``:
    ``kv_connector_config``; ``max_model_len``: tokens, sizes nixl's staging; ``head_start``: D
    holds P's KV heads ``[head_start, head_start + spec.num_kv_heads)``, every transfer re-blocked).
    ValueError as :func:`make_sender`, or ``head_start`` for a kind without ``head_slices``."""
    kind, options = _checked(name, spec, device, config)
    if head_start is not None and not kind.head_slices:
        takers = " and ".join(_kinds.with_capability("head_slices"))
        raise ValueError(f"head_start: only the {takers} receivers take a head slice, "
                         f"not {kind.name}")
    extra: dict[str, Any] = _kinds.half_options(kind.name, options, "receiver")
    if head_start is not None:
        extra["head_start"] = head_start
    if "max_model_len" in kind.receiver_args:  # e.g. nixl's staging is sized by it
        extra["max_model_len"] = max_model_len
    return _build(kind, kind.receiver_class(device), spec, device, backend=backend, **extra)
