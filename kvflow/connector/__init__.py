"""Connectors: how a request's KV moves from a prefill instance (P) to a decode instance (D).

Kinds (:data:`CONNECTORS`), one module each:

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
:func:`make_sender` builds P's half, :func:`make_receiver` D's half; the contract is
:mod:`.base`. Serving code imports this package only, never a kind's module.
"""

from __future__ import annotations

import importlib
from typing import Any

CONNECTORS = ("ipc-pull", "ipc-push", "tcp", "nixl")
#: Keys of ``kv_connector_config`` each kind accepts, and what each means.
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "ipc-pull": {},
    "ipc-push": {"layers_per_copy": "layers per layerwise copy launch, default 4",
                 "max_ctas": "programs (CTAs) of each layerwise copy on CUDA, default 16: fewer "
                             "leave the prefill more SMs, more copy each group faster"},
    "tcp": {},
    "nixl": {"mode": "direct (WRITE P's blocks into D's, consecutive ids coalesced) or staged "
                     "(gather into a registered staging buffer, one WRITE per layer group, D "
                     "scatters), default direct",
             "layers_per_copy": "layers per layerwise WRITE, default 4",
             "staging_slots": "staged: paired P's a D can serve (one staging slot each), "
                              "default 4",
             "write_timeout_s": "seconds P waits for a request's WRITEs before it fails the "
                                "request (KVPushed ok=false, HTTP 502), default 30; raise it "
                                "for long prompts over a slow link"},
}
#: Kinds that move block bytes only: an fp8 cache's per-block scales (``scales="block_head"``)
#: would stay behind, so these kinds refuse such a spec (:func:`scales_refusal`).
BYTES_ONLY = ("tcp", "nixl")
#: Keys whose value is one of a few strings (the other keys take an int >= 1).
CONFIG_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {"nixl": {"mode": ("direct", "staged")}}

__all__ = ["BYTES_ONLY", "CONFIG_CHOICES", "CONFIG_KEYS", "CONNECTORS", "Handoff", "KVReceiver",
           "KVSender", "KVVerifyError", "Peer", "PrefillJob", "SlotsTaken", "TransferError",
           "TransferStats", "bind_to_host", "check_connector_config", "make_receiver",
           "make_sender", "resolve_connector", "scales_refusal"]

_BASE = ("Handoff", "KVReceiver", "KVSender", "Peer", "PrefillJob", "SlotsTaken", "TransferError",
         "TransferStats")


def __getattr__(name: str) -> Any:  # the contract loads torch: import it on first use
    if name in _BASE:
        return getattr(importlib.import_module("kvflow.connector.base"), name)
    if name == "KVVerifyError":  # --kv-verify's mismatch (kvflow.connector.verify)
        return importlib.import_module("kvflow.connector.verify").KVVerifyError
    raise AttributeError(f"module 'kvflow.connector' has no attribute {name!r}")


def bind_to_host(kind: str, host: str) -> None:
    """Make connector ``kind``'s own listeners bind to ``host`` (``--host``), before its
    sender or receiver opens them: for ``nixl``, UCX's TCP listeners on that address's
    interface (:func:`kvflow.connector.nixl_net.bind_ucx_to_host`); other kinds bind their
    sockets where serve tells them already.

    Raises
    ------
    ValueError
        ``host`` is an address of no interface of this machine (naming ``--host``).
    """
    if kind == "nixl":
        from .nixl_net import bind_ucx_to_host
        bind_ucx_to_host(host)


def resolve_connector(name: str, device: str = "cpu") -> str:
    """The connector kind ``name`` means on ``device``: ``auto`` is ``ipc-push`` on CUDA and
    ``ipc-pull`` elsewhere; a kind of :data:`CONNECTORS` is itself.

    Raises
    ------
    ValueError
        For a name that is neither ``auto`` nor a kind.
    """
    if name == "auto":
        return "ipc-push" if str(device).startswith("cuda") else "ipc-pull"
    if name not in CONNECTORS:
        raise ValueError(f"kv_connector must be 'auto' or one of {', '.join(CONNECTORS)}; "
                         f"got {name!r}")
    return name


def scales_refusal(kind: str, spec: Any, who: str = "spec") -> str:
    """'' when connector ``kind`` can move caches of ``spec`` (a KVCacheSpec or None), else
    why not: a :data:`BYTES_ONLY` kind and an fp8 spec with ``scales="block_head"``, e.g.
    ``scales='block_head' (spec): the tcp connector moves block bytes only, not an fp8 cache's
    per-block scales; use ipc-pull or ipc-push, or scales='tensor'`` (``who`` names the side)."""
    if kind not in BYTES_ONLY or not getattr(spec, "is_fp8", False) \
            or spec.scales != "block_head":
        return ""
    return (f"scales='block_head' ({who}): the {kind} connector moves block bytes only, not an "
            f"fp8 cache's per-block scales; use ipc-pull or ipc-push, or scales='tensor'")


def check_connector_config(name: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` checked against the keys connector ``name`` (a kind) accepts; returns a copy.

    Raises
    ------
    ValueError
        ``config`` is not a dict, or holds a key ``name`` does not accept, e.g.
        ``kv_connector_config key 'max_ctas' is not an option of connector 'tcp' (it takes
        none)``.
    """
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"kv_connector_config must be a JSON object, got {config!r}")
    keys = CONFIG_KEYS[resolve_connector(name)]
    for key in config:
        if key not in keys:
            takes = ", ".join(keys) if keys else "none"
            raise ValueError(f"kv_connector_config key {key!r} is not an option of connector "
                             f"{name!r} (it takes {takes})")
    return dict(config)


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
    kind = resolve_connector(name, device)
    options = check_connector_config(kind, config)
    if why := scales_refusal(kind, spec):
        raise ValueError(why)
    if kind == "ipc-push":
        from .ipc_push import PushSender
        return PushSender(spec, device, **options, **kw)
    if kind == "ipc-pull":
        from .ipc_pull import IpcPullSender
        return IpcPullSender(spec, device, **kw)
    if kind == "nixl":
        from .nixl import NixlSender
        options.pop("staging_slots", None)  # D's setting
        return NixlSender(spec, device, **options, **kw)
    from .tcp import TcpSender
    return TcpSender(spec, device, **kw)


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
    kind = resolve_connector(name, device)
    options = check_connector_config(kind, config)
    if why := scales_refusal(kind, spec):
        raise ValueError(why)
    if head_start is not None and kind not in ("ipc-pull", "tcp"):
        raise ValueError(f"head_start: only the ipc-pull and tcp receivers take a head slice, "
                         f"not {kind}")
    heads = {} if head_start is None else {"head_start": head_start}
    if kind == "nixl":
        from .nixl import NixlReceiver
        options.pop("write_timeout_s", None)  # P's setting
        return NixlReceiver(spec, device, backend=backend, max_model_len=max_model_len,
                            **options)
    if kind == "ipc-push":
        from .ipc_push import PushReceiver
        return PushReceiver(spec, device, backend=backend)
    if kind == "ipc-pull":
        if str(device).startswith("cuda"):
            from .ipc_pull import CudaIpcPullReceiver  # opens P's CUDA IPC handle
            return CudaIpcPullReceiver(spec, device, backend=backend, **heads)
        from .ipc_pull import IpcPullReceiver
        return IpcPullReceiver(spec, device, backend=backend, **heads)
    from .tcp import TcpReceiver
    return TcpReceiver(spec, device, backend=backend, **heads)
