"""``python -m kvflow.serve``: a prefill/decode-disaggregated LLM server.

With no arguments: the router on http://127.0.0.1:8000 and one prefill (P) and one decode (D)
instance of the built-in ``kvflow-tiny`` model as child processes, KV moved by the ``auto``
connector (``ipc-pull`` over shared memory on CPU); serves until Ctrl-C (SIGINT) or SIGTERM,
then stops every child and removes every shared-memory segment. ``--role`` starts one component
(for several hosts): the router prints its control address, which ``--router-url`` of each
instance names. A start-up failure is one line on stderr naming the flag or value and a fix,
exit status 1; interrupted while starting, 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import signal
import sys

from .launch.startup import record_interrupt

if __name__ == "__main__":  # before the other imports: a Ctrl-C meanwhile is only recorded
    signal.signal(signal.SIGINT, record_interrupt)
    if "--config-json" not in sys.argv[1:]:
        signal.signal(signal.SIGTERM, record_interrupt)

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

from .launch.checks import parse_config  # noqa: E402
from .launch.config import ServeConfig  # noqa: E402
from .launch.config import build_parser as _build_parser  # noqa: E402
from .launch.output import say  # noqa: E402
from .launch.startup import (StartupError, Terminated, arm_interrupts, check_backend,  # noqa: E402
                      check_device, check_host, check_interrupted, interrupted_by,
                      one_line_errors)

log = logging.getLogger("kvflow.serve")


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    """The checked config of the flags; a bad flag prints one line (the flag, its value, a fix)
    to stderr and exits 1."""
    try:
        return check_args(argv)
    except StartupError as exc:
        say(str(exc), sys.stderr)
        raise SystemExit(1) from None


def check_args(argv: list[str] | None = None) -> ServeConfig:
    """:func:`parse_args` that raises :class:`StartupError` instead of printing."""
    return parse_config(argv, __doc__)


def build_parser():
    """The argparse parser, generated from :class:`~kvflow.serve.launch.config.ServeConfig`."""
    return _build_parser(__doc__)


def run_instance(cfg: ServeConfig) -> int:
    """Run one instance (``--role prefill|decode|colocated``) until SIGINT/SIGTERM. Raises
    :class:`StartupError` on a start-up failure or a refusal by the router."""
    check_device(cfg.device)
    check_backend(cfg.backend, cfg.device)
    if cfg.role == "decode":
        check_host(cfg.host)  # D's data socket binds a free port there
    from kvflow.segments import SegmentSpaceError, unlink_own
    from .instance.colocated import ColocatedInstance
    from .instance.decode import DecodeInstance
    from .instance.prefill import PrefillInstance
    cls = {"prefill": PrefillInstance, "decode": DecodeInstance, "colocated": ColocatedInstance}[cfg.role]
    inst = cls(cfg)
    try:  # an interrupt while starting reaches main(): exit 130/143, not 0
        with one_line_errors(f"the {cfg.role} instance could not start"):
            try:
                inst.startup()
            except SegmentSpaceError as exc:  # /dev/shm too small: the sizes and the flags
                raise StartupError(exc.strerror) from None
            inst.wait_registered(cfg.register_timeout_s)
        with contextlib.suppress(KeyboardInterrupt):
            inst.serve_forever()
    finally:
        inst.close()
        unlink_own()  # whatever close left: the process leaves by os._exit (no finalizers)
    if inst.fatal:
        raise StartupError(inst.fatal)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status: 1 (one line on stderr) for a start-up failure, 130
    (SIGINT) or 143 (SIGTERM) when interrupted before serving began."""
    # a child instance is stopped by its parent's SIGTERM: at once, silently (the parent reports)
    child = "--config-json" in (sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, record_interrupt)  # raised once the imports are done
    if not child:
        signal.signal(signal.SIGTERM, record_interrupt)
    try:
        return _main(argv, child)
    except KeyboardInterrupt as exc:  # before serving began: one line, no traceback
        return _stopped_while_starting(signal.SIGTERM if isinstance(exc, Terminated)
                                       else signal.SIGINT, child)
    except StartupError as exc:
        if interrupted_by() is not None:  # the failure came from the interrupt
            return _stopped_while_starting(interrupted_by(), child)
        say(str(exc), sys.stderr)
        return 1
    except Exception:
        if interrupted_by() is None:
            raise
        # an interrupt inside an import can break the next import of that module: the cause
        return _stopped_while_starting(interrupted_by(), child)


def _stopped_while_starting(signum: int, child: bool) -> int:
    """One line (not for a child: its parent reports), exit status 143 (SIGTERM) or 130."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut it short
        signal.signal(sig, signal.SIG_IGN)
    if not child:
        say("kvflow.serve: stopped (interrupted while starting)", sys.stderr)
    return 143 if signum == signal.SIGTERM else 130


def _preload(cfg: ServeConfig) -> None:
    """Import what this process will run while an interrupt is only recorded."""
    import importlib
    names = (("instance.colocated", "instance.decode", "instance.prefill")
             if cfg.role in ("prefill", "decode", "colocated")
             else ("router.app", "router.router", "launch.server"))
    for name in names:
        importlib.import_module(f"kvflow.serve.{name}")


def _main(argv: list[str] | None, child: bool = False) -> int:
    cfg = check_args(argv)  # no torch yet: a bad flag is refused before the heavy imports
    _preload(cfg)
    arm_interrupts(sigterm=not child)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.role in ("prefill", "decode", "colocated"):
        return run_instance(cfg)
    from kvflow.segments import clean_stale
    from .launch.procs import Children, bind_http_socket
    from .launch.server import serve_router
    if cfg.role == "all":
        gpus = {"--prefill-device": cfg.prefill_device}
        if cfg.mode == "disagg":
            gpus["--decode-device"] = cfg.decode_device
        check_device(cfg.device, gpus)
    clean_stale()
    http_sock = bind_http_socket(cfg.host, cfg.port)
    children = Children() if cfg.role == "all" else None
    serving: list[bool] = []  # set once the router listens: an interrupt then is a normal stop
    code = 0
    check_interrupted()
    try:
        code = asyncio.run(serve_router(cfg, http_sock, children, serving))
    except KeyboardInterrupt:
        if not serving:
            raise
    finally:
        if children is not None:
            children.stop_all()
    say("kvflow.serve: stopped" if code == 0 else f"kvflow.serve: stopped (exit code {code})")
    return code


if __name__ == "__main__":
    status = main()
    # everything is closed: leave without interpreter finalization (seconds under load;
    # docs/reliability.md, "Stop")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (closed pipe)
            stream.flush()
    os._exit(status)
