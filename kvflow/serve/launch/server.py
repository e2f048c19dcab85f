"""The router process of ``python -m kvflow.serve`` (``--role all`` or ``router``): the control
plane, the child instances (``--role all``) and the HTTP server under uvicorn until it stops."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys

from kvflow.connector import resolve_connector

from .config import ServeConfig
from .output import say
from .startup import StartupError, check_interrupted, one_line_errors


def instance_config(cfg: ServeConfig, role: str, router_url: str) -> ServeConfig:
    """The config of child instance ``role``: the parent's, with the role, the router's address,
    this process as parent, no API key, and half the GPU each when P and D share one."""
    from .budget import GPU_DEFAULT_UTILIZATION
    child = dataclasses.replace(cfg, role=role, router_url=router_url, api_key=None,
                                parent_pid=os.getpid())
    if (cfg.device == "cuda" and cfg.mode == "disagg" and cfg.memory_budget_mb is None
            and cfg.num_blocks is None and cfg.prefill_device == cfg.decode_device):
        child.gpu_memory_utilization = (cfg.gpu_memory_utilization or GPU_DEFAULT_UTILIZATION) / 2
    return child


def _controller(cfg: ServeConfig, metrics, children, tokenizer):
    """The control plane, bound to ``--host``:``--control-port``."""
    import zmq
    from ..router.control import Controller
    from .startup import bind_error
    try:
        return Controller(cfg.host, cfg.control_port, mode=cfg.mode, metrics=metrics,
                          proc_alive=children.alive if children else None,
                          dead_after_s=cfg.dead_after_s, hung_after_s=cfg.hung_after_s,
                          model=cfg.model, tokenizer=tokenizer.digest,
                          advertise_host=cfg.advertise_host)
    except zmq.ZMQError as exc:
        raise bind_error("--control-port", cfg.control_port, cfg.host, cfg.control_port,
                         exc.errno, zmq.strerror(exc.errno)) from None


#: seconds a stop waits for the running requests to end (each is answered 503 at once) and
#: their Aborts to be sent, before uvicorn closes the connections
END_REQUESTS_S = 2.0


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handlers (:func:`stop_on_signals` owns them);
        at a stop, ``router`` (when set) ends its requests before uvicorn shuts down."""

        router = None

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        async def shutdown(self, sockets=None):
            if self.router is not None:  # still listening: a new request gets 503 too
                self.router.stop()
                deadline = asyncio.get_running_loop().time() + END_REQUESTS_S
                while (not self.router.ended and not self.force_exit
                       and asyncio.get_running_loop().time() < deadline):
                    await asyncio.sleep(0.01)
            await super().shutdown(sockets=sockets)

    return Server


def stop_on_signals(server, children=None) -> None:
    """From now on the first SIGINT or SIGTERM stops ``server`` gracefully, a second one at once
    (and kills the children); installed whatever the handler was (docs/reliability.md, "Stop")."""
    received: list[int] = []

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if len(received) > 1:
            server.force_exit = True
            if children is not None:
                children.hurry = True
            return
        server.should_exit = True
        with contextlib.suppress(OSError):  # os.write: a print could re-enter an interrupted one
            os.write(2, f"kvflow.serve: stopping ({signal.Signals(signum).name})\n".encode())

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


async def serve_router(cfg: ServeConfig, http_sock, children, serving: list[bool]) -> int:
    """Serve HTTP on ``http_sock`` until stopped; returns the exit status (``serving`` gets True
    when it listens). :class:`StartupError`: tokenizer, control socket or a child cannot start."""
    import uvicorn
    from kvflow.segments import clean_stale
    from ..router.app import create_app
    from ..router.metrics import Metrics
    from .procs import instance_env, watch_children
    from ..router.router import Router, load_tokenizer
    from .output import watch_output
    metrics = Metrics()
    ctl = None
    try:
        with one_line_errors("the router could not start"):
            try:
                tokenizer = load_tokenizer(cfg.model)
            except (OSError, ValueError) as exc:
                raise StartupError(f"--model {cfg.model}: cannot load its tokenizer: {exc}") from None
            ctl = _controller(cfg, metrics, children, tokenizer)
            ctl.start()
            if children is not None:
                roles = ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode")
                for role in roles:
                    children.spawn(role, instance_config(cfg, role, ctl.addr),
                                   env=instance_env(role, cfg.device, cfg.prefill_device,
                                                    cfg.decode_device))
        router = Router(ctl, tokenizer, cfg.model, metrics,
                        admit_timeout_s=cfg.admit_timeout_s, api_key=cfg.api_key)
        server = _uvicorn_server_class()(uvicorn.Config(create_app(router), log_level=cfg.log_level,
                                               access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=3))
        server.router = router
        host, port = http_sock.getsockname()[:2]
        pids = (", ".join(f"{children.roles[pid]} pid {pid}" for pid in children.procs)
                if children else "none")
        kind = "none" if cfg.mode == "colocated" else resolve_connector(cfg.kv_connector, cfg.device)
        closed: list[str] = []
        check_interrupted()
        serving.append(True)
        if not say(f"kvflow.serve: router listening on http://{host}:{port} (mode {cfg.mode}, "
                   f"kv connector {kind}, model {cfg.model}; control {ctl.addr}; "
                   f"instances: {pids}). Ctrl-C stops."):
            closed.append("stdout")
            server.should_exit = True
        failed: list[str] = []
        watchers = [asyncio.ensure_future(watch_output(server, closed))]
        if children is not None:
            watchers.append(asyncio.ensure_future(watch_children(children, ctl, server, failed)))
        stop_on_signals(server, children)
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
        clean_stale()  # every segment whose owner is gone
        if ctl is not None:
            await ctl.close()
