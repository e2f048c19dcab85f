"""``python -m kvflow.serve``: a prefill/decode-disaggregated LLM server.

With no arguments: the router on http://127.0.0.1:8000, one prefill (P) and one decode (D)
instance of the built-in ``kvflow-tiny`` model as child processes, KV moved over ``ipc``
(shared memory); serves until Ctrl-C (SIGINT) or SIGTERM, then stops every child and removes
every shared-memory segment. ``--role`` starts a single component (for several hosts): the
router prints its control address, which ``--router-url`` of each instance names. A start-up
failure is one line on stderr naming the flag or value and a fix, exit status 1
(:mod:`kvflow.serve.startup`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from .budget import check_budget_flags
from .startup import (StartupError, check_backend, check_device, check_host, check_model,
                      one_line_errors, say)

DESCRIPTION = __doc__.split("\n\n")[0]
log = logging.getLogger("kvflow.serve")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: :class:`StartupError` (exit 1) instead of usage + exit 2."""

    def error(self, message: str):
        raise StartupError(f"{message}; python -m kvflow.serve --help lists the flags")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m kvflow.serve", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address the router (HTTP and control socket) and "
      "D's data socket bind to (default 127.0.0.1: this machine only)")
    a("--port", type=int, default=8000, help="HTTP port of the router (default 8000)")
    a("--mode", choices=("disagg", "colocated"), default="disagg",
      help="disagg: separate P and D instances with KV transfer (default); colocated: one "
           "instance prefills and decodes in one cache (the reference for token identity)")
    a("--model", default="kvflow-tiny", help="built-in model name (kvflow-tiny: seeded weights, "
      "byte tokenizer, no download) or a local Hugging Face Llama/Qwen2 checkpoint directory")
    a("--transfer", choices=("ipc", "tcp"), default="ipc",
      help="ipc: copy_blocks between the two instances' caches mapped in shared memory or by "
           "CUDA IPC (one host, default; see --ipc-direction); "
           "tcp: P gathers blocks and sends zero-copy ZMQ frames, D scatters them")
    a("--ipc-direction", choices=("auto", "push", "pull"), default="auto",
      help="with --transfer ipc: pull (D copies from P's exported cache after each part) or "
           "push (D exports its cache and P writes each layer into D's blocks as soon as it is "
           "computed: on CUDA a GPU-ordered copy beside P's compute, no host round trip per "
           "layer); auto (default): push with --device cuda, pull on CPU")
    a("--layerwise-max-ctas", type=int, default=None,
      help="with ipc push on CUDA: programs (CTAs) of each layerwise copy (a group of "
           "--layers-per-copy layers) while the prefill still computes (default 16); fewer "
           "leave the prefill more SMs, more copy each group faster")
    a("--layers-per-copy", type=int, default=None,
      help="with ipc push: layers per layerwise copy launch (default 4: each launch costs the "
           "prefill's host thread tens of microseconds; the last group is copied after the prefill)")
    a("--transfer-mode", choices=("layerwise", "request"), default="layerwise",
      help="layerwise: P signals each layer as the prefill writes it and a sender thread moves "
           "that layer's blocks at once, overlapping the transfer with the next layers' compute "
           "(default); request: the whole request moves after the prefill")
    a("--layerwise-min-tokens", type=int, default=None,
      help="prompts shorter than this many tokens use request mode even with --transfer-mode "
           "layerwise (default: 0 with ipc push; else 16384: on one H200 the host-signalled "
           "path beat request mode only at 16K tokens, "
           "bench/results/layerwise_gpu-nvidia-h200-20261129-run1.json)")
    a("--device", default="cpu", choices=("cpu", "cuda"), help="torch device of the model and "
      "caches (default cpu); with cuda and --role all each instance gets its own GPU (see "
      "--prefill-device)")
    a("--prefill-device", type=int, default=0, help="with --device cuda: GPU (this process's "
      "ordinal) of the prefill or colocated instance (default 0)")
    a("--decode-device", type=int, default=1, help="with --device cuda: GPU of the decode "
      "instance (default 1); P and D each also see the other's GPU, to open its cache by "
      "CUDA IPC. Equal to --prefill-device (e.g. 0 on a one-GPU machine): P and D share that "
      "GPU, each with half of --gpu-memory-utilization")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
      help="model weights and KV cache dtype (default float32)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    a("--max-model-len", type=int, default=None,
      help="longest prompt + generated tokens of one request (default min(model limit, 2048))")
    a("--max-num-batched-tokens", type=int, default=512,
      help="tokens per prefill forward (chunked prefill) and the profile run's batch (default 512)")
    a("--num-blocks", type=int, default=None,
      help="KV blocks per instance; default: sized by a profile run from the memory budget "
           "(--memory-budget-mb, or --gpu-memory-utilization on CUDA)")
    a("--memory-budget-mb", type=int, default=None,
      help="MiB per instance for weights + activations + KV cache, for the profile run "
           "(default 512 on CPU; on CUDA the default is --gpu-memory-utilization)")
    a("--gpu-memory-utilization", type=float, default=None,
      help="with --device cuda: fraction of the GPU's free memory (measured when the instance "
           "starts) that one instance takes for weights + activations + KV cache, as vLLM's flag "
           "(default 0.9; P and D on one GPU get half each)")
    a("--backend", default="auto", help="kvflow.kernels backend for block movement (default auto)")
    a("--role", choices=("all", "router", "prefill", "decode", "colocated"), default="all",
      help="all: router + instances as child processes (default); router: the router only; "
           "prefill/decode/colocated: one instance that registers with --router-url")
    a("--router-url", default=None, help="the router's control address tcp://HOST:PORT "
      "(printed by --role router); needed by --role prefill/decode/colocated")
    a("--control-port", type=int, default=0,
      help="port of the router's ZMQ control socket (default 0: a free port)")
    a("--register-timeout-s", type=float, default=60.0,
      help="--role prefill/decode/colocated: give up (exit 1) when the router has not answered "
           "the registration within this many seconds after start-up; a warning says every few "
           "seconds that the instance waits (default 60)")
    a("--enable-prefix-caching", action="store_true",
      help="D keeps a prefix cache of full prompt blocks; a hit moves only the missing blocks")
    a("--kv-lease-s", type=float, default=5.0,
      help="P holds blocks it sent only while D renews this lease (or until D's ack); "
           "seconds (default 5)")
    a("--receive-timeout-s", type=float, default=120.0,
      help="D frees a request whose KV has not arrived within this many seconds (default 120)")
    a("--admit-timeout-s", type=float, default=30.0,
      help="router: while D has no free blocks for a request, retry this long, then HTTP 503 "
           "(default 30)")
    a("--dead-after-s", type=float, default=2.0,
      help="router: an instance that sent nothing for this long is dead (default 2)")
    a("--api-key", default=None,
      help="router: require 'Authorization: Bearer KEY' on /v1/* (HTTP 401 otherwise); "
           "default: no key. Also read from the KVFLOW_API_KEY environment variable")
    a("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
      help="logging level (default warning)")
    return p


def _fail(message: str):
    raise StartupError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags (also ``--model``, without loading it); a bad one prints one
    line naming the flag, its value and a fix to stderr and exits 1 (``SystemExit(1)``)."""
    try:
        return check_args(argv)
    except StartupError as exc:
        say(str(exc), sys.stderr)
        raise SystemExit(1) from None


def check_args(argv: list[str] | None = None) -> argparse.Namespace:
    """:func:`parse_args` that raises instead of printing.

    Raises
    ------
    StartupError
        One line naming the flag, its value and a fix.
    """
    args = build_parser().parse_args(argv)
    if args.layerwise_min_tokens is not None and args.layerwise_min_tokens < 0:
        _fail(f"--layerwise-min-tokens must be >= 0, got {args.layerwise_min_tokens}")
    if args.transfer != "ipc" and args.ipc_direction != "auto":
        _fail(f"--ipc-direction {args.ipc_direction} needs --transfer ipc "
              f"(got --transfer {args.transfer})")
    for flag in ("layerwise_max_ctas", "layers_per_copy"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for name in ("kv_lease_s", "receive_timeout_s", "admit_timeout_s", "dead_after_s",
                 "register_timeout_s"):
        v = getattr(args, name)
        if not 0 < v < 1e6:
            _fail(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    if args.api_key is None:
        args.api_key = os.environ.get("KVFLOW_API_KEY") or None
    for name in ("prefill_device", "decode_device"):
        if getattr(args, name) < 0:
            _fail(f"--{name.replace('_', '-')} must be a GPU ordinal >= 0, got {getattr(args, name)}")
    for name in ("port", "block_size", "max_model_len", "num_blocks", "memory_budget_mb",
                 "max_num_batched_tokens"):
        v = getattr(args, name)
        if name == "port" and not 0 < v < 65536:
            _fail(f"--port must be a port in 1..65535, got {v}")
        if name != "port" and v is not None and v <= 0:
            _fail(f"--{name.replace('_', '-')} must be positive, got {v}")
    if not 0 <= args.control_port < 65536:
        _fail(f"--control-port must be a port in 0..65535 (0: a free one), got {args.control_port}")
    check_budget_flags(args.device, args.memory_budget_mb, args.gpu_memory_utilization)
    limit = check_model(args.model)
    if args.max_model_len is not None and args.max_model_len > limit:
        _fail(f"--max-model-len {args.max_model_len} exceeds the model's "
              f"max_position_embeddings={limit} ({args.model}); use at most {limit}")
    if args.role in ("prefill", "decode", "colocated") and not args.router_url:
        _fail(f"--role {args.role} needs --router-url tcp://HOST:PORT (the router's control address)")
    if args.router_url:
        m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})", args.router_url)
        if not m or not 0 < int(m.group(2)) < 65536:
            _fail(f"--router-url must look like tcp://HOST:PORT, got {args.router_url!r}")
    if args.backend != "auto":
        from kvflow.kernels.registry import backend_names
        if args.backend not in backend_names():
            _fail(f"--backend {args.backend} is unknown; use auto or one of {', '.join(backend_names())}")
    return args


def _instance_args(args: argparse.Namespace, router_url: str) -> list[str]:
    out = ["--router-url", router_url, "--model", args.model, "--device", args.device,
           "--dtype", args.dtype,
           "--block-size", str(args.block_size), "--transfer", args.transfer,
           "--transfer-mode", args.transfer_mode, "--ipc-direction", args.ipc_direction,
           "--backend", args.backend,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--host", args.host,
           "--log-level", args.log_level, "--kv-lease-s", str(args.kv_lease_s),
           "--receive-timeout-s", str(args.receive_timeout_s)]
    if args.enable_prefix_caching:
        out.append("--enable-prefix-caching")
    for name in ("max_model_len", "num_blocks", "layerwise_min_tokens", "layerwise_max_ctas",
                 "layers_per_copy", "memory_budget_mb", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if (args.device == "cuda" and args.mode == "disagg" and args.memory_budget_mb is None
            and args.prefill_device == args.decode_device):
        from .budget import shared_gpu_utilization  # P and D on one GPU: half the fraction each
        out += ["--gpu-memory-utilization",
                str(shared_gpu_utilization(args.gpu_memory_utilization, 2))]
    return out


def connector_fields(args: argparse.Namespace) -> dict:
    """``kv_connector``, ``kv_connector_config`` and ``layerwise_min_tokens`` of
    :class:`~kvflow.serve.instance.InstanceConfig` from the transport flags: ``--transfer tcp``
    is ``tcp``; ``--transfer ipc`` is ``ipc-pull``/``ipc-push`` by ``--ipc-direction`` (auto:
    ``auto``); ``--layerwise-max-ctas``/``--layers-per-copy`` are ipc-push's ``max_ctas`` /
    ``layers_per_copy``; ``--transfer-mode request`` is a threshold no prompt reaches."""
    from kvflow.connector import resolve_connector
    name = "tcp" if args.transfer == "tcp" else {"pull": "ipc-pull", "push": "ipc-push"}.get(
        args.ipc_direction, "auto")
    config = {}
    if resolve_connector(name, args.device) == "ipc-push":
        for flag, key in (("layerwise_max_ctas", "max_ctas"), ("layers_per_copy", "layers_per_copy")):
            if getattr(args, flag) is not None:
                config[key] = getattr(args, flag)
    threshold = args.layerwise_min_tokens if args.transfer_mode == "layerwise" else sys.maxsize
    return {"kv_connector": name, "kv_connector_config": config,
            "layerwise_min_tokens": threshold}


def run_instance(args: argparse.Namespace) -> int:
    """Run one instance (``--role prefill|decode|colocated``) until SIGINT/SIGTERM.

    Raises
    ------
    StartupError
        A start-up failure (device, ``--host``, model, memory budget, no answer from the router
        within ``--register-timeout-s``, refused registration), or a later refusal by the router.
    """
    check_device(args.device)
    check_backend(args.backend, args.device)
    if args.role == "decode":
        check_host(args.host)  # D's data socket binds a free port there
    from kvflow.segments import SegmentSpaceError

    from .colocated import ColocatedInstance
    from .decode import DecodeInstance
    from .instance import InstanceConfig
    from .prefill import PrefillInstance

    parent = os.environ.get("KVFLOW_PARENT_PID")
    cfg = InstanceConfig(role=args.role, router_addr=args.router_url, model=args.model,
                         device=args.device, dtype=args.dtype, block_size=args.block_size,
                         max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         memory_budget_mb=args.memory_budget_mb,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         **connector_fields(args),
                         backend=args.backend, host=args.host,
                         enable_prefix_caching=args.enable_prefix_caching,
                         kv_lease_s=args.kv_lease_s, receive_timeout_s=args.receive_timeout_s,
                         parent_pid=int(parent) if parent else None)
    cls = {"prefill": PrefillInstance, "decode": DecodeInstance, "colocated": ColocatedInstance}[args.role]
    inst = cls(cfg)
    try:
        with one_line_errors(f"the {args.role} instance could not start"):
            try:
                inst.startup()
            except SegmentSpaceError as exc:  # /dev/shm too small: the sizes and the flags
                raise StartupError(exc.strerror) from None
            inst.wait_registered(args.register_timeout_s)
        inst.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        inst.close()
    if inst.fatal:
        raise StartupError(inst.fatal)
    return 0


def _controller(args: argparse.Namespace, metrics, children, tokenizer):
    """The control plane, bound to ``--host``:``--control-port``; it refuses instances whose
    tokenizer is not ``tokenizer`` (the router's)."""
    import zmq

    from .control import Controller
    from .startup import bind_error
    try:
        return Controller(args.host, args.control_port, mode=args.mode, metrics=metrics,
                          proc_alive=children.alive if children else None,
                          dead_after_s=args.dead_after_s, model=args.model,
                          tokenizer=tokenizer.digest)
    except zmq.ZMQError as exc:
        raise bind_error("--control-port", args.control_port, args.host, args.control_port,
                         exc.errno, zmq.strerror(exc.errno)) from None


async def _serve(args: argparse.Namespace, http_sock, children) -> int:
    import uvicorn

    from kvflow.segments import clean_stale as clean_stale_segments

    from .metrics import Metrics
    from .procs import instance_env, watch_children
    from .startup import watch_output
    from .router import Router, create_app, load_tokenizer

    metrics = Metrics()
    ctl = None
    try:
        with one_line_errors("the router could not start"):
            try:
                tokenizer = load_tokenizer(args.model)
            except (OSError, ValueError) as exc:
                raise StartupError(f"--model {args.model}: cannot load its tokenizer: {exc}") from None
            ctl = _controller(args, metrics, children, tokenizer)
            ctl.start()
            if children is not None:
                iargs = _instance_args(args, ctl.addr)
                roles = ("colocated",) if args.mode == "colocated" else ("prefill", "decode")
                for role in roles:
                    children.spawn(role, iargs, env=instance_env(role, args.device, args.prefill_device,
                                                                 args.decode_device))
        router = Router(ctl, tokenizer, args.model, metrics,
                        admit_timeout_s=args.admit_timeout_s, api_key=args.api_key)
        server = uvicorn.Server(uvicorn.Config(create_app(router), log_level=args.log_level,
                                               access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=3))
        host, port = http_sock.getsockname()[:2]
        pids = ", ".join(f"{p.args[4]} pid {pid}" for pid, p in children.procs.items()) if children else "none"
        closed: list[str] = []
        if not say(f"kvflow.serve: router listening on http://{host}:{port} (mode {args.mode}, "
                   f"transfer {args.transfer}, model {args.model}; control {ctl.addr}; "
                   f"instances: {pids}). Ctrl-C stops."):
            closed.append("stdout")
            server.should_exit = True
        failed: list[str] = []
        watchers = [asyncio.ensure_future(watch_output(server, closed))]
        if children is not None:
            watchers.append(asyncio.ensure_future(watch_children(children, ctl, server, failed)))
        try:
            await server.serve(sockets=[http_sock])
        finally:
            for w in watchers:
                w.cancel()
        if closed and not failed:
            say(f"kvflow.serve: stopping: the reader of {closed[0]} has gone (a closed pipe)",
                sys.stderr)
        return 1 if failed or closed else 0
    finally:
        if children is not None:
            children.stop_all()
        # every kind of segment whose owner is gone (the children's, also those of one killed
        # earlier); an instance started on its own keeps its segments while it runs
        clean_stale_segments()
        if ctl is not None:
            await ctl.close()


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status (1 and one line on stderr for a start-up failure)."""
    try:
        return _main(argv)
    except StartupError as exc:
        say(str(exc), sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) before serving began: no traceback
        say("kvflow.serve: stopped (interrupted while starting)", sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = check_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role in ("prefill", "decode", "colocated"):
        return run_instance(args)

    from kvflow.segments import clean_stale as clean_stale_segments

    from .procs import Children, bind_http_socket

    if args.role == "all":
        gpus = {"--prefill-device": args.prefill_device}
        if args.mode == "disagg":
            gpus["--decode-device"] = args.decode_device
        check_device(args.device, gpus)
    clean_stale_segments()
    http_sock = bind_http_socket(args.host, args.port)
    children = Children() if args.role == "all" else None

    def _term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    code = 0
    try:
        code = asyncio.run(_serve(args, http_sock, children))
    except KeyboardInterrupt:
        pass
    finally:
        if children is not None:
            children.stop_all()
    say("kvflow.serve: stopped" if code == 0 else f"kvflow.serve: stopped (exit code {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
