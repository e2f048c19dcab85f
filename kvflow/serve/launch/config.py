"""Every setting of ``python -m kvflow.serve``: :class:`ServeConfig`, one field per flag with its
help text; :func:`build_parser` makes the parser from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from kvflow.connector import kinds

KV_LAYOUTS = ("NHD", "HND", "BM_NHD")  # --kv-layout, --decode-kv-layout
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")  # --kv-dtype

Text = typing.Union[str, typing.Callable[[], str]]


def _flag(help: Text, *, choices: Any = None, default_text: Text | None = None,
          metavar: str | None = None) -> dict[str, Any]:
    """Field metadata of one CLI flag: help without the default (the parser appends
    ``default_text``, else the default), choices; each may be a function, called when the
    parser is built (the connector flags' come from the kinds registered then)."""
    return {"help": help, "choices": choices, "default_text": default_text, "metavar": metavar}


def meta(f: dataclasses.Field, key: str) -> Any:
    """The metadata ``key`` of flag field ``f`` (a function's value when it is one)."""
    value = f.metadata.get(key)
    return value() if callable(value) else value


def _reblocking(what: str) -> typing.Callable[[], str]:
    return lambda: f"{what}: {', '.join(kinds.with_capability('reblocks'))})"


def _internal(help: str) -> dict[str, Any]:
    """Field metadata of a setting that is not a flag (set by the parent or tests)."""
    return {"help": help, "internal": True}


@dataclass
class ServeConfig:
    """The settings of a router, P, D or colocated instance, a field per flag (``kv_lease_s``:
    ``--kv-lease-s``); seconds, MiB, tokens. Built by :func:`~.checks.parse_config`,
    :meth:`from_json`."""

    host: str = field(default="127.0.0.1", metadata=_flag(
        "address the router (HTTP and control socket) and D's data socket bind to "
        "(127.0.0.1: this machine only)"))
    advertise_host: str | None = field(default=None, metadata=_flag(
        "address other hosts dial to reach this process's sockets (the router's control "
        "address, D's data address; shown in /health)", default_text="--host, or with --host "
        "0.0.0.0 this host's address on its default route"))
    port: int = field(default=8000, metadata=_flag("HTTP port of the router"))
    mode: str = field(default="disagg", metadata=_flag(
        "disagg: separate P and D instances that move the KV cache over --kv-connector; "
        "colocated: one instance prefills and decodes in one cache (the reference for token "
        "identity)", choices=("disagg", "colocated")))
    model: str = field(default="kvflow-tiny", metadata=_flag(
        "built-in model name (kvflow-tiny: seeded weights, byte tokenizer, no download) or a "
        "local Hugging Face Llama/Qwen2 checkpoint directory"))
    kv_connector: str = field(default="auto", metadata=_flag(
        kinds.help_kinds, choices=lambda: ("auto", *kinds.kind_names())))
    kv_connector_config: dict = field(default_factory=dict, metadata=_flag(
        kinds.help_options, default_text="{}", metavar="JSON"))
    layerwise_min_tokens: int | None = field(default=None, metadata=_flag(
        "prompts of at least this many tokens move layer by layer while P still prefills; "
        "shorter ones move after the prefill (above --max-model-len: every one)",
        default_text=lambda: f"the connector's: {kinds.layerwise_defaults()}; "
                             f"docs/gpu_serving.md gives the measurements"))
    device: str = field(default="cpu", metadata=_flag(
        "torch device of the model and caches; with cuda and --role all each instance gets its "
        "own GPU (see --prefill-device)", choices=("cpu", "cuda")))
    prefill_device: int = field(default=0, metadata=_flag(
        "with --device cuda: GPU (this process's ordinal) of the prefill or colocated instance"))
    decode_device: int = field(default=1, metadata=_flag(
        "with --device cuda: GPU of the decode instance; P and D each also see the other's "
        "GPU, to open its cache by CUDA IPC. Equal to --prefill-device (e.g. 0 on a one-GPU "
        "machine): P and D share that GPU, each with half of --gpu-memory-utilization"))
    dtype: str = field(default="float32", metadata=_flag(
        "model weights and KV cache dtype", choices=("float32", "bfloat16", "float16")))
    block_size: int = field(default=16, metadata=_flag("tokens per KV block"))
    kv_layout: str = field(default="NHD", metadata=_flag(
        "KV cache layout: NHD [blocks, block_size, heads, head_dim], HND [blocks, heads, "
        "block_size, head_dim] or BM_NHD (block-major NHD: all layers of a block contiguous, "
        "one NIXL descriptor per block)", choices=KV_LAYOUTS))
    kv_dtype: str | None = field(default=None, metadata=_flag(
        "KV cache dtype (fp8: per-tensor scales, 1.0)", choices=KV_DTYPES,
        default_text="--dtype"))
    decode_block_size: int | None = field(default=None, metadata=_flag(
        _reblocking("tokens per KV block of the decode instance, when it differs from P's (the "
                    "connector re-blocks"), default_text="--block-size"))
    decode_kv_layout: str | None = field(default=None, metadata=_flag(
        _reblocking("KV cache layout of the decode instance (the connector maps P's to it"),
        choices=KV_LAYOUTS, default_text="--kv-layout"))
    decode_kv_dtype: str | None = field(default=None, metadata=_flag(
        _reblocking("KV cache dtype of the decode instance (the connector converts P's to it"),
        choices=KV_DTYPES, default_text="--kv-dtype"))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "longest prompt + generated tokens of one request", default_text="min(model limit, 2048)"))
    max_num_batched_tokens: int = field(default=512, metadata=_flag(
        "tokens per prefill forward (chunked prefill) and the profile run's batch"))
    num_blocks: int | None = field(default=None, metadata=_flag(
        "KV blocks per instance", default_text="sized by a profile run from the memory budget "
                                               "(--memory-budget-mb, or --gpu-memory-utilization "
                                               "on CUDA)"))
    memory_budget_mb: int | None = field(default=None, metadata=_flag(
        "MiB per instance for weights + activations + KV cache, for the profile run",
        default_text="512 on CPU; on CUDA the budget is --gpu-memory-utilization"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_flag(
        "with --device cuda: fraction of the GPU's free memory (measured when the instance "
        "starts) that one instance takes for weights + activations + KV cache, as vLLM's flag",
        default_text="0.9; P and D on one GPU get half each"))
    backend: str = field(default="auto", metadata=_flag(
        "kvflow.kernels backend for block movement"))
    role: str = field(default="all", metadata=_flag(
        "all: router + instances as child processes; router: the router only; "
        "prefill/decode/colocated: one instance that registers with --router-url",
        choices=("all", "router", "prefill", "decode", "colocated")))
    router_url: str | None = field(default=None, metadata=_flag(
        "the router's control address tcp://HOST:PORT (printed by --role router); needed by "
        "--role prefill/decode/colocated", default_text="none"))
    control_port: int = field(default=0, metadata=_flag(
        "port of the router's ZMQ control socket (0: a free port)"))
    register_timeout_s: float = field(default=60.0, metadata=_flag(
        "--role prefill/decode/colocated: give up (exit 1) when the router has not answered the "
        "registration within this many seconds after start-up; a warning says every few "
        "seconds that the instance waits"))
    enable_prefix_caching: bool = field(default=False, metadata=_flag(
        "D keeps a prefix cache of full prompt blocks; a hit moves only the missing blocks"))
    kv_verify: bool = field(default=False, metadata=_flag(
        lambda: "fail closed on corrupted KV: P sends a digest of every block it sends (a "
                "gather computes it in its own launch), D checks it after its copy/scatter; a "
                "mismatch ends the request with HTTP 502 and its blocks are freed, never "
                "decoded from (" + " and ".join(kinds.with_capability("kv_verify"))
                + "; docs/reliability.md)"))
    kv_lease_s: float = field(default=5.0, metadata=_flag(
        "P holds blocks it sent only while D renews this lease (or until D's ack); seconds"))
    receive_timeout_s: float = field(default=120.0, metadata=_flag(
        "D frees a request whose KV has not arrived within this many seconds"))
    admit_timeout_s: float = field(default=30.0, metadata=_flag(
        "router: while D has no free blocks for a request, retry this long, then HTTP 503"))
    dead_after_s: float = field(default=10.0, metadata=_flag(
        "router: an instance whose process it cannot see (another host) that sent nothing for "
        "this long is dead; one whose process has exited is dead at once"))
    hung_after_s: float = field(default=60.0, metadata=_flag(
        "router: an instance on the router's host whose process lives but sent nothing for "
        "this long is dead (hung); until then it is late"))
    api_key: str | None = field(default=None, metadata=_flag(
        "router: require 'Authorization: Bearer KEY' on /v1/* (HTTP 401 otherwise); also read "
        "from the KVFLOW_API_KEY environment variable", default_text="no key"))
    log_level: str = field(default="warning", metadata=_flag(
        "how much the processes log to stderr", choices=("debug", "info", "warning", "error")))
    heartbeat_s: float = field(default=0.2, metadata=_internal(
        "an instance reports its free blocks to the router this often (seconds)"))
    parent_pid: int | None = field(default=None, metadata=_internal(
        "an instance started by python -m kvflow.serve exits when this parent is gone"))

    def to_json(self) -> str:
        """The config as one JSON object (what a child instance gets)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ServeConfig":
        """The config :meth:`to_json` wrote. Raises ValueError: ``text`` is not a JSON object, or
        names a setting :class:`ServeConfig` lacks."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a ServeConfig is a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"ServeConfig has no setting {', '.join(unknown)}")
        return cls(**data)


def cli_fields() -> list[dataclasses.Field]:
    """The fields of :class:`ServeConfig` that are CLI flags (all but the internal ones)."""
    return [f for f in dataclasses.fields(ServeConfig) if not f.metadata.get("internal")]


def flag_name(name: str) -> str:
    """The flag of field ``name``: ``kv_lease_s`` -> ``--kv-lease-s``."""
    return "--" + name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    """The default value of field ``f`` (also for ``default_factory`` fields)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (:class:`~.startup.StartupError`, exit 1), not usage + 2."""

    def error(self, message: str):
        from .startup import StartupError
        raise StartupError(f"{message}; python -m kvflow.serve --help lists the flags")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser of ``python -m kvflow.serve``, a flag per :class:`ServeConfig` field; the
    namespace holds the flags given only. ``--config-json`` (hidden): a parent's config for its
    child."""
    p = _Parser(prog="python -m kvflow.serve", description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                argument_default=argparse.SUPPRESS)
    hints = typing.get_type_hints(ServeConfig)
    for f in cli_fields():
        default, help = default_of(f), meta(f, "help")
        if hints[f.name] is bool:
            p.add_argument(flag_name(f.name), action="store_true", help=help)
            continue
        base = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        kind = base[0] if base[0] in (int, float) else str  # dicts arrive as JSON text
        shown = meta(f, "default_text") or default
        metavar = meta(f, "metavar") or {int: "N", float: "S" if f.name.endswith("_s")
                                         else "X"}.get(kind)
        p.add_argument(flag_name(f.name), type=kind, choices=meta(f, "choices"), metavar=metavar,
                       help=f"{help} (default: {shown})")
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    return p
