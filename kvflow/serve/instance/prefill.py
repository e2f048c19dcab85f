"""The prefill instance (P): prefills each request, sends the first token at once
(:mod:`.first_token`) and hands the KV to the chosen D through its connector, which holds the sent
blocks until D's ack or the lease's end (docs/reliability.md, "Liveness")."""

from __future__ import annotations

import collections
import logging
import time

from kvflow.serve.protocol import Abort, Pair, PairResult, Prefill, Rejected, Unpair
from kvflow.blocks import NoFreeBlocksError
from kvflow.connector import LeaseLinks

from . import faults
from .base import Instance
from .pairing import check_peer, peer_of
from .first_token import first_token_sampler

log = logging.getLogger("kvflow.serve.prefill")


class PrefillInstance(Instance):
    role = "prefill"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.kv_lease_s = cfg.kv_lease_s  # sent blocks held this long without D's renewal
        self.queue: collections.deque[Prefill] = collections.deque()
        self.received: dict[str, float] = {}  # queued request -> time.monotonic() of its Prefill
        self.connector = None  # kvflow.connector.KVSender, built by setup()
        self.lease_links = LeaseLinks(self.instance_id)  # D id -> DEALER to its lease socket

    @property
    def pending(self) -> dict:
        """req_id -> :class:`kvflow.connector.Kept` of the requests sent, not yet acked."""
        return self.connector.held if self.connector is not None else {}

    def setup(self) -> None:
        from kvflow.connector import make_sender
        cfg = self.cfg
        self.connector = self.make_connector(
            make_sender, instance_id=self.instance_id,
            layerwise_min_tokens=cfg.layerwise_min_tokens)
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
        """The loop's housekeeping before each prefill chunk (not in a dummy run)."""
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
        self.sockets[self.lease_links.connect(self.ctx, peer_id, addr)] = f"decode {peer_id} leases"

    def _unpair(self, peer_id: str) -> None:
        """Detach D ``peer_id`` (its links and whatever the connector holds for it)."""
        link = self.connector.links.get(peer_id)
        if link is not None:
            self.sockets.pop(link, None)
        self.sockets.pop(self.lease_links.drop(peer_id), None)
        self.connector.detach(peer_id)

    def _not_paired(self, decode_id: str) -> str:
        return (f"prefill instance {self.instance_id} is not paired with decode instance "
                f"{decode_id!r} (paired: {sorted(self.connector.links)})")

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
        # blocks D may still read stay held until D's ack or the lease ends; D exited: free now
        if (msg.peer_dead and msg.peer_exited) or held is None or not held.blocks:
            self._release(msg.req_id)
        self.report_blocks()  # the router sees the freed blocks now, not a heartbeat later

    def on_data(self, msg, frames, ident) -> None:
        """A data-plane message from a D, for the connector; P frees the blocks it answers."""
        freed = self.connector.on_message(msg, frames, ident.decode() if ident else None)
        if freed is None:  # not P's message: logged and dropped
            return super().on_data(msg, frames, ident)
        for f in freed:
            self._free(f)

    def _free(self, freed) -> None:
        """Free the blocks of a :class:`kvflow.connector.Freed` and log its note."""
        if freed.note:
            getattr(log, freed.level)("%s", freed.note)
        if freed.blocks:
            self.allocator.free(freed.blocks)

    def _release(self, req_id: str) -> None:
        blocks = self.connector.drop(req_id)
        if blocks:
            self.allocator.free(blocks)

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
            while time.monotonic() < end:  # test fault: a slow prefill, heartbeats go on
                time.sleep(0.05)
                self.heartbeat()
            job = PrefillJob(msg.req_id, msg.token_ids, blocks, msg.decode_id,
                             msg.decode_block_ids, msg.num_cached_blocks)
            sample = first_token_sampler(self, msg, t_received, time.monotonic())
            hook = self.connector.begin(job)
            logits = self.engine.prefill(job.token_ids, blocks,
                                         chunk_size=self.cfg.max_num_batched_tokens,
                                         on_chunk=self.on_chunk(job.token_ids, hook))
            kept = self.connector.finish(job, sample(logits))
        except Exception as exc:
            log.exception("%s: prefill of %s failed", self.instance_id, msg.req_id)
            error = f"prefill failed on {self.instance_id}: {exc}"
            self.allocator.free(blocks)
            self.connector.fail(msg.req_id, msg.decode_id, error)
            kind = "transfer" if isinstance(exc, TransferError) else "error"  # 502 / 500
            self.send_ctrl(Rejected(req_id=msg.req_id, kind=kind, error=error))
            return
        free_now = self.connector.hold(msg.req_id, blocks, kept)
        if free_now:  # no ack comes (kept None) or D reads none of them after the prefill
            self.allocator.free(free_now)

    def _fail_transfers(self) -> None:
        for req_id, exc in self.connector.pop_errors():
            log.error("%s: layerwise transfer of %s failed: %s", self.instance_id, req_id, exc)
            self._release(req_id)
            self.send_ctrl(Rejected(req_id=req_id, kind="transfer",
                                    error=f"layerwise KV transfer of {req_id} from "
                                          f"{self.instance_id} failed: {exc}"))

    def _expire(self) -> None:
        self.lease_links.drain(self.drain)  # renewals of a long prefill count first
        for freed in self.connector.expire(self.kv_lease_s):
            self._free(freed)

    def heartbeat(self, force: bool = False) -> None:
        self._fail_transfers()
        if self.pending and not self.queue:
            self._expire()
        super().heartbeat(force)

    def close(self) -> None:
        for link in self.connector.links.values() if self.connector is not None else ():
            self.sockets.pop(link, None)
        for sock in self.lease_links.close():
            self.sockets.pop(sock, None)
        if self.connector is not None:
            self.connector.close()  # before the ZMQ context ends: it owns sockets
        super().close()
