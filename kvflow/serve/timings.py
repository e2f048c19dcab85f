"""Per-hop timing of one served request on one clock (:func:`time.monotonic`, system-wide per
host): ``timings_ms``, ``hops_ms`` (docs/tutorials/quickstart.md, "4. Read the `kvflow` fields")."""

from __future__ import annotations

import time
from typing import Any

#: Milestones in order, first-token path then second-token path (stamped by R router, P, D, C)
MILESTONES = (
    "allocate_sent",          # R: Allocate sent to D (after tokenizing and picking P, D)
    "allocated",              # R: D's Allocated taken from the router's queue
    "prefill_sent",           # R: Prefill sent to P
    "prefill_received",       # P/C: Prefill handled (queued behind other prefills)
    "prefill_started",        # P/C: its prefill begins
    "first_token_sampled",    # P/C: the first token sampled (the prefill's end)
    "first_token_at_router",  # R: P's Tokens taken from the router's queue
    "first_token_out",        # R: the first token handed to the HTTP response (TTFT)
    "kv_done",                # D: every KV block of the prompt in D's cache
    "second_token_emitted",   # D/C: the second token sent (D's first decode step)
    "second_token_at_router",  # R
    "second_token_out",       # R: the second token handed to the HTTP response (TTST)
)

#: hop name -> (from milestone, to milestone); "" is the request's arrival at the router.
HOPS = {
    "router_in": ("", "allocate_sent"),
    "d_allocate": ("allocate_sent", "allocated"),
    "to_p": ("allocated", "prefill_received"),
    "p_queue": ("prefill_received", "prefill_started"),
    "p_prefill": ("prefill_started", "first_token_sampled"),
    "first_token_to_router": ("first_token_sampled", "first_token_at_router"),
    "router_out": ("first_token_at_router", "first_token_out"),
    "ttft": ("", "first_token_out"),
    "kv_after_first_token": ("first_token_sampled", "kv_done"),
    "d_second_token": ("kv_done", "second_token_emitted"),
    "second_token_to_router": ("second_token_emitted", "second_token_at_router"),
    "second_router_out": ("second_token_at_router", "second_token_out"),
    "ttst": ("", "second_token_out"),
}


def stamp(kvflow: dict[str, Any], name: str, t: float | None = None) -> None:
    """Record milestone ``name`` (now, or ``t``: ``time.monotonic()`` seconds) in the
    ``clock`` of an instance's ``kvflow`` dict (the first stamp of a name wins)."""
    _check(name)
    kvflow.setdefault("clock", {}).setdefault(name, time.monotonic() if t is None else t)


def _check(name: str) -> None:
    if name not in MILESTONES:
        raise ValueError(f"name must be one of {', '.join(MILESTONES)}; got {name!r}")


class RequestClock:
    """The router's record of one request received at ``t_received`` (``time.monotonic()`` s):
    its own stamps, the instances' stamps and the other ``kvflow`` fields of their messages."""

    def __init__(self, t_received: float) -> None:
        self.t0 = t_received
        self.stamps: dict[str, float] = {}
        self.kvflow: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        """Stamp router milestone ``name`` now (the first stamp wins)."""
        _check(name)
        self.stamps.setdefault(name, time.monotonic())

    def merge(self, kvflow: dict[str, Any]) -> None:
        """Take an instance's ``kvflow`` fields (later ones win) and its ``clock`` stamps
        (unknown names ignored)."""
        for name, t in (kvflow.get("clock") or {}).items():
            if name in MILESTONES and isinstance(t, (int, float)):
                self.stamps.setdefault(name, float(t))
        self.kvflow.update((k, v) for k, v in kvflow.items() if k != "clock")

    def timings_ms(self) -> dict[str, float]:
        """Milestone -> ms since the request was received, in :data:`MILESTONES` order."""
        return {m: round((self.stamps[m] - self.t0) * 1e3, 3) for m in MILESTONES
                if m in self.stamps}

    def hops_ms(self) -> dict[str, float]:
        """Hop -> duration (ms) for every hop of :data:`HOPS` whose ends were stamped."""
        at = dict(self.stamps, **{"": self.t0})
        return {h: round((at[b] - at[a]) * 1e3, 3) for h, (a, b) in HOPS.items()
                if a in at and b in at}

    def report(self) -> dict[str, Any]:
        """The response's ``kvflow`` object: the instances' fields, ``timings_ms``, ``hops_ms``."""
        return {**self.kvflow, "timings_ms": self.timings_ms(), "hops_ms": self.hops_ms()}
