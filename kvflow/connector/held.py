"""P's side of the lease: the blocks P keeps for a request after its send (:meth:`HeldSide.hold`)
until D's ack (:meth:`HeldSide.on_message`), the lease's end (:meth:`HeldSide.expire`) or
:meth:`HeldSide.drop`, which answer which of P's block ids serve frees (D's side: :mod:`.lease`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvflow.connector.kept import Kept
from kvflow.connector.messages import KVAck, LeaseRenew


@dataclasses.dataclass
class Freed:
    """One request P no longer keeps: ``blocks`` (P's ids serve frees, maybe []), ``note`` for P's
    log ('' for none) at ``level`` (``"warning"``: D dropped it; ``"error"``: a lease ended)."""
    req_id: str
    blocks: list[int]
    note: str = ""
    level: str = "warning"


class HeldSide:
    """P's held-until-ack state, a base of :class:`~kvflow.connector.base.KVSender` (which gives
    ``instance_id`` and ``release``)."""

    instance_id: str

    @property
    def held(self) -> dict[str, Kept]:
        """req_id -> :class:`~.kept.Kept`, for every request sent and not yet acked or expired."""
        try:
            return self._held
        except AttributeError:
            self._held: dict[str, Kept] = {}
            return self._held

    def hold(self, req_id: str, blocks: list[int], kept: Kept | None) -> list[int]:
        """After ``finish`` returned ``kept`` for ``req_id`` (prefilled in ``blocks``): keep it, its
        lease from now; returns the ids serve frees now (all, when ``kept`` keeps none)."""
        if kept is None:  # D sends no ack: nothing is held
            return list(blocks)
        kept.since = time.monotonic()
        self.held[req_id] = kept
        return [] if kept.blocks else list(blocks)

    def on_message(self, msg: Any, frames: list[Any], peer: str | None) -> list[Freed] | None:
        """A data-plane message from D ``peer`` (its id, or None): what it frees (``[]`` for a
        renewal); None for a message that is not P's (serve logs and drops it)."""
        if isinstance(msg, KVAck):
            note = "" if msg.ok else f"{self.instance_id}: decode dropped {msg.req_id}: {msg.error}"
            return [Freed(msg.req_id, self.drop(msg.req_id), note)]
        if isinstance(msg, LeaseRenew):
            now = time.monotonic()
            for req_id in msg.req_ids:
                held = self.held.get(req_id)
                if held is not None:
                    held.since = now
            return []
        return None

    def drop(self, req_id: str) -> list[int]:
        """Stop keeping ``req_id`` (D's ack, an abort, a failed transfer, the lease's end):
        the kind's ``release`` and the block ids serve frees ([] if none were held)."""
        self.release(req_id)
        held = self.held.pop(req_id, None)
        return list(held.blocks) if held is not None and held.blocks else []

    def expire(self, lease_s: float, now: float | None = None) -> list[Freed]:
        """Every request with no ack or renewal for more than ``lease_s`` seconds (at ``now``,
        ``time.monotonic()`` by default), dropped; with its error line."""
        now = time.monotonic() if now is None else now
        out = []
        for req_id, held in list(self.held.items()):
            if now - held.since > lease_s:
                note = (f"{self.instance_id}: no ack or lease renewal for {req_id} in "
                        f"{lease_s:g} s; blocks freed")
                out.append(Freed(req_id, self.drop(req_id), note, "error"))
        return out
