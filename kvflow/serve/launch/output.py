"""What ``python -m kvflow.serve`` prints (:func:`say`), and stopping the server when the reader
of its stdout or stderr goes away (``... | head -3``, :func:`watch_output`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import stat
import sys


def say(line: str, stream=None) -> bool:
    """Print ``line`` to ``stream`` (default stdout) and flush; False when the stream's reader
    has gone (a closed pipe), which the caller treats as a request to stop."""
    stream = sys.stdout if stream is None else stream
    try:
        print(line, file=stream, flush=True)
        return True
    except (BrokenPipeError, ValueError, OSError):
        silence(stream)
        return False


def silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null: later writes neither fail nor warn."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def output_closed(fds: tuple[int, ...] = (1, 2)) -> int | None:
    """The first of ``fds`` that is a pipe or socket whose reader has gone, else None."""
    poller = select.poll()
    watched = []
    for fd in fds:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            poller.register(fd, 0)  # errors and hang-ups are always reported
            watched.append(fd)
    if not watched:
        return None
    for fd, events in poller.poll(0):
        if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            return fd
    return None


def _stream_fds() -> tuple[int, ...]:
    """Of fds 1 and 2, those that are sys.stdout / sys.stderr (not a reused number)."""
    out = []
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if stream is not None and stream.fileno() == fd:
                out.append(fd)
    return tuple(out)


async def watch_output(server, closed: list[str]) -> None:
    """Stop the server when the reader of its stdout or stderr has gone (checked every 0.2 s);
    ``closed`` gets "stdout" or "stderr"."""
    fds = _stream_fds()
    while fds and not server.should_exit:
        await asyncio.sleep(0.2)
        fd = output_closed(fds)
        if fd is not None:
            closed.append("stdout" if fd == 1 else "stderr")
            silence(sys.stdout if fd == 1 else sys.stderr)
            server.should_exit = True
