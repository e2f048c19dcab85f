"""Connectors: how a request's KV moves from a prefill instance (P) to a decode instance (D).

The kinds are the entries of :data:`kvflow.connector.kinds.KINDS`, one module each (the
registry holds each kind's module, classes, options and capabilities; docs/design.md,
"Connectors", is its table):

- ``ipc-pull`` (:mod:`.ipc_pull`): one host; P's cache is exported (shared memory on CPU, CUDA
  IPC on GPU) and D copies the request's blocks out of it.
- ``ipc-push`` (:mod:`.ipc_push`): one host; D's cache is exported and P writes each layer group
  into it while it prefills.
- ``tcp`` (:mod:`.tcp`): P gathers into a staging buffer and sends zero-copy ZMQ frames, D
  scatters; works between hosts.
- ``nixl`` (:mod:`.nixl`): D registers its cache with a NIXL agent and P writes each layer
  group into it with one-sided WRITEs while it prefills; works between hosts (extra
  ``[nixl]``).

``auto`` resolves to ``ipc-push`` on CUDA and ``ipc-pull`` on CPU (:func:`resolve_connector`).
:func:`make_sender` builds P's half, :func:`make_receiver` D's half, both from the registry;
the contract is :mod:`.base`. Serving code imports this package only, never a kind's module.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import kinds as _kinds
from .kinds import KINDS, Kind, Option, check_options, register_kind

__all__ = ["Arrival", "CONNECTORS", "Freed", "Handoff", "Held", "KINDS", "KVReceiver", "KVSender",
           "KVVerifyError", "Kind", "LeaseLinks", "LentBlocks", "Option", "Peer", "PrefillJob",
           "DATA_MESSAGES", "Renewals",
           "SlotsTaken", "TransferError", "TransferStats", "bind_to_host", "check_connector_config",
           "get_kind", "is_data_message", "lease_socket", "make_receiver", "make_sender",
           "register_kind", "resolve_connector", "scales_refusal"]

_BASE = ("Handoff", "KVReceiver", "KVSender", "Peer", "PrefillJob", "SlotsTaken", "TransferError",
         "TransferStats")
_SIDES = {"Arrival": "arrival", "is_data_message": "arrival", "LentBlocks": "lent",
           "Renewals": "lease", "LeaseLinks": "lease", "lease_socket": "lease", "Freed": "held",
           "Held": "held", "DATA_MESSAGES": "messages"}


def __getattr__(name: str) -> Any:  # the contract loads torch: import it on first use
    if name == "CONNECTORS":  # the kinds now registered, in order
        return _kinds.kind_names()
    if name in _BASE:
        return getattr(importlib.import_module("kvflow.connector.base"), name)
    if name in _SIDES:  # the data plane: D's arrivals, lent blocks, lease; P's held blocks
        return getattr(importlib.import_module(f"kvflow.connector.{_SIDES[name]}"), name)
    if name == "KVVerifyError":  # --kv-verify's mismatch (kvflow.connector.verify)
        return importlib.import_module("kvflow.connector.verify").KVVerifyError
    raise AttributeError(f"module 'kvflow.connector' has no attribute {name!r}")


def get_kind(name: str, device: Any = "cpu") -> Kind:
    """The registry entry of ``name`` (a kind or ``auto``) on ``device``
    (:func:`kvflow.connector.kinds.resolve`; ValueError for an unknown name)."""
    return _kinds.resolve(name, device)


def bind_to_host(kind: str, host: str) -> None:
    """Make connector ``kind``'s own listeners bind to ``host`` (``--host``), before its
    sender or receiver opens them: the kind's ``bind_host`` hook (for ``nixl``, UCX's TCP
    listeners on that address's interface,
    :func:`kvflow.connector.transport.nixl_net.bind_ucx_to_host`); other kinds bind their
    sockets where serve tells them already.

    Raises
    ------
    ValueError
        ``host`` is an address of no interface of this machine (naming ``--host``).
    """
    hook = _kinds.resolve(kind).bind_host
    if hook:
        module, func = hook.split(":")
        getattr(importlib.import_module(module), func)(host)


def resolve_connector(name: str, device: str = "cpu") -> str:
    """The connector kind ``name`` means on ``device``: ``auto`` is ``ipc-push`` on CUDA and
    ``ipc-pull`` elsewhere (:data:`kvflow.connector.kinds.AUTO`); a kind of :data:`KINDS` is
    itself.

    Raises
    ------
    ValueError
        For a name that is neither ``auto`` nor a kind.
    """
    return _kinds.resolve(name, device).name


def scales_refusal(kind: str | None, spec: Any, who: str = "spec") -> str:
    """'' when connector ``kind`` (None: no connector) can move caches of ``spec`` (a
    KVCacheSpec or None), else why not: a kind without ``block_scales`` (it moves block bytes
    only) and an fp8 spec with ``scales="block_head"``, e.g. ``scales='block_head' (spec): the
    tcp connector moves block bytes only, not an fp8 cache's per-block scales; use ipc-pull or
    ipc-push, or scales='tensor'`` (``who`` names the side)."""
    if kind not in KINDS or KINDS[kind].block_scales or not getattr(spec, "is_fp8", False) \
            or spec.scales != "block_head":
        return ""
    movers = " or ".join(_kinds.with_capability("block_scales"))
    return (f"scales='block_head' ({who}): the {kind} connector moves block bytes only, not an "
            f"fp8 cache's per-block scales; use {movers}, or scales='tensor'")


def check_connector_config(name: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` checked against the options of connector ``name`` (a kind or ``auto``);
    returns a copy (:func:`kvflow.connector.kinds.check_options`, the one check).

    Raises
    ------
    ValueError
        ``config`` is not a dict, holds a key ``name`` does not accept, e.g.
        ``kv_connector_config key 'max_ctas' is not an option of connector 'tcp' (it takes
        none)``, or a value out of its option's type or range.
    """
    return check_options(resolve_connector(name), config)


def _build(kind: Kind, class_name: str, *args: Any, **kw: Any) -> Any:
    return getattr(importlib.import_module(kind.module), class_name)(*args, **kw)


def make_sender(name: str, spec: Any, device: Any = "cpu", *, config: dict[str, Any] | None = None,
                **kw: Any) -> Any:
    """P's half of connector ``name`` (a kind or ``auto``).

    Parameters
    ----------
    name : str
    spec : KVCacheSpec
        P's cache spec.
    device : str or torch.device
    config : dict, optional
        ``kv_connector_config`` (:func:`check_connector_config`).
    **kw
        ``instance_id``, ``backend``, ``layerwise_min_tokens``, ``max_model_len``
        (:class:`~kvflow.connector.base.KVSender`).

    Raises
    ------
    ValueError
        Unknown name or config key; a bad config value; an fp8 ``block_head`` spec for tcp
        or nixl (:func:`scales_refusal`).
    """
    kind = get_kind(name, device)
    options = check_options(kind.name, config)
    if why := scales_refusal(kind.name, spec):
        raise ValueError(why)
    if kw.get("layerwise_min_tokens") is None:
        kw["layerwise_min_tokens"] = kind.layerwise_min_tokens
    return _build(kind, kind.sender, spec, device, **_kinds.half_options(kind.name, options,
                                                                          "sender"), **kw)


def make_receiver(name: str, spec: Any = None, device: Any = "cpu", *,
                  backend: str = "auto", config: dict[str, Any] | None = None,
                  max_model_len: int = 2048, head_start: int | None = None) -> Any:
    """D's half of connector ``name`` (a kind or ``auto``) for a cache of ``spec`` on ``device``
    (``config``: ``kv_connector_config``; ``max_model_len``: tokens, sizes nixl's staging).

    ``head_start`` (ipc-pull and tcp): D's cache holds KV heads ``[head_start, head_start +
    spec.num_kv_heads)`` of P's (a tensor-parallel decode instance); every transfer re-blocks
    with it (:mod:`.reblocked`, :func:`kvflow.kernels.copy_sequence`).

    Raises
    ------
    ValueError
        Unknown name or config key; a bad config value; ``head_start`` for another kind; an
        fp8 ``block_head`` spec for tcp or nixl (:func:`scales_refusal`).
    """
    kind = get_kind(name, device)
    options = check_options(kind.name, config)
    if why := scales_refusal(kind.name, spec):
        raise ValueError(why)
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
