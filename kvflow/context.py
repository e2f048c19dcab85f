"""The forward context: per-forward flags that the transfer and signal paths must obey.

``is_dummy_or_profile_run`` is set for profile, dummy, warm-up and graph-capture forwards.
While it is set, no signal channel may be initialised and nothing may be signalled or sent
(FastDeploy's PD stack hung at start when its profile run wrote signals nobody read).
Every set-up and every send checks :func:`get_forward_context` (or :func:`sends_allowed`).

>>> with forward_context(is_dummy_or_profile_run=True):
...     sends_allowed()
False
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Flags of the forward pass in progress.

    Attributes
    ----------
    is_dummy_or_profile_run : bool
        True for profile / dummy / warm-up / graph-capture runs.
    step : int
        Prefill step id of the forward (tags layer signals); -1 outside a real step.
    """

    is_dummy_or_profile_run: bool = False
    step: int = -1


_CTX: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar(
    "kvflow_forward_context", default=ForwardContext())


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress in this thread/task (defaults: a real run)."""
    return _CTX.get()


@contextlib.contextmanager
def forward_context(*, is_dummy_or_profile_run: bool = False, step: int = -1) -> Iterator[ForwardContext]:
    """Set the forward context for the duration of a ``with`` block (nests; restores on exit)."""
    ctx = ForwardContext(is_dummy_or_profile_run=bool(is_dummy_or_profile_run), step=step)
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


def sends_allowed() -> bool:
    """False while a dummy/profile run is in progress: no channel set-up, no signal, no send."""
    return not _CTX.get().is_dummy_or_profile_run
