"""The connector kinds: one :class:`Kind` per ``--kv-connector`` value, in :data:`KINDS`, from
which the factory, :func:`check_options`, the pairing rules, ``--help`` and docs/design.md's
table (:func:`kinds_table`) are generated (docs/design.md, "Connectors"). Imports neither torch
nor a kind's module: serve's flag checks use it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``--kv-connector auto`` per device type (the first part of ``cuda:1``).
AUTO = {"cuda": "ipc-push", "cpu": "ipc-pull"}


@dataclass(frozen=True)
class Option:
    """One key of ``kv_connector_config``: ``type`` int, float (no bool) or str; ``choices`` or a
    ``minimum`` (inclusive unless ``exclusive``); ``sender`` / ``receiver``: which half takes it."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    exclusive: bool = False
    unit: str = ""
    sender: bool = True
    receiver: bool = False

    @property
    def rule(self) -> str:
        """What a value must be, e.g. ``an int >= 1``, ``a number of seconds > 0``."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        what = {int: "an int", float: "a number", str: "a string"}[self.type]
        if self.unit:
            what += f" of {self.unit}"
        if self.minimum is not None:
            what += f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        return what

    def valid(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.type is float
                                                     else self.type):
            return False
        if self.minimum is None:
            return True
        return value > self.minimum if self.exclusive else value >= self.minimum

    def describe(self) -> str:
        """``name (rule, default D): help``, one option of ``--help``."""
        return f"{self.name} ({self.rule}, default {self.shown}): {self.help}"

    @property
    def shown(self) -> str:
        """The default as ``--help`` and the docs write it (``30``, not ``30.0``)."""
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


@dataclass(frozen=True)
class Kind:
    """One connector kind: ``module`` holds ``sender`` (P's half) and ``receiver`` (D's;
    ``receiver_cuda`` on CUDA when set); ``receiver_args``: factory arguments D's class takes
    besides spec, device and backend; ``bind_host``: ``"module:function"`` called with ``--host``,
    or "". Capabilities (docs/design.md, "Connectors"): ``reblocks``, ``reblocks_fp8``,
    ``block_scales``, ``head_slices``, ``layerwise_min_tokens`` (tokens), ``reads_peer_memory`` /
    ``writes_peer_memory``, ``cross_host``, ``kv_verify``; ``extra``: the pip extra it needs."""

    name: str
    module: str
    sender: str
    receiver: str
    summary: str
    p_half: str
    d_half: str
    options: tuple[Option, ...] = ()
    receiver_cuda: str = ""
    receiver_args: tuple[str, ...] = ()
    reblocks: bool = False
    reblocks_fp8: bool = False
    block_scales: bool = True
    head_slices: bool = False
    layerwise_min_tokens: int = 16384  # measured (ipc-push): docs/gpu_serving.md
    reads_peer_memory: bool = False
    writes_peer_memory: bool = False
    cross_host: bool = False
    kv_verify: bool = False
    extra: str = ""
    bind_host: str = ""

    def option(self, key: str) -> Option:
        """The option ``key`` (KeyError when there is none)."""
        return {o.name: o for o in self.options}[key]

    def receiver_class(self, device: Any) -> str:
        cuda = str(device).startswith("cuda")
        return self.receiver_cuda if cuda and self.receiver_cuda else self.receiver


_LAYERS_PER_COPY = 4  # kvflow.connector.layer_copy.LAYERS_PER_COPY
#: kvflow.connector.receiver.RECEIVE_MAX_CTAS (capped: the interference study, docs/benchmarks.md)
_RECEIVE_MAX_CTAS = Option("receive_max_ctas", int, 16, "programs (CTAs) of each of D's receive "
                           "copies on CUDA (its scatter, or its copy from P's cache): D's decode "
                           "keeps the other SMs", minimum=1, sender=False, receiver=True)

KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("ipc-pull", "kvflow.connector.ipc_pull", "IpcPullSender", "IpcPullReceiver",
         receiver_cuda="CudaIpcPullReceiver",
         summary="D copies from P's exported cache: shared memory on CPU, CUDA IPC on GPU",
         p_half="exports its cache; `KVReady` / `KVLayer` with its block ids",
         d_half="`copy_blocks` from P's cache, `KVAck`", options=(_RECEIVE_MAX_CTAS,),
         reblocks=True, reblocks_fp8=True, head_slices=True, reads_peer_memory=True,
         kv_verify=True),
    Kind("ipc-push", "kvflow.connector.ipc_push", "PushSender", "PushReceiver",
         summary="D exports its cache and P writes each group of layers into D's blocks while "
                 "it prefills",
         p_half="`copy_blocks` into D's exported cache on a side stream, `KVPushed`",
         d_half="lends its blocks to P until `KVPushed`",
         options=(Option("layers_per_copy", int, _LAYERS_PER_COPY,
                         "layers per layerwise copy launch", minimum=1),
                  Option("max_ctas", int, 16, "programs (CTAs) of each layerwise copy on CUDA: "
                         "fewer leave the prefill more SMs, more copy each group faster",
                         minimum=1)),
         reblocks=True, reblocks_fp8=True, writes_peer_memory=True),
    Kind("tcp", "kvflow.connector.tcp", "TcpSender", "TcpReceiver",
         summary="P gathers blocks into zero-copy ZMQ frames, D scatters them; P and D may be "
                 "on different hosts",
         p_half="gather into staging, `KVData` / `KVLayer` + raw frames",
         d_half="scatter frames, `KVAck`", options=(_RECEIVE_MAX_CTAS,),
         reblocks=True, block_scales=False, head_slices=True, cross_host=True, kv_verify=True),
    Kind("nixl", "kvflow.connector.nixl", "NixlSender", "NixlReceiver",
         summary="P writes D's registered host or GPU memory with one-sided NIXL WRITEs; any "
                 "hosts",
         p_half="one NIXL WRITE per layer group into D's registered cache (or D's staging), "
                "`KVPushed`",
         d_half="registers its cache with a NIXL agent; staged: scatters on `KVPushed`",
         options=(Option("mode", str, "direct", "direct WRITEs P's blocks into D's "
                         "(one descriptor per block and tensor, or per block with --kv-layout "
                         "BM_NHD), staged gathers into a registered staging "
                         "buffer, one WRITE per layer group, and D scatters",
                         choices=("direct", "staged"), receiver=True),
                  Option("layers_per_copy", int, _LAYERS_PER_COPY,
                         "layers per layerwise WRITE", minimum=1, receiver=True),
                  Option("staging_slots", int, 4, "staged: paired P's a D can serve (one "
                         "staging slot each)", minimum=1, sender=False, receiver=True),
                  Option("write_timeout_s", float, 30.0, "P waits this long for a request's "
                         "WRITEs, then fails the request (KVPushed ok=false, HTTP 502): raise "
                         "it for long prompts over a slow link", minimum=0, exclusive=True,
                         unit="seconds"), _RECEIVE_MAX_CTAS),
         # every prompt layerwise: a WRITE is slower than P's compute of a layer group
         block_scales=False, layerwise_min_tokens=0, writes_peer_memory=True, cross_host=True,
         receiver_args=("max_model_len",), extra="nixl",
         bind_host="kvflow.connector.transport.nixl_net:bind_ucx_to_host"),
)}


def register_kind(kind: Kind) -> Kind:
    """Add (or replace) ``kind`` in :data:`KINDS`; returns it. ValueError: ``kind.name`` is
    ``auto`` or empty, or two of its options share a name."""
    names = [o.name for o in kind.options]
    if kind.name in ("", "auto") or len(set(names)) != len(names):
        raise ValueError(f"connector kind {kind.name!r}: the name must be non-empty and not "
                         f"'auto', the option names distinct; got options {names}")
    KINDS[kind.name] = kind
    return kind


def default_layerwise_min_tokens(name: str) -> int:
    """Kind ``name``'s default ``layerwise_min_tokens`` (:class:`Kind`'s if not registered)."""
    return KINDS[name].layerwise_min_tokens if name in KINDS else Kind.layerwise_min_tokens


def kind_names() -> tuple[str, ...]:
    return tuple(KINDS)


def with_capability(capability: str) -> tuple[str, ...]:
    """The kinds whose :class:`Kind` field ``capability`` is true, e.g. ``"reblocks"``."""
    return tuple(k.name for k in KINDS.values() if getattr(k, capability))


def resolve(name: str, device: Any = "cpu") -> Kind:
    """The kind ``name`` means on ``device`` (``auto``: :data:`AUTO`); ValueError when ``name``
    is neither ``auto`` nor a kind."""
    if name == "auto":
        name = AUTO["cuda" if str(device).startswith("cuda") else "cpu"]
    if name not in KINDS:
        raise ValueError(f"kv_connector must be 'auto' or one of {', '.join(KINDS)}; "
                         f"got {name!r}")
    return KINDS[name]


def check_options(kind: str, config: Any, where: str = "kv_connector_config") -> dict[str, Any]:
    """``config`` (a dict or None) checked against kind ``kind``'s options; returns a copy.
    ValueError (naming ``where``): not a dict, a key ``kind`` does not take, or a bad value."""
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a JSON object, got {config!r}")
    options = {o.name: o for o in KINDS[kind].options}
    for key, value in config.items():
        if key not in options:
            takes = ", ".join(options) or "none"
            raise ValueError(f"{where} key {key!r} is not an option of connector {kind!r} "
                             f"(it takes {takes})")
        if not options[key].valid(value):
            raise ValueError(f"{where} key {key!r} of connector {kind!r} must be "
                             f"{options[key].rule}; got {value!r}")
    return dict(config)


def half_options(kind: str, config: dict[str, Any], half: str) -> dict[str, Any]:
    """Every option ``half`` (``"sender"`` or ``"receiver"``) of ``kind`` takes: ``config``'s
    value or the default."""
    return {o.name: config.get(o.name, o.default) for o in KINDS[kind].options
            if getattr(o, half)}


def help_kinds() -> str:
    """``--kv-connector``'s help: each kind's summary, and what ``auto`` is."""
    kinds = "; ".join(f"{k.name} ({k.summary}" + (f"; extra [{k.extra}]" if k.extra else "") + ")"
                      for k in KINDS.values())
    auto = ", ".join(f"{kind} with --device {dev}" for dev, kind in AUTO.items())
    return f"how a request's KV moves from P to D: {kinds}; auto: {auto}"


def help_options() -> str:
    """``--kv-connector-config``'s help: every kind's options with type, range and default."""
    per_kind = " | ".join(f"{k.name}: " + ("; ".join(o.describe() for o in k.options) or "none")
                          for k in KINDS.values())
    return f"JSON object of options of the connector, e.g. '{{\"max_ctas\": 8}}'. {per_kind}"


def layerwise_defaults() -> str:
    """Each kind's default ``layerwise_min_tokens``, grouped: ``16384 (ipc-pull, ...)``."""
    groups: dict[int, list[str]] = {}
    for k in KINDS.values():
        groups.setdefault(k.layerwise_min_tokens, []).append(k.name)
    return ", ".join(f"{n} ({', '.join(names)})" for n, names in groups.items())


def kinds_table() -> str:
    """The connector table of docs/design.md (markdown, one row per kind), ending in a newline."""
    rows = ["| kind | module | P's half | D's half | options (`--kv-connector-config`) | "
            "re-blocks | block scales | head slices | layerwise default | hosts |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for k in KINDS.values():
        opts = ", ".join(f"`{o.name}` ({o.shown})" for o in k.options) or "none"
        hosts = "any" if k.cross_host else "one"
        rows.append(f"| `{k.name}` | `{k.module}` | {k.p_half} | {k.d_half} | {opts} | "
                    f"{yes[k.reblocks]} | {yes[k.block_scales]} | {yes[k.head_slices]} | "
                    f"{k.layerwise_min_tokens} | {hosts}"
                    + (f" (extra `[{k.extra}]`)" if k.extra else "") + " |")
    return "\n".join(rows) + "\n"

