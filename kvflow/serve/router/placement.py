"""Which P and D serve the next request (:func:`pick_pair`: the D with most free blocks, then
fewest requests here; of its P's the one with fewest prefills; ties rotate), and what the
router keeps of each instance and request in flight."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any, Callable, Iterable

from kvflow.serve.protocol import Register


@dataclasses.dataclass
class InstanceInfo:
    """What the router knows of one registered instance."""
    reg: Register
    ident: bytes
    last_seen: float
    free_blocks: int
    num_running: int = 0
    heartbeat_at: float = 0.0  # router's monotonic clock; free_blocks/num_running date from it
    seq: int = 0  # of the newest heartbeat whose counts were kept
    liveness: str = "ok"  # or "late" (kvflow.serve.router.liveness)
    pair_ok: set = dataclasses.field(default_factory=set)

    @property
    def id(self) -> str:
        return self.reg.instance_id

    @property
    def role(self) -> str:
        return self.reg.role


def _least(infos, key: Callable[[InstanceInfo], Any], turn: int) -> InstanceInfo:
    """The instance of least ``key``; among equals (ordered by id), number ``turn`` modulo."""
    infos = sorted(infos, key=lambda i: i.id)
    best = min(key(i) for i in infos)
    tied = [i for i in infos if key(i) == best]
    return tied[turn % len(tied)]


@dataclasses.dataclass
class ReqState:
    """A request in flight at the router."""
    queue: asyncio.Queue
    prefill_id: str = ""
    decode_id: str = ""
    stage: str = "allocating"  # -> prefilling -> transferring (P still needed) -> decoding


def pick_pair(instances: Iterable[InstanceInfo], requests: Iterable[ReqState], mode: str,
              turn: int) -> tuple[InstanceInfo, InstanceInfo] | None:
    """(prefill, decode) for the next request (one instance twice when colocated), or None;
    ``turn`` counts the calls (round robin)."""
    instances = list(instances)
    if mode == "colocated":
        cs = sorted((i for i in instances if i.role == "colocated"), key=lambda i: -i.free_blocks)
        return (cs[0], cs[0]) if cs else None
    ps = [i for i in instances if i.role == "prefill"]
    pairs = [(p, d) for p in ps for d in instances
             if d.role == "decode" and d.id in p.pair_ok and p.id in d.pair_ok]
    if not pairs:
        return None
    busy_d, busy_p = collections.Counter(), collections.Counter()
    for st in requests:
        busy_d[st.decode_id] += 1
        busy_p[st.prefill_id] += st.stage == "prefilling"
    ds = {d.id: d for _, d in pairs}
    d = _least(ds.values(), lambda d: (-d.free_blocks, busy_d[d.id]), turn)
    # P's turn advances once per round over the D's: every (P, D) combination comes up
    p = _least([p for p, dd in pairs if dd is d], lambda p: busy_p[p.id], turn // len(ds))
    return p, d
