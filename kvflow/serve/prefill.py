"""The prefill instance (P): runs each request's prefill in its own blocks, samples the first
token, and hands the KV to the decode instance (D) the router chose (``Prefill.decode_id``)
through its connector (:func:`kvflow.connector.make_sender`), the one object that owns the
links to paired D's and whatever the transfer needs (exports, mappings, layerwise machinery).

A Prefill naming a D that is not paired, or a request id already queued or held here, is
refused (:class:`~kvflow.protocol.Rejected`; nothing is allocated or sent). ``Unpair`` and a
new pairing with the same D detach only that D.

Per request: queued -> prefill (``hook = connector.begin(job)``; :meth:`Engine.prefill`
chunked by ``max_num_batched_tokens`` with ``on_chunk`` = the connector's hook plus the
heartbeat between chunks; the first token is sampled here and goes to the router at once,
:mod:`kvflow.serve.first_token`; ``connector.finish(job, first_token)``) -> :class:`Held` until
D's :class:`~kvflow.protocol.KVAck`. An
Abort, a failed prefill or transfer (also a layerwise one reported after the prefill), or a
lease that ends without D's renewal (``kv_lease_s``, docs/reliability.md) frees the blocks.
D's renewals come on a socket of their own (a DEALER to D's ``Pair.lease_addr``, from D's
heartbeat thread); P reads them before it judges a lease, so a long prefill of its own does not
expire a lease whose renewals wait unread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

from kvflow.protocol import Abort, KVAck, LeaseRenew, Pair, PairResult, Prefill, Rejected, Unpair
from kvflow.blocks import NoFreeBlocksError

from . import faults
from .instance import Instance
from .pairing import check_peer, peer_of
from .first_token import first_token_sampler
from .startup import StartupError

log = logging.getLogger("kvflow.serve.prefill")


@dataclasses.dataclass
class Held:
    """A sent request P keeps until D's ack or the end of its lease.

    Attributes
    ----------
    blocks : list[int]
        P's blocks D may still read ([] once freed).
    keep : object
        Memory ZMQ still reads (a staging buffer), or None.
    t_renewed : float
        ``time.monotonic()`` of the send or of D's last :class:`~kvflow.protocol.LeaseRenew`.
    """
    blocks: list[int]
    keep: Any = None
    t_renewed: float = dataclasses.field(default_factory=time.monotonic)


class PrefillInstance(Instance):
    role = "prefill"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.kv_lease_s = cfg.kv_lease_s  # sent blocks held this long without D's renewal
        self.queue: collections.deque[Prefill] = collections.deque()
        self.pending: dict[str, Held] = {}
        self.received: dict[str, float] = {}  # queued request -> time.monotonic() of its Prefill
        self.connector = None  # kvflow.connector.KVSender, built by setup()
        self.lease_links: dict[str, Any] = {}  # D id -> DEALER to its lease socket

    # ---- start-up -------------------------------------------------------------------
    def setup(self) -> None:
        from kvflow.connector import bind_to_host, kinds, make_sender
        from kvflow.engine import Engine
        from kvflow.blocks import BlockAllocator
        cfg = self.cfg
        try:
            self.connector = make_sender(cfg.kv_connector, self.spec, cfg.device,
                                         config=cfg.kv_connector_config,
                                         instance_id=self.instance_id, backend=cfg.backend,
                                         layerwise_min_tokens=cfg.layerwise_min_tokens,
                                         max_model_len=self.max_model_len)
            bind_to_host(self.connector.name, cfg.host)  # before its transport listens
        except ValueError as exc:  # unknown connector or option: one line
            raise StartupError(str(exc)) from None
        if cfg.kv_verify:  # checked with the flags too (kvflow.serve.checks); never ignored
            if not hasattr(self.connector, "verify"):
                verified = " and ".join(kinds.with_capability("kv_verify"))
                raise StartupError(f"--kv-verify checks the {verified} connectors, not "
                                   f"{self.connector.name}")
            self.connector.verify = True
        self.cache = self.connector.make_cache(self.num_blocks)
        self.engine = Engine(self.model, self.cache)
        self.allocator = BlockAllocator(self.num_blocks)
        self.connector.warmup(self.engine, cfg.max_num_batched_tokens)

    def on_chunk(self, token_ids: list[int], hook):
        """The ``on_chunk`` of a prefill of ``token_ids``: the connector's ``hook`` (or None),
        then :meth:`between_chunks`; returns the chunk's per-layer hook."""
        def on_chunk(start: int, end: int):
            layer_hook = hook(start, end) if hook is not None else None
            self.between_chunks(token_ids, start, end)
            return layer_hook
        return on_chunk

    def between_chunks(self, token_ids: list[int], start: int, end: int) -> None:
        """Before each prefill chunk: the loop's housekeeping between prefill chunks (the
        router's heartbeat comes from its own thread, :mod:`kvflow.serve.heartbeat`, also
        inside a chunk). Not in a dummy run."""
        from kvflow.context import sends_allowed
        if self.ctrl is None or not sends_allowed():
            return
        Instance.heartbeat(self)
        delay = faults.delay_s("chunk", token_ids)
        if delay:  # test fault: a slow forward, no heartbeat meanwhile
            time.sleep(delay)

    def connector_name(self) -> str:
        return self.connector.name

    def register_extra(self) -> dict[str, str]:
        return self.connector.export()

    # ---- pairing --------------------------------------------------------------------
    def on_pair(self, msg: Pair, frames, ident) -> None:
        error = check_peer(self, msg)
        if not error:
            self._unpair(msg.peer_id)  # the same D paired anew (it registered again)
            try:
                link = self.connector.attach(peer_of(msg), self.ctx)
                self.sockets[link] = f"decode {msg.peer_id}"
                if msg.lease_addr:
                    self._lease_link(msg.peer_id, msg.lease_addr)
            except Exception as exc:
                error = f"cannot attach to {msg.peer_id}: {exc}"
        if error:
            log.error("%s: %s", self.instance_id, error)
        self.send_ctrl(PairResult(instance_id=self.instance_id, peer_id=msg.peer_id,
                                  ok=not error, error=error))

    def on_unpair(self, msg: Unpair, frames, ident) -> None:
        log.warning("%s: unpaired from %s (%s)", self.instance_id, msg.peer_id,
                    msg.reason or "no reason given")
        self._unpair(msg.peer_id)

    def _lease_link(self, peer_id: str, addr: str) -> None:
        """Connect to D ``peer_id``'s lease socket at ``addr`` (its LeaseRenew come on it)."""
        import zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.instance_id.encode())  # D renews by P's id
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        self.lease_links[peer_id] = sock
        self.sockets[sock] = f"decode {peer_id} leases"

    def _unpair(self, peer_id: str) -> None:
        """Detach D ``peer_id`` (its links and whatever the connector holds for it)."""
        link = self.connector.links.get(peer_id)
        if link is not None:
            self.sockets.pop(link, None)
        lease = self.lease_links.pop(peer_id, None)
        if lease is not None:
            self.sockets.pop(lease, None)
            lease.close(0)
        self.connector.detach(peer_id)

    def _not_paired(self, decode_id: str) -> str:
        return (f"prefill instance {self.instance_id} is not paired with decode instance "
                f"{decode_id!r} (paired: {sorted(self.connector.links)})")

    # ---- requests -------------------------------------------------------------------
    def on_prefill(self, msg: Prefill, frames, ident) -> None:
        error = ""
        if msg.req_id in self.pending or any(m.req_id == msg.req_id for m in self.queue):
            error = (f"request id {msg.req_id} is already live on prefill instance "
                     f"{self.instance_id}; a second Prefill with it is refused")
        elif msg.decode_id not in self.connector.links:
            error = self._not_paired(msg.decode_id)
        if error:  # nothing of the live request (or of an unpaired D) is touched
            log.error("%s: %s", self.instance_id, error)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error", error=error))
            return
        need = self.spec.num_blocks_for(len(msg.token_ids))
        if need > self.num_blocks or len(msg.token_ids) > self.max_model_len:
            error = (f"prompt of {len(msg.token_ids)} tokens needs {need} blocks; prefill "
                     f"instance {self.instance_id} has {self.num_blocks} (max_model_len "
                     f"{self.max_model_len})")
            self.connector.fail(msg.req_id, msg.decode_id, error)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="capacity", error=error, param="prompt"))
            return
        self.queue.append(msg)
        self.received[msg.req_id] = time.monotonic()

    def on_abort(self, msg: Abort, frames, ident) -> None:
        queued = [m for m in self.queue if m.req_id == msg.req_id]
        self.queue = collections.deque(m for m in self.queue if m.req_id != msg.req_id)
        for m in queued:
            self.received.pop(m.req_id, None)
            self.connector.fail(m.req_id, m.decode_id, msg.reason or "aborted")
        self.connector.release(msg.req_id)  # no further part goes
        held = self.pending.get(msg.req_id)
        # Blocks D may still be reading stay held until D's ack (D acks an aborted request
        # "not ok") or the lease ends -- also when D was declared dead only for missed
        # heartbeats; if D's process exited nobody reads them: free now.
        if (msg.peer_dead and msg.peer_exited) or held is None or not held.blocks:
            self._release(msg.req_id)
        self.report_blocks()  # the router sees the freed blocks now, not a heartbeat later

    def on_leaserenew(self, msg: LeaseRenew, frames, ident) -> None:
        now = time.monotonic()
        for req_id in msg.req_ids:
            held = self.pending.get(req_id)
            if held is not None:
                held.t_renewed = now

    def on_kvack(self, msg: KVAck, frames, ident) -> None:
        if not msg.ok:
            log.warning("%s: decode dropped %s: %s", self.instance_id, msg.req_id, msg.error)
        self._release(msg.req_id)

    def _release(self, req_id: str) -> None:
        self.connector.release(req_id)
        held = self.pending.pop(req_id, None)
        if held is not None and held.blocks:
            self.allocator.free(held.blocks)

    # ---- work -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.queue)

    def num_running(self) -> int:
        return len(self.queue) + len(self.pending)

    def work(self) -> None:
        from kvflow.connector import PrefillJob, TransferError
        self._expire()
        msg = self.queue[0]
        if msg.decode_id not in self.connector.links:  # its D was unpaired while it waited
            self.queue.popleft()
            self.received.pop(msg.req_id, None)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=self._not_paired(msg.decode_id)))
            return
        try:
            blocks = self.allocator.allocate(self.spec.num_blocks_for(len(msg.token_ids)))
        except NoFreeBlocksError:
            return  # wait for acks to free blocks
        self.queue.popleft()
        t_received = self.received.pop(msg.req_id, time.monotonic())
        try:
            delay = faults.delay_s("prefill", msg.token_ids)
            end = time.monotonic() + delay
            while time.monotonic() < end:  # test fault: a slow prefill (heartbeats go on, as
                time.sleep(0.05)           # between the chunks of a long one)
                self.heartbeat()
            job = PrefillJob(msg.req_id, msg.token_ids, blocks, msg.decode_id,
                             msg.decode_block_ids, msg.num_cached_blocks)
            sample = first_token_sampler(self, msg, t_received, time.monotonic())
            hook = self.connector.begin(job)
            logits = self.engine.prefill(job.token_ids, blocks,
                                         chunk_size=self.cfg.max_num_batched_tokens,
                                         on_chunk=self.on_chunk(job.token_ids, hook))
            handoff = self.connector.finish(job, sample(logits))
        except Exception as exc:
            log.exception("%s: prefill of %s failed", self.instance_id, msg.req_id)
            error = f"prefill failed on {self.instance_id}: {exc}"
            self.allocator.free(blocks)
            self.connector.fail(msg.req_id, msg.decode_id, error)
            kind = "transfer" if isinstance(exc, TransferError) else "error"  # 502 / 500
            self.send_ctrl(Rejected(req_id=msg.req_id, kind=kind, error=error))
            return
        if handoff is None:  # D sends no ack: P's blocks are free now
            self.allocator.free(blocks)
            return
        if not handoff.holds_blocks:
            self.allocator.free(blocks)
            blocks = []
        self.pending[msg.req_id] = Held(blocks, handoff.keep)

    def _fail_transfers(self) -> None:
        for req_id, exc in self.connector.pop_errors():
            log.error("%s: layerwise transfer of %s failed: %s", self.instance_id, req_id, exc)
            self._release(req_id)
            self.send_ctrl(Rejected(req_id=req_id, kind="transfer",
                                    error=f"layerwise KV transfer of {req_id} from "
                                          f"{self.instance_id} failed: {exc}"))

    def _expire(self) -> None:
        for sock in list(self.lease_links.values()):  # renewals that came during a long
            self.drain(sock)                          # prefill count before any lease ends
        now = time.monotonic()
        for req_id, held in list(self.pending.items()):
            if now - held.t_renewed > self.kv_lease_s:
                log.error("%s: no ack or lease renewal for %s in %g s; blocks freed",
                          self.instance_id, req_id, self.kv_lease_s)
                self._release(req_id)

    def heartbeat(self, force: bool = False) -> None:
        self._fail_transfers()
        if self.pending and not self.queue:
            self._expire()
        super().heartbeat(force)

    def close(self) -> None:
        for link in self.connector.links.values() if self.connector is not None else ():
            self.sockets.pop(link, None)
        for sock in self.lease_links.values():
            self.sockets.pop(sock, None)
            sock.close(0)
        self.lease_links.clear()
        if self.connector is not None:
            self.connector.close()  # before the ZMQ context ends: it owns sockets
        super().close()
