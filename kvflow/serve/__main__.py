"""``python -m kvflow.serve``: a prefill/decode-disaggregated LLM server.

With no arguments: the router on http://127.0.0.1:8000, one prefill (P) and one decode (D)
instance of the built-in ``kvflow-tiny`` model as child processes, KV moved over ``ipc``
(shared memory); serves until Ctrl-C (SIGINT) or SIGTERM, then stops every child and removes
every shared-memory segment. ``--role`` starts a single component (for several hosts): the
router prints its control address, which ``--router-url`` of each instance names.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

DESCRIPTION = __doc__.split("\n\n")[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvflow.serve", description=__doc__,
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
    a("--device", default="cpu", help="torch device of the model and caches (default cpu); "
      "with cuda and --role all each instance gets its own GPU (see --prefill-device)")
    a("--prefill-device", type=int, default=0, help="with --device cuda: GPU (this process's "
      "ordinal) of the prefill or colocated instance (default 0)")
    a("--decode-device", type=int, default=1, help="with --device cuda: GPU of the decode "
      "instance (default 1); P and D each also see the other's GPU, to open its cache by "
      "CUDA IPC")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
      help="model weights and KV cache dtype (default float32)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    a("--max-model-len", type=int, default=None,
      help="longest prompt + generated tokens of one request (default min(model limit, 2048))")
    a("--max-num-batched-tokens", type=int, default=512,
      help="tokens per prefill forward (chunked prefill) and the profile run's batch (default 512)")
    a("--num-blocks", type=int, default=None,
      help="KV blocks per instance; default: sized by a profile run from --memory-budget-mb")
    a("--memory-budget-mb", type=int, default=512,
      help="MiB per instance for weights + activations + KV cache, for the profile run (default 512)")
    a("--backend", default="auto", help="kvflow.kernels backend for block movement (default auto)")
    a("--role", choices=("all", "router", "prefill", "decode", "colocated"), default="all",
      help="all: router + instances as child processes (default); router: the router only; "
           "prefill/decode/colocated: one instance that registers with --router-url")
    a("--router-url", default=None, help="the router's control address tcp://HOST:PORT "
      "(printed by --role router); needed by --role prefill/decode/colocated")
    a("--control-port", type=int, default=0,
      help="port of the router's ZMQ control socket (default 0: a free port)")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.layerwise_min_tokens is not None and args.layerwise_min_tokens < 0:
        parser.error(f"--layerwise-min-tokens must be >= 0, got {args.layerwise_min_tokens}")
    if args.transfer != "ipc" and args.ipc_direction != "auto":
        parser.error(f"--ipc-direction {args.ipc_direction} needs --transfer ipc "
                     f"(got --transfer {args.transfer})")
    for flag in ("layerwise_max_ctas", "layers_per_copy"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for name in ("kv_lease_s", "receive_timeout_s", "admit_timeout_s", "dead_after_s"):
        v = getattr(args, name)
        if not 0 < v < 1e6:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    if args.api_key is None:
        args.api_key = os.environ.get("KVFLOW_API_KEY") or None
    for name in ("prefill_device", "decode_device"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be a GPU ordinal >= 0, got {getattr(args, name)}")
    for name in ("port", "block_size", "max_model_len", "num_blocks", "memory_budget_mb",
                 "max_num_batched_tokens"):
        v = getattr(args, name)
        if name == "port" and not 0 < v < 65536:
            parser.error(f"--port must be a port in 1..65535, got {v}")
        if name != "port" and v is not None and v <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {v}")
    if not 0 <= args.control_port < 65536:
        parser.error(f"--control-port must be a port in 0..65535 (0: a free one), got {args.control_port}")
    limit = _model_max_len(args.model)
    if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
        parser.error(f"--max-model-len {args.max_model_len} exceeds the model's "
                     f"max_position_embeddings={limit} ({args.model}); use at most {limit}")
    if args.role in ("prefill", "decode", "colocated") and not args.router_url:
        parser.error(f"--role {args.role} needs --router-url tcp://HOST:PORT (the router's control address)")
    if args.router_url and not args.router_url.startswith("tcp://"):
        parser.error(f"--router-url must look like tcp://HOST:PORT, got {args.router_url!r}")
    return args


def _model_max_len(model: str) -> int | None:
    """``max_position_embeddings`` of a built-in model or a local checkpoint's config.json;
    None when it cannot be read here (the instance reports that error itself)."""
    import json

    from kvflow.model.config import PRESETS
    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings", 2048))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _instance_args(args: argparse.Namespace, router_url: str) -> list[str]:
    out = ["--router-url", router_url, "--model", args.model, "--device", args.device,
           "--dtype", args.dtype,
           "--block-size", str(args.block_size), "--transfer", args.transfer,
           "--transfer-mode", args.transfer_mode, "--ipc-direction", args.ipc_direction,
           "--memory-budget-mb", str(args.memory_budget_mb), "--backend", args.backend,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--host", args.host,
           "--log-level", args.log_level, "--kv-lease-s", str(args.kv_lease_s),
           "--receive-timeout-s", str(args.receive_timeout_s)]
    if args.enable_prefix_caching:
        out.append("--enable-prefix-caching")
    for name in ("max_model_len", "num_blocks", "layerwise_min_tokens", "layerwise_max_ctas",
                 "layers_per_copy"):
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def run_instance(args: argparse.Namespace) -> int:
    from .colocated import ColocatedInstance
    from .decode import DecodeInstance
    from .instance import InstanceConfig
    from .prefill import PrefillInstance

    parent = os.environ.get("KVFLOW_PARENT_PID")
    cfg = InstanceConfig(role=args.role, router_addr=args.router_url, model=args.model,
                         device=args.device, dtype=args.dtype, block_size=args.block_size,
                         max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         memory_budget_mb=args.memory_budget_mb, transfer=args.transfer,
                         transfer_mode=args.transfer_mode, ipc_direction=args.ipc_direction,
                         layerwise_min_tokens=args.layerwise_min_tokens,
                         layerwise_max_ctas=args.layerwise_max_ctas,
                         layers_per_copy=args.layers_per_copy,
                         backend=args.backend, host=args.host,
                         enable_prefix_caching=args.enable_prefix_caching,
                         kv_lease_s=args.kv_lease_s, receive_timeout_s=args.receive_timeout_s,
                         parent_pid=int(parent) if parent else None)
    cls = {"prefill": PrefillInstance, "decode": DecodeInstance, "colocated": ColocatedInstance}[args.role]
    inst = cls(cfg)
    try:
        inst.startup()
        inst.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        inst.close()
    return 0


async def _watch_children(children, ctl, server, failed: list[str]) -> None:
    """With --role all: a child that exits before it registered (e.g. a bad --backend or a
    too small --memory-budget-mb) can never serve, so report it and stop the server."""
    while True:
        await asyncio.sleep(0.2)
        if failed:
            server.should_exit = True
            continue
        for pid, role, code in children.exited():
            # A child that registered and later died is the control plane's business (it frees
            # and reports); only one that never registered means the server cannot start.
            if pid in ctl.registered_pids or ctl.ready():
                continue
            tail = await asyncio.get_running_loop().run_in_executor(None, children.last_stderr, pid)
            last = "\n".join("    " + line for line in tail[-10:]) or "    (nothing on stderr)"
            failed.append(f"kvflow.serve: the {role} instance (pid {pid}) exited with code {code} "
                          f"before registering with the router; its last stderr lines:\n{last}\n"
                          f"kvflow.serve: stopping (fix the error above and start again)")
            ctl.errors.append(f"{role} instance pid {pid} exited with code {code} before registering")
            print(failed[-1], file=sys.stderr, flush=True)
            server.should_exit = True
            break


async def _serve(args: argparse.Namespace, http_sock, children) -> int:
    import uvicorn

    from kvflow.transfer.shm import clean_stale_segments

    from .control import Controller
    from .procs import instance_env
    from .metrics import Metrics
    from .router import Router, create_app, load_tokenizer

    metrics = Metrics()
    ctl = Controller(args.host, args.control_port, mode=args.mode, metrics=metrics,
                     proc_alive=children.alive if children else None,
                     dead_after_s=args.dead_after_s)
    ctl.start()
    try:
        if children is not None:
            iargs = _instance_args(args, ctl.addr)
            roles = ("colocated",) if args.mode == "colocated" else ("prefill", "decode")
            for role in roles:
                children.spawn(role, iargs, env=instance_env(role, args.device, args.prefill_device,
                                                             args.decode_device))
        router = Router(ctl, load_tokenizer(args.model), args.model, metrics,
                        admit_timeout_s=args.admit_timeout_s, api_key=args.api_key)
        server = uvicorn.Server(uvicorn.Config(create_app(router), log_level=args.log_level,
                                               access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=3))
        host, port = http_sock.getsockname()[:2]
        pids = ", ".join(f"{p.args[4]} pid {pid}" for pid, p in children.procs.items()) if children else "none"
        print(f"kvflow.serve: router listening on http://{host}:{port} (mode {args.mode}, "
              f"transfer {args.transfer}, model {args.model}; control {ctl.addr}; "
              f"instances: {pids}). Ctrl-C stops.", flush=True)
        failed: list[str] = []
        watcher = (asyncio.ensure_future(_watch_children(children, ctl, server, failed))
                   if children is not None else None)
        try:
            await server.serve(sockets=[http_sock])
        finally:
            if watcher is not None:
                watcher.cancel()
        return 1 if failed else 0
    finally:
        if children is not None:
            children.stop_all()
        # every kind of segment whose owner is gone (the children's, also those of one killed
        # earlier); an instance started on its own keeps its segments while it runs
        clean_stale_segments()
        await ctl.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role in ("prefill", "decode", "colocated"):
        return run_instance(args)

    from kvflow.transfer.shm import clean_stale_segments

    from .procs import Children, bind_http_socket

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
    print("kvflow.serve: stopped" if code == 0 else f"kvflow.serve: stopped (exit code {code})",
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
