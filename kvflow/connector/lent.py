"""D's blocks that a P may still write (kinds whose P writes D's cache: ipc-push), and the
liveness of D's paired P's: a request that ends on D before its P's ``KVPushed`` leaves its
blocks *lent* until that ``KVPushed``, until P's process is gone (its pid on D's host,
:mod:`kvflow.segments`, or the router saw it exit), or, for a P that D cannot judge,
``kv_lease_s`` after the router declared it dead. See docs/reliability.md, "Failure kinds and
policies".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvflow.segments import DEAD, UNKNOWN, process_state

log = logging.getLogger("kvflow.connector.lent")


@dataclasses.dataclass
class Lent:
    """Blocks of an ended request that a P may still write; ``prefill_id`` is "" until the
    router's Abort names it; ``dead_at`` (monotonic) when the router declared that P dead,
    ``exited`` when it saw the process exit."""
    blocks: list[int]
    prefill_id: str = ""
    since: float = dataclasses.field(default_factory=time.monotonic)
    warned: bool = False
    dead_at: float = 0.0
    exited: bool = False


class LentBlocks(dict):
    """``req_id -> Lent`` of one D, with the paired P's it judges; lent blocks go back to D's
    ``allocator``, those of an unjudgeable P ``kv_lease_s`` after the router declared it dead."""

    def __init__(self, allocator: Any, kv_lease_s: float) -> None:
        super().__init__()
        self.allocator, self.kv_lease_s = allocator, kv_lease_s
        self.peer_pids: dict[str, int] = {}   # paired P -> its pid (one host: liveness)
        self.peer_hosts: dict[str, str] = {}  # paired P -> its host id (pids comparable if ours)
        self.gone_peers: set[str] = set()     # P's whose process D saw gone

    def meet(self, peer_id: str, pid: int, host: str) -> None:
        """P ``peer_id`` paired with this D (blocks lent to an earlier process of that id that
        is gone are given back first)."""
        self.settle()
        self.gone_peers.discard(peer_id)
        self.peer_pids[peer_id] = pid
        self.peer_hosts[peer_id] = host

    def forget(self, peer_id: str) -> None:
        """P ``peer_id`` can write no more (the router saw it exit, or it was declared dead
        ``kv_lease_s`` ago): give back every block lent to it and renew no lease with it."""
        self.peer_pids.pop(peer_id, None)
        self.peer_hosts.pop(peer_id, None)
        self.gone_peers.add(peer_id)
        self.settle()

    def lend(self, req_id: str, blocks: list[int]) -> None:
        self[req_id] = Lent(list(blocks))

    def give_back(self, req_ids: list[str]) -> None:
        """Free the lent blocks of ``req_ids`` (their writer is done or gone)."""
        for r in req_ids:
            entry = self.pop(r, None)
            if entry is not None:
                self.allocator.free(entry.blocks)

    def aborted(self, req_id: str, prefill_id: str, peer_dead: str, peer_exited: bool) -> None:
        """The router's Abort of a lent request: who writes it, and whether it is dead."""
        entry = self.get(req_id)
        if entry is None:
            return
        entry.prefill_id = prefill_id or entry.prefill_id
        if peer_dead and peer_dead == entry.prefill_id:
            entry.dead_at = entry.dead_at or time.monotonic()
            entry.exited = entry.exited or peer_exited
        self.settle()

    def settle(self) -> None:
        """Give back lent blocks whose writer can write no more: its process is gone, or D
        cannot judge it and ``kv_lease_s`` has passed since the router declared it dead."""
        now = time.monotonic()
        done = []
        for req_id, e in self.items():
            p = e.prefill_id
            state = DEAD if e.exited or p in self.gone_peers else \
                process_state(self.peer_pids.get(p, 0), self.peer_hosts.get(p, ""))
            if state == DEAD or (state == UNKNOWN and e.dead_at
                                 and now - e.dead_at >= self.kv_lease_s):
                done.append(req_id)
        self.give_back(done)

    def gone(self) -> list[tuple[str, int]]:
        """Forget the paired P's whose process is gone (judged on this host only) and return
        them as ``(peer_id, pid)``; then give back the blocks lent to them."""
        out = []
        for peer, pid in list(self.peer_pids.items()):
            if process_state(pid, self.peer_hosts.get(peer, "")) == DEAD:
                del self.peer_pids[peer]
                self.gone_peers.add(peer)
                out.append((peer, pid))
        self.settle()
        return out

    def warn_overdue(self, instance_id: str, timeout_s: float) -> None:
        """Log once per request lent longer than ``timeout_s`` (its blocks stay held)."""
        now = time.monotonic()
        for req_id, entry in self.items():
            if not entry.warned and now - entry.since > timeout_s:
                entry.warned = True
                log.warning("%s: ended request %s still waits for KVPushed from %s after %g s; "
                            "its blocks stay held", instance_id, req_id,
                            entry.prefill_id or "its prefill instance", timeout_s)
