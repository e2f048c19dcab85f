"""The flags read into a :class:`~.config.ServeConfig` and checked together before anything
starts (and before torch is imported): every refusal is one line naming the flag and a fix."""

from __future__ import annotations

import json
import os
import re

from kvflow.connector import kinds

from .config import ServeConfig, build_parser, flag_name
from .startup import StartupError

_INSTANCE_ROLES = ("prefill", "decode", "colocated")
_CONNECTOR_FLAGS = ("kv_connector", "kv_connector_config", "layerwise_min_tokens", "kv_verify")
LEASE_RENEWALS = 2  # a lease outlasts this many of D's renewals (one may be late or lost)
_SECONDS = ("kv_lease_s", "receive_timeout_s", "admit_timeout_s", "dead_after_s", "hung_after_s",
            "register_timeout_s")
#: ``--backend`` values besides ``auto``: kvflow.kernels.registry's (which imports torch; a
#: test checks that both lists agree)
BACKEND_NAMES = ("copy_engine", "native", "numba", "numba_cuda", "torch", "triton", "xpu")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of --dtype
_POSITIVE = ("block_size", "decode_block_size", "max_model_len", "num_blocks", "memory_budget_mb",
             "max_num_batched_tokens")


def parse_config(argv: list[str] | None = None, description: str = "") -> ServeConfig:
    """The checked config of the flags ``argv`` (default ``sys.argv[1:]``; ``--config-json``
    stands alone). Raises :class:`StartupError`: one line naming the flag, its value, a fix."""
    given = vars(build_parser(description).parse_args(argv))
    if "config_json" in given:
        if len(given) > 1:
            raise StartupError(f"--config-json (a parent's config for its child instance) takes "
                               f"no other flag, got {', '.join(map(flag_name, sorted(given)[1:]))}")
        try:
            cfg = ServeConfig.from_json(given["config_json"])
        except (ValueError, TypeError) as exc:
            raise StartupError(f"--config-json: {exc}") from None
        check_config(cfg, set())
        return cfg
    if "kv_connector_config" in given:
        given["kv_connector_config"] = _json_object(given["kv_connector_config"])
    cfg = ServeConfig(**given)
    if cfg.api_key is None:
        cfg.api_key = os.environ.get("KVFLOW_API_KEY") or None
    check_config(cfg, set(given))
    return cfg


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StartupError(f"--kv-connector-config is not valid JSON ({exc}), got {text!r}; pass "
                           f"an object such as '{{\"max_ctas\": 16}}'") from None
    if not isinstance(value, dict):
        raise StartupError(f"--kv-connector-config must be a JSON object such as "
                           f"'{{\"max_ctas\": 16}}', got {text!r}")
    return value


def check_config(cfg: ServeConfig, given: set[str]) -> None:
    """Check ``cfg``; ``given`` names the fields set by flags (a combination that would ignore
    one of them is refused only when given). Raises :class:`StartupError` as parse_config."""
    from .budget import check_budget_flags
    from .startup import check_model
    _check_ranges(cfg)
    _check_connector(cfg, given)
    check_budget_flags(cfg.device, cfg.memory_budget_mb, cfg.gpu_memory_utilization)
    for name in ("memory_budget_mb", "gpu_memory_utilization"):
        if cfg.num_blocks is not None and getattr(cfg, name) is not None and name in given:
            raise StartupError(f"give --num-blocks ({cfg.num_blocks}) or {flag_name(name)} "
                               f"({getattr(cfg, name):g}), not both: --num-blocks sets the KV "
                               f"cache size, {flag_name(name)} sizes it by a profile run")
    if cfg.device == "cpu":
        for name in ("prefill_device", "decode_device"):
            if name in given:
                raise StartupError(f"{flag_name(name)} {getattr(cfg, name)} needs --device cuda "
                                   f"(on cpu there is one device); leave it out or add "
                                   f"--device cuda")
    model = check_model(cfg.model)
    limit = model.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise StartupError(f"--max-model-len {cfg.max_model_len} exceeds the model's "
                           f"max_position_embeddings={limit} ({cfg.model}); use at most {limit}")
    longest = cfg.max_model_len or limit
    for name in ("block_size", "decode_block_size"):
        if (getattr(cfg, name) or 0) > longest:
            raise StartupError(f"{flag_name(name)} {getattr(cfg, name)} exceeds the longest "
                               f"request ({longest} tokens): no request fills one block; use at "
                               f"most {longest}")
    _check_verify(cfg, limit)
    _check_roles(cfg)
    if cfg.backend != "auto" and cfg.backend not in BACKEND_NAMES:
        raise StartupError(f"--backend {cfg.backend} is unknown; use auto or one of "
                           f"{', '.join(BACKEND_NAMES)}")
    if cfg.num_blocks is not None and cfg.device == "cpu":
        _check_cache_fits(cfg, model)


def _check_ranges(cfg: ServeConfig) -> None:
    if cfg.layerwise_min_tokens is not None and cfg.layerwise_min_tokens < 0:
        raise StartupError(f"--layerwise-min-tokens must be >= 0, got {cfg.layerwise_min_tokens}")
    for name in _SECONDS:
        v = getattr(cfg, name)
        if not 0 < v < 1e6:
            raise StartupError(f"{flag_name(name)} must be a positive number of seconds, got {v}")
    if cfg.kv_lease_s < LEASE_RENEWALS * cfg.heartbeat_s:
        raise StartupError(f"--kv-lease-s {cfg.kv_lease_s:g} is shorter than {LEASE_RENEWALS} of "
                           f"D's lease renewals (one every heartbeat, {cfg.heartbeat_s:g} s): P "
                           f"would free blocks D still reads; use at least "
                           f"{LEASE_RENEWALS * cfg.heartbeat_s:g}")
    for name in ("prefill_device", "decode_device"):
        if getattr(cfg, name) < 0:
            raise StartupError(f"{flag_name(name)} must be a GPU ordinal >= 0, got "
                               f"{getattr(cfg, name)}")
    if not 0 < cfg.port < 65536:
        raise StartupError(f"--port must be a port in 1..65535, got {cfg.port}")
    for name in _POSITIVE:
        v = getattr(cfg, name)
        if v is not None and v <= 0:
            raise StartupError(f"{flag_name(name)} must be positive, got {v}")
    if not 0 <= cfg.control_port < 65536:
        raise StartupError(f"--control-port must be a port in 0..65535 (0: a free one), got "
                           f"{cfg.control_port}")
    if ":" in cfg.host:
        raise StartupError(f"--host {cfg.host} is an IPv6 address; kvflow's ZMQ sockets listen "
                           f"on IPv4 only: use 127.0.0.1, 0.0.0.0 or an IPv4 address of this host")


def _check_connector(cfg: ServeConfig, given: set[str]) -> None:
    if "colocated" in (cfg.mode, cfg.role):
        for name in _CONNECTOR_FLAGS:
            if name in given:
                value = getattr(cfg, name)
                shown = json.dumps(value) if isinstance(value, dict) else value
                named = flag_name(name) if isinstance(value, bool) else f"{flag_name(name)} {shown}"
                where = "--mode colocated" if cfg.mode == "colocated" else "--role colocated"
                raise StartupError(f"{named} has no effect with {where} (one "
                                   f"instance prefills and decodes: no KV moves); leave it out")
    kind = _kind(cfg)
    try:
        kinds.check_options(kind.name, cfg.kv_connector_config, where="--kv-connector-config")
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if cfg.mode != "colocated" and cfg.role == "all" and not kind.reblocks:
        for name, value, mine in _decode_differs(cfg):
            raise StartupError(
                f"{flag_name(name)} {value} differs from P's {mine}, and the {kind.name} "
                f"connector moves only equal KV cache specs (re-blocking connectors: "
                f"{', '.join(kinds.with_capability('reblocks'))}); leave it out or pick one "
                f"of those")


def _decode_differs(cfg: ServeConfig):
    """``(field, D's value, P's)`` of each ``--decode-*`` flag given with a value other than
    P's."""
    for name, mine in (("decode_block_size", cfg.block_size), ("decode_kv_layout", cfg.kv_layout),
                       ("decode_kv_dtype", cfg.kv_dtype or cfg.dtype)):
        value = getattr(cfg, name)
        if value is not None and value != mine:
            yield name, value, mine


def _kind(cfg: ServeConfig) -> kinds.Kind:
    try:  # argparse limits --kv-connector to the kinds; a child's --config-json may not
        return kinds.resolve(cfg.kv_connector, cfg.device)
    except ValueError as exc:
        raise StartupError(f"--kv-connector: {exc}") from None


def _check_verify(cfg: ServeConfig, model_limit: int) -> None:
    """``--kv-verify`` only where every transfer is checked: a kind with ``kv_verify``,
    whole-prompt moves, equal P and D specs."""
    if not cfg.kv_verify or "colocated" in (cfg.mode, cfg.role):
        return
    kind = _kind(cfg)
    if not kind.kv_verify:
        verified = kinds.with_capability("kv_verify")
        raise StartupError(f"--kv-verify checks the {' and '.join(verified)} connectors, "
                           f"not {kind.name} (--kv-connector {cfg.kv_connector}); use "
                           f"--kv-connector {' or '.join(verified)}, or leave --kv-verify out")
    max_len = cfg.max_model_len or min(model_limit, 2048)
    threshold = (kind.layerwise_min_tokens if cfg.layerwise_min_tokens is None
                 else cfg.layerwise_min_tokens)
    if threshold <= max_len:
        raise StartupError(f"--kv-verify does not check layer-by-layer transfers, and prompts "
                           f"from --layerwise-min-tokens {threshold} tokens (<= --max-model-len "
                           f"{max_len}) would move so; set --layerwise-min-tokens above {max_len}")
    for name, value, mine in _decode_differs(cfg):
        raise StartupError(f"--kv-verify does not check re-blocked transfers: "
                           f"{flag_name(name)} {value} differs from P's {mine}; leave one "
                           f"of them out")


def _check_roles(cfg: ServeConfig) -> None:
    if cfg.role in _INSTANCE_ROLES and not cfg.router_url:
        raise StartupError(f"--role {cfg.role} needs --router-url tcp://HOST:PORT (the router's "
                           f"control address)")
    if cfg.router_url is None:
        return
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d+)", cfg.router_url)
    if not m:
        raise StartupError(f"--router-url must look like tcp://HOST:PORT, got {cfg.router_url!r}")
    if not 0 < int(m.group(2)) < 65536:
        raise StartupError(f"--router-url {cfg.router_url}: port {m.group(2)} is not in "
                           f"1..65535; use the control address the router printed")
    if cfg.role not in _INSTANCE_ROLES:
        raise StartupError(f"--router-url {cfg.router_url} is for an instance that joins a router "
                           f"(--role prefill, decode or colocated); --role {cfg.role} starts its "
                           f"own router: leave --router-url out")


def _check_cache_fits(cfg: ServeConfig, mc) -> None:
    """``--num-blocks`` on CPU: one instance's KV cache (of model config ``mc``) must fit in
    this machine's memory."""
    # KVCacheSpec.bytes_per_block of an NHD cache, without torch: K and V per layer
    per_block = (2 * mc.num_layers * cfg.block_size * mc.num_kv_heads * mc.head_dim
                 * _ITEMSIZE[cfg.dtype])
    need = cfg.num_blocks * per_block
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise StartupError(f"--num-blocks {cfg.num_blocks} needs {need / 2**30:.1f} GiB of KV "
                           f"cache per instance ({per_block} bytes per block of "
                           f"{cfg.model}) but this machine has {have / 2**30:.1f} GiB of memory; "
                           f"lower --num-blocks, or leave it out to size the cache by a profile "
                           f"run from --memory-budget-mb")
