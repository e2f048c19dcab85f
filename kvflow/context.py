"""The forward context: per-forward flags that the transfer and signal paths must obey.

``is_dummy_or_profile_run`` is set for profile, dummy, warm-up and graph-capture forwards.
While it is set, no signal channel may be initialised and nothing may be signalled or sent
(FastDeploy's PD stack hung at start when its profile run wrote signals nobody read).
Every set-up and every send checks :func:`sends_allowed`.

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
    """

    is_dummy_or_profile_run: bool = False


_CTX: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar(
    "kvflow_forward_context", default=ForwardContext())


@contextlib.contextmanager
def forward_context(*, is_dummy_or_profile_run: bool = False) -> Iterator[ForwardContext]:
    """Set the forward context for the duration of a ``with`` block (nests; restores on exit)."""
    ctx = ForwardContext(is_dummy_or_profile_run=bool(is_dummy_or_profile_run))
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


def sends_allowed() -> bool:
    """False while a dummy/profile run is in progress: no channel set-up, no signal, no send."""
    return not _CTX.get().is_dummy_or_profile_run
