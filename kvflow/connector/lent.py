"""D's blocks a P may still write (ipc-push), and the liveness of D's paired P's: the blocks of a
request that ends on D before its P's ``KVPushed`` stay lent until then, until P's process is
gone, or ``kv_lease_s`` after the router declared an unjudgeable P dead (docs/reliability.md,
"Failure kinds and policies").
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvflow.segments import DEAD, UNKNOWN, process_state

from .kept import Kept

log = logging.getLogger("kvflow.connector.lent")


class LentBlocks(dict):
    """``req_id -> Kept`` of one D: blocks of ended requests their ``peer`` may still write, with
    the paired P's it judges; they go back to ``allocator`` (an unjudgeable P's at ``due``)."""

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
        self[req_id] = Kept(list(blocks))

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
        entry.peer = prefill_id or entry.peer
        if peer_dead and peer_dead == entry.peer:
            entry.due = entry.due or time.monotonic() + self.kv_lease_s
            entry.exited = entry.exited or peer_exited
        self.settle()

    def settle(self) -> None:
        """Give back lent blocks whose writer can write no more: its process is gone, or D cannot
        judge it and their ``due`` has passed."""
        now = time.monotonic()
        done = []
        for req_id, e in self.items():
            p = e.peer
            state = DEAD if e.exited or p in self.gone_peers else \
                process_state(self.peer_pids.get(p, 0), self.peer_hosts.get(p, ""))
            if state == DEAD or (state == UNKNOWN and e.due and now >= e.due):
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
                            entry.peer or "its prefill instance", timeout_s)
