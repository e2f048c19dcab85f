"""The decode instance (D): allocates each request's blocks in its own table, receives the KV
through its connector (:mod:`.arrivals`), decodes from the second token on, and renews P's leases
on what it still means to read (docs/reliability.md, "Liveness")."""

from __future__ import annotations

import logging
import time

import zmq

from kvflow.connector import Renewals, SlotsTaken, lease_socket
from kvflow.serve.protocol import Abort, Allocate, Pair, PairResult, Unpair
from kvflow.blocks import DecodeState, PrefixCache
from kvflow.segments import DEAD, process_state

from ..advertise import advertised_host
from .arrivals import Arrivals
from .base import Instance
from .pairing import check_peer, peer_of
from .sequences import DecodeLoop, DecodesWithLoop

log = logging.getLogger("kvflow.serve.decode")
_WAITING = (DecodeState.ALLOCATED, DecodeState.RECEIVING)  # D still means to read their KV


class DecodeInstance(Arrivals, DecodesWithLoop, Instance):
    role = "decode"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.receive_timeout_s = cfg.receive_timeout_s
        self.data: zmq.Socket | None = None
        self.data_addr = ""
        self.peer_id = ""  # the last paired P
        self.receiver = None  # kvflow.connector.KVReceiver, built by setup()
        self._last_peer_check = 0.0
        self._last_renew = 0.0
        self.renewals: Renewals | None = None  # sent by the heartbeat thread (open_channels)
        self.lease_addr = ""
        self.waiting_pairs: dict[str, Pair] = {}  # P refused for want of a slot -> its Pair
        self.unpaired: dict[str, float] = {}  # P declared dead, not seen exit -> when (monotonic)

    def setup(self) -> None:
        from kvflow.connector import make_receiver
        cfg = self.cfg
        self.receiver = self.make_connector(make_receiver)
        self.receiver.reply = self._send_data  # acks and the loop's renewals, to P
        self.lent = self.receiver.keep(self.allocator, cfg.kv_lease_s)  # the receiver's
        prefix = PrefixCache(self.allocator, self.spec.block_size) if cfg.enable_prefix_caching else None
        self.loop = DecodeLoop(self, DecodeState, prefix)
        self.seqs, self.prefix = self.loop.seqs, prefix
        self.receiver.warmup()

    @property
    def kv_lease_s(self) -> float:
        """P's lease on sent blocks (seconds; ``--kv-lease-s``)."""
        return self.lent.kv_lease_s

    @kv_lease_s.setter
    def kv_lease_s(self, value: float) -> None:
        self.lent.kv_lease_s = value
        if self.renewals is not None:
            self.renewals.gap_s = 0.8 * value

    def open_channels(self) -> None:
        super().open_channels()
        self.data = self.ctx.socket(zmq.ROUTER)
        # a P paired anew reconnects under the same identity: the new connection takes over
        self.data.setsockopt(zmq.ROUTER_HANDOVER, 1)
        port = self.data.bind_to_random_port(f"tcp://{self.cfg.host}")
        self.data_addr = f"tcp://{advertised_host(self.cfg.host, self.cfg.advertise_host)}:{port}"
        self.sockets[self.data] = "prefill link"

    def lease_renewals(self) -> Renewals:
        """D's lease socket (P's connect to :attr:`lease_addr`) and its renewals, for the
        heartbeat thread."""
        sock, port = lease_socket(self.ctx, self.cfg.host)
        self.lease_addr = f"tcp://{advertised_host(self.cfg.host, self.cfg.advertise_host)}:{port}"
        self.renewals = self.receiver.renewals = Renewals(sock, 0.8 * self.kv_lease_s)
        return self.renewals

    def connector_name(self) -> str:
        return self.receiver.name

    def register_extra(self) -> dict[str, str]:
        return {"data_addr": self.data_addr, "lease_addr": self.lease_addr,
                **self.receiver.export()}

    def on_pair(self, msg: Pair, frames, ident) -> None:
        """Pair with P ``msg.peer_id`` and answer :class:`PairResult`; one refused for want of a
        receiver slot waits in ``waiting_pairs`` until one frees (:meth:`_pair_waiting`)."""
        self.waiting_pairs.pop(msg.peer_id, None)
        error = check_peer(self, msg)
        if not error:
            try:
                self.receiver.attach(peer_of(msg))
                self.peer_id = msg.peer_id
                self.lent.meet(msg.peer_id, msg.peer_pid, msg.peer_host_id)
                self.unpaired.pop(msg.peer_id, None)
                self._check_peers()
            except SlotsTaken as exc:
                self.waiting_pairs[msg.peer_id] = msg
                error = f"cannot attach to {msg.peer_id}'s cache: {exc}; it pairs once one frees"
            except Exception as exc:
                error = f"cannot attach to {msg.peer_id}'s cache: {exc}"
        if error:
            log.error("%s: %s", self.instance_id, error)
        self.send_ctrl(PairResult(instance_id=self.instance_id, peer_id=msg.peer_id,
                                  ok=not error, error=error))

    def _pair_waiting(self) -> None:
        """Pair the P's that waited for a receiver slot, oldest first (dropping dead ones)."""
        for peer_id, msg in list(self.waiting_pairs.items()):
            if process_state(msg.peer_pid, msg.peer_host_id) == DEAD:
                self.waiting_pairs.pop(peer_id)
                continue
            self.on_pair(msg, [], None)
            if peer_id in self.waiting_pairs:  # still no slot: the later ones wait too
                return

    def on_unpair(self, msg: Unpair, frames, ident) -> None:
        """P ``msg.peer_id`` died: forgotten now if it exited (or only waited for a slot), else
        (it may still write) ``kv_lease_s`` later unless it pairs again."""
        log.log(logging.INFO if msg.stopped else logging.WARNING,  # a clean stop is no fault
                "%s: prefill instance %s is gone (%s)", self.instance_id, msg.peer_id,
                msg.reason or "no reason given")
        if self.waiting_pairs.pop(msg.peer_id, None) is not None \
                and msg.peer_id not in self.lent.peer_pids:  # never attached: nothing to forget
            log.info("%s: dropped the waiting pairing with %s", self.instance_id, msg.peer_id)
            return
        if msg.exited:
            self._forget_peer(msg.peer_id)
        elif not self.receiver.host_local:
            self.unpaired.setdefault(msg.peer_id, time.monotonic())

    def _forget_peer(self, peer_id: str) -> None:
        self.unpaired.pop(peer_id, None)
        self.receiver.detach(peer_id)
        self.lent.forget(peer_id)
        self.report_blocks()
        self._pair_waiting()

    def on_allocate(self, msg: Allocate, frames, ident) -> None:
        if msg.req_id in self.lent:  # its blocks are still lent
            self.send_ctrl(self.loop.duplicate(msg.req_id))
            return
        self.loop.allocate(msg)
        if msg.req_id in self.seqs:  # admitted: P may write its blocks from now on
            self.receiver.expect(msg.req_id)
            self._want_renewals()  # renewed from now on, even if the next decode step is long

    def on_abort(self, msg: Abort, frames, ident) -> None:
        # a P that got the Prefill may still write the blocks (even one declared dead): lent
        self._end(msg.req_id, DecodeState.ABORTED, msg.reason or "aborted", notify=False,
                  lend=msg.prefill_sent)
        self.lent.aborted(msg.req_id, msg.prefill_id, msg.peer_dead, msg.peer_exited)
        self.report_blocks()  # the router sees the freed blocks now, not a heartbeat later

    def _check_peers(self) -> None:
        """Forget P's whose process is gone (connectors whose P's share this host only)."""
        if not self.receiver.host_local:  # their P's may live on other hosts
            return
        gone = self.lent.gone()
        for peer, pid in gone:
            self.receiver.detach(peer)
            log.warning("%s: prefill instance %s (pid %d) is gone", self.instance_id, peer, pid)
        if gone:
            self._pair_waiting()

    def _end(self, req_id: str, state, error: str, *, notify: bool = True,
             lend: bool = True) -> None:
        """End a live request and free its blocks, or keep them lent while P may still write
        them (``lend``: the Prefill went out)."""
        seq = self.seqs.get(req_id)
        if seq is None:
            return
        lend = self.receiver.end(req_id, seq.req.block_table, error, may_write=lend and (
            seq.req.state in _WAITING))
        self.loop.end(req_id, state, error, notify=notify, free=not lend)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_peer_check >= (0.1 if self.lent else 1.0):
            self._last_peer_check = now
            self._check_peers()
            for peer, t in list(self.unpaired.items()):
                if now - t >= self.kv_lease_s:  # declared dead a lease ago, not paired again
                    self._forget_peer(peer)
        self.lent.warn_overdue(self.instance_id, self.receive_timeout_s)
        for arrival in self.receiver.due(now):  # held by a test fault until now
            self._react(arrival)
        waiting = []
        for req_id, s in list(self.seqs.items()):
            if s.req.state in _WAITING and now - s.t_alloc > self.receive_timeout_s:
                self._end(req_id, DecodeState.TIMED_OUT,
                          f"no KV from prefill within {self.receive_timeout_s:g} s")
            elif s.req.state in _WAITING:
                waiting.append(s.req.request_id)
        self._want_renewals(waiting)
        if self.beats is None and waiting and self.peer_id \
                and (force or now - self._last_renew >= self.cfg.heartbeat_s):
            self._last_renew = now  # no heartbeat thread (an instance driven by hand)
            self._renew(waiting)
        super().heartbeat(force)

    def _renew_peers(self) -> list[str]:
        """Every paired P (D does not know which one prefills a request before its KV arrives)."""
        return list(self.lent.peer_pids) or ([self.peer_id] if self.peer_id else [])

    def _want_renewals(self, waiting: list[str] | None = None) -> None:
        """Tell the heartbeat thread what to renew: ``waiting`` (default: the requests
        ALLOCATED or RECEIVING), with every paired P."""
        if self.renewals is None:
            return
        if waiting is None:
            waiting = [r for r, s in self.seqs.items() if s.req.state in _WAITING]
        self.renewals.want(self._renew_peers(), waiting)

    def _renew(self, req_ids: list[str]) -> None:
        """Lease renewals from the loop (no heartbeat thread runs)."""
        self.receiver.renew(self._renew_peers(), req_ids)

    def close(self) -> None:
        super().close()
        if self.receiver is not None:
            self.receiver.close()
