"""Rows saved as they are measured, and a clean stop on the first SIGINT or SIGTERM.

``python -m kvflow.bench`` runs every study inside :func:`run_study`. A study asks :func:`rows`
for its row list once it knows its env (device, date: the result file's name); each row appended
to it is at once one line of ``<result>.partial.jsonl`` (first line: schema, env, command) and
one progress line on stderr. :func:`kvflow.bench.cli.finish` writes the result file
(``<result>.json``, ``"complete": true``) and removes the ``.partial.jsonl``.

The first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread (at its next Python
bytecode: within a case, not after it); :func:`run_study` then writes the result file with the
rows so far, marked ``"complete": false, "interrupted": "SIGINT"`` (or ``"SIGTERM"``), prints
one line naming the file and the row count, and returns 130 (SIGINT) or 143 (SIGTERM). If the
main thread sits in a native call (a numba or LLVM compile, a large torch op) and has not taken
the signal after :data:`GRACE_S` seconds, or the study has not stopped :data:`STOP_LIMIT_S`
seconds after it, a watchdog thread (woken by the signal through :func:`signal.set_wakeup_fd`)
writes the same file and line and ends the process with that code; a second signal does so at
once; before it ends the process it runs the clean-ups registered with :func:`on_exit` (a
study's servers: stopped, their segments unlinked). Where the raise is swallowed (inside a
``__del__`` or a library callback), the next row appended raises it again: the study stops
between cases at the latest. A killed run (SIGKILL) leaves its ``.partial.jsonl``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from .sink import RowSink, describe, partial_path, say  # noqa: F401 - re-exported

#: Seconds the main thread has to take a signal before the watchdog writes the rows and exits.
GRACE_S = 5.0
#: Seconds a study has, after the first signal, to stop (its clean-up included) before the
#: watchdog writes the rows and exits.
STOP_LIMIT_S = 30.0
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """The study was stopped by a signal (a BaseException: a study's ``except Exception`` around
    one case does not swallow it). ``signame``: "SIGINT" or "SIGTERM"."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


class _Run:
    """The study being run by :func:`run_study`: its args, sink and signal state."""

    def __init__(self, args) -> None:
        self.args, self.sink, self.signame = args, None, None
        self.taken = threading.Event()  # the main thread's handler ran
        self.stopped = threading.Event()  # run_study is returning
        self.exiting = threading.Lock()

    def check(self) -> None:
        """Raise :class:`Interrupted` once a signal came (its first raise may have been
        swallowed, e.g. inside a ``__del__`` or a library's callback)."""
        if self.signame is not None and not self.stopped.is_set():
            raise Interrupted(self.signame)

    def result_env(self) -> dict[str, Any]:
        return dict(self.sink.header, wall_s=time.perf_counter() - self.sink.t0)

    def stop_line(self) -> str:
        study = self.args.study
        if self.sink is None or not self.sink.done:
            return f"{study}: interrupted by {self.signame} before the first row; no result file"
        if self.sink.interrupted is None:
            return (f"{study}: interrupted by {self.signame} after its result file was written: "
                    f"{len(self.sink)} rows in {self.sink.path}")
        return (f"{study}: interrupted by {self.signame}: {len(self.sink)} rows in "
                f"{self.sink.path} (marked interrupted)")

    def write_partial(self) -> str:
        if self.sink is not None and len(self.sink):
            self.sink.write(self.result_env(), interrupted=self.signame)
        return self.stop_line()

    def exit_now(self) -> None:
        """From the watchdog or a second signal: write, say, end the process (once: a second
        caller returns)."""
        if not self.exiting.acquire(blocking=False):
            return
        try:
            say(self.write_partial())
        finally:
            _run_exit_cleanups()
            sys.stderr.flush()
            os._exit(EXIT_CODES[signal.Signals[self.signame]])


_ACTIVE: _Run | None = None
_CLEANUPS: list = []


@contextlib.contextmanager
def on_exit(fn):
    """While inside, ``fn()`` runs if the study is ended at once (by the watchdog or a second
    signal, which leave by ``os._exit`` and so skip every ``finally``); e.g. a server it started
    is stopped. ``fn`` should bound its own time. The normal way out (the first signal raises
    :class:`Interrupted`) runs the study's own ``finally`` clauses instead."""
    _CLEANUPS.append(fn)
    try:
        yield fn
    finally:
        run = _ACTIVE
        if run is None or not run.exiting.locked():  # else the watchdog is about to run it
            with contextlib.suppress(ValueError):
                _CLEANUPS.remove(fn)


def _run_exit_cleanups() -> None:
    for fn in reversed(list(_CLEANUPS)):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the process ends next; say it, run the rest
            say(f"clean-up {getattr(fn, '__name__', fn)} failed: {type(exc).__name__}: {exc}")


def rows(env: dict[str, Any], opts: dict[str, Any] | None = None) -> list:
    """The row list of the running study: a :class:`RowSink` under :func:`run_study` (the same
    one on a second call), else a plain list (a study function called from Python)."""
    from .schema import command_line, measured_options, result_path
    run = _ACTIVE
    if run is None:
        return []
    if run.sink is None:
        a = run.args
        header = dict(env, command=command_line(getattr(a, "_argv", None)), kind=a.study,
                      options=measured_options(opts if opts is not None else
                                               {k: v for k, v in vars(a).items()
                                                if not k.startswith("_")}))
        run.sink = RowSink(result_path(a.out_dir, a.name or a.study, env), header, a.study,
                           quiet=bool(getattr(a, "no_progress", False)), check=run.check)
    return run.sink


def sink_of(rows_: list) -> RowSink | None:
    """``rows_`` if it is the running study's sink."""
    return rows_ if isinstance(rows_, RowSink) else None


def _watchdog(run: _Run, rsock: socket.socket) -> None:
    """Woken by each signal (the wakeup fd): end the process when the main thread has not taken
    the first signal within GRACE_S, or the study has not stopped within STOP_LIMIT_S, or at a
    second signal."""
    seen, deadline = 0, None
    grace_end = hard_end = 0.0
    while True:
        try:
            rsock.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            data = rsock.recv(64)
        except TimeoutError:
            if run.stopped.is_set():
                return
            if not run.taken.is_set() or time.monotonic() >= hard_end:
                run.exit_now()
                return
            deadline = hard_end
            continue
        except OSError:
            return
        if not data:
            return
        for byte in data:
            if byte in (signal.SIGINT, signal.SIGTERM):
                seen += 1
                run.signame = run.signame or signal.Signals(byte).name
        if seen > 1:
            run.exit_now()
            return
        if seen and deadline is None:
            now = time.monotonic()
            grace_end, hard_end = now + GRACE_S, now + STOP_LIMIT_S
            deadline = grace_end


@contextlib.contextmanager
def _handlers(run: _Run):
    def handler(signum, frame):
        if run.signame is not None and run.taken.is_set():
            run.exit_now()  # a second signal
        run.signame = signal.Signals(signum).name
        run.taken.set()
        raise Interrupted(run.signame)

    old = {s: signal.signal(s, handler) for s in EXIT_CODES}
    rsock, wsock = socket.socketpair()
    wsock.setblocking(False)
    old_fd = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watchdog, args=(run, rsock), daemon=True,
                     name="kvflow-bench-watchdog").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for s, h in old.items():
            signal.signal(s, h)
        wsock.close()
        with contextlib.suppress(OSError):
            rsock.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv: it returns
        rsock.close()


def exit_fast(code: int) -> None:
    """End the process now with ``code``: the atexit functions (and so pending
    ``weakref.finalize`` clean-ups, e.g. shared-memory segments) run, the interpreter's
    module teardown does not (at load 10 on 2 cores it took ~30 s after a kernels study)."""
    import atexit
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _await_exit_now(run: _Run) -> None:
    """If the watchdog (a second signal) is already ending the process, let it: it says the
    line and runs the :func:`on_exit` clean-ups (a server's stop) before ``os._exit``."""
    deadline = time.monotonic() + STOP_LIMIT_S
    while run.exiting.locked() and time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except Interrupted:
            pass


def run_study(args, fn) -> int:
    """Run ``fn(args)`` (a study's ``run``) with its rows saved as measured; on the first SIGINT
    or SIGTERM write the rows so far, say where, and return 130 or 143 (see the module doc).
    Signal handlers are installed only in the main thread."""
    global _ACTIVE
    from . import load
    load.start()
    run = _ACTIVE = _Run(args)
    try:
        with (_handlers(run) if threading.current_thread() is threading.main_thread()
              else contextlib.nullcontext()):
            try:
                return int(fn(args) or 0)
            except Interrupted as exc:
                run.signame = exc.signame
                _await_exit_now(run)
                say(run.write_partial())
                return EXIT_CODES[signal.Signals[exc.signame]]
            finally:
                run.stopped.set()
    finally:
        _ACTIVE = None
