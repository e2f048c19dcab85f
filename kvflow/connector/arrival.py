"""D's half of the data plane: :meth:`~ArrivalSide.on_message` takes every message P's connector
sends D and answers an :class:`Arrival` for serve: lent blocks given back (:mod:`.lent`), P's
lease checked (:mod:`.lease`), the kind's ``receive``, P acked when the kind acks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from kvflow.connector.messages import (DATA_MESSAGES, KVAck, KVData, KVLayer, KVPushed, KVReady,
                                       LeaseRenew)

from .kept import Kept

log = logging.getLogger("kvflow.connector.arrival")

_TO_D = (KVReady, KVData, KVLayer, KVPushed)

DONE, PART, FAILED, IGNORED = "done", "part", "failed", "ignored"


def is_data_message(msg: Any) -> bool:
    """``msg`` (a decoded message) belongs to the data plane: serve hands it to the connector."""
    return isinstance(msg, DATA_MESSAGES)


@dataclasses.dataclass
class Arrival:
    """What one data-plane message from P ``peer`` (None: not known) did on D, for serve: ``status``
    ``"done"`` (the KV is in D's blocks: ``stats``, P's ``first_token``, ``t_done`` on
    ``time.monotonic()``), ``"part"`` (more to come, or held by a test fault), ``"failed"``
    (``error``, ``exc``; ``reusable``: P writes nothing more) or ``"ignored"``. ``transfer_ms``: P's
    send to D's completion, ``gather_ms``: P's gather (tcp), ms; ``pushed``: a push's ``exposed_ms``
    (with the message's way) and ``prefill_ms``."""
    req_id: str
    status: str
    peer: str | None = None
    stats: Any = None
    first_token: int = -1
    t_done: float = 0.0
    transfer_ms: float = 0.0
    gather_ms: float = 0.0
    pushed: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""
    exc: BaseException | None = None
    reusable: bool = False


class ArrivalSide:
    """The arrival, ack, lease and lent-block handling of :class:`~kvflow.connector.KVReceiver`
    (a mixin; :meth:`_init_arrivals` sets its state)."""

    def _init_arrivals(self) -> None:
        self.reply: Callable[[Any, str | None], None] | None = None  # reply(msg, P id), by serve
        self.lent = None  # LentBlocks (:meth:`keep`)
        self.renewals = None  # Renewals, set by serve when its heartbeat thread sends them
        self.inflight: dict[str, Kept] = {}  # held back by a test fault: keep=(msg, frames, fault)

    def keep(self, allocator: Any, kv_lease_s: float):
        """Keep lent blocks for D's ``allocator``; returns the new
        :class:`~kvflow.connector.LentBlocks` (``kv_lease_s``: P's lease, s)."""
        from .lent import LentBlocks
        self.lent = LentBlocks(allocator, kv_lease_s)
        return self.lent

    def on_message(self, msg: Any, frames: list[Any], peer: str | None,
                   dst_ids: list[int] | None, *, delay_s: float = 0.0,
                   fault: str = "") -> Arrival:
        """Handle one data-plane message (``msg``, decoded, and the raw ``frames`` after it) from P
        ``peer`` (None: unknown). ``dst_ids``: D's block ids of the prompt after its prefix hit,
        None when D cannot receive it now (acked with an error, ignored). Test faults: ``delay_s``
        holds the message (:meth:`due`), ``fault`` fails it after the lease check."""
        if not isinstance(msg, _TO_D):
            log.error("unexpected %s on D's data socket from %s; dropped", type(msg).__name__, peer)
            return Arrival(getattr(msg, "req_id", ""), IGNORED, peer)
        if isinstance(msg, KVLayer):  # parts come from P's sender thread: ack P's control link
            peer = msg.reply_to
        req_id = msg.req_id
        if isinstance(msg, KVPushed) and self.lent is not None and req_id in self.lent:
            self.lent.give_back([req_id])  # ended here meanwhile: P is done with the blocks now
            return Arrival(req_id, IGNORED, peer)
        if dst_ids is None or req_id in self.inflight:
            self._ack(req_id, peer, "unknown or aborted request")
            return Arrival(req_id, IGNORED, peer)
        if delay_s:  # test fault: the transfer stays in flight; abort or kill D meanwhile
            held = (msg, [bytes(getattr(f, "buffer", f)) for f in frames], fault)
            self.inflight[req_id] = Kept(list(dst_ids), held, peer, due=time.monotonic() + delay_s)
            return Arrival(req_id, PART, peer)
        return self._take(msg, frames, peer, dst_ids, fault)

    def due(self, now: float) -> list[Arrival]:
        """Take the held messages due at ``now`` (``time.monotonic()``)."""
        out = []
        for req_id, held in list(self.inflight.items()):
            if now >= held.due:
                del self.inflight[req_id]
                msg, frames, fault = held.keep
                out.append(self._take(msg, frames, held.peer, held.blocks, fault))
        return out

    def end(self, req_id: str, blocks: list[int], error: str, *, may_write: bool) -> bool:
        """D ended ``req_id`` (D's ``blocks``): drop a message held for it (acked with ``error``)
        and a partial transfer. True when the blocks stay lent (``may_write``: P may write them)."""
        held = self.inflight.pop(req_id, None)
        if held is not None and isinstance(held.keep[0], KVPushed):
            may_write = False  # P's KVPushed already came: it writes nothing more
        elif held is not None:  # a transfer in flight is dropped; P may free its blocks
            self._ack(req_id, held.peer, error or "aborted")
        lend = may_write and self.peer_writes
        if lend:
            self.lent.lend(req_id, blocks)
        self.forget(req_id)  # drop a partly received layerwise transfer
        return lend

    def renew(self, peers: list[str], req_ids: list[str]) -> None:
        """A lease renewal of ``req_ids`` to every P of ``peers`` through ``reply`` (from D's
        loop, where no heartbeat thread sends them)."""
        wall = time.time()
        for peer in peers:
            self.reply(LeaseRenew(req_ids=req_ids), peer)
            if self.renewals is not None:
                self.renewals.record(peer, req_ids, wall)

    def _ack(self, req_id: str, peer: str | None, error: str = "") -> None:
        """Ack a transfer to P (when the kind acks: P holds something until then)."""
        if self.acks:
            self.reply(KVAck(req_id=req_id, ok=not error, error=error), peer)

    def _lease_ok(self, msg: Any, peer: str | None) -> bool:
        """P's lease on the sent blocks still holds (20% margin), for kinds that read P's
        memory: counted from P's send or from the last renewal to ``peer`` that kept it."""
        t_start = getattr(msg, "t_start", 0.0)
        if not self.reads_peer_memory or not t_start:
            return True
        renewed = (self.renewals.renewed_since(msg.req_id, peer, t_start)
                   if self.renewals is not None else 0.0)
        start = max(t_start, renewed if renewed >= t_start else 0.0)
        return time.time() - start < 0.8 * self.lent.kv_lease_s

    def _take(self, msg: Any, frames: list, peer: str | None, dst_ids: list[int],
              fault: str) -> Arrival:
        req_id = msg.req_id
        try:
            if not self._lease_ok(msg, peer):
                raise TimeoutError(f"P's lease of {self.lent.kv_lease_s:g} s on the sent blocks "
                                   f"expired before D could read them")
            if fault:
                raise RuntimeError(fault)
            stats = self.receive(msg, frames, self.cache, dst_ids, peer)
        except Exception as exc:
            self._ack(req_id, peer, str(exc))  # no acks (ipc-push): this was P's last word
            return Arrival(req_id, FAILED, peer, error=str(exc), exc=exc, reusable=not self.acks)
        if stats is None:  # a layerwise part: more layers to come
            return Arrival(req_id, PART, peer)
        t_done, now = time.monotonic(), time.time()
        self._ack(req_id, peer)
        arrival = Arrival(req_id, DONE, peer, stats, msg.first_token, t_done,
                          round((now - msg.t_start) * 1e3 if msg.t_start else 0.0, 3),
                          round(getattr(msg, "gather_ms", 0.0), 3))
        if isinstance(msg, KVPushed):  # the part P waited for after the prefill, + the message
            arrival.pushed = {"exposed_ms": round(msg.exposed_ms + max(0.0, now - msg.t_done) * 1e3, 3),
                              "prefill_ms": round(msg.prefill_ms, 3)}
        return arrival
