"""The prefill instance (P): runs each request's prefill in its own blocks, samples the first
token, and hands the KV to the decode instance (D) that the router chose for it.

P may be paired with several D's: it keeps one link per paired D (a DEALER to D's data
socket; with ipc push also D's mapped cache, with layerwise also a part socket), keyed by D's
instance id, and sends each request's KV to exactly the D its :class:`~kvflow.protocol.Prefill`
names (``decode_id``). A Prefill naming a D that is not paired, or a request id already queued
or pending here, is refused (:class:`~kvflow.protocol.Rejected`; nothing is allocated or
sent). :class:`~kvflow.protocol.Unpair` (the router saw that D die) and a new pairing with
the same D drop only that D's link.

Per request: WAITING (queued) -> PREFILLING (engine.prefill, chunked by
``max_num_batched_tokens``) -> SENDING -> DONE on D's :class:`~kvflow.protocol.KVAck`. An
:class:`~kvflow.protocol.Abort`, a failed prefill or transfer, or an ack that never comes
(``ack_timeout_s``) also frees the blocks.

Two transfer modes (``--transfer-mode``):

- ``layerwise`` (default, for prompts of at least ``--layerwise-min-tokens``): every layer of
  every prefill chunk is signalled and a sender thread moves it while the next layers compute
  (:class:`kvflow.transfer.layerwise.LayerwiseSender`); P's blocks stay held until D's ack.
- ``request`` (and shorter prompts): after the prefill, the whole request at once (ipc: D pulls
  from P's shared cache, P's blocks held until the ack; tcp: gathered and sent, P's blocks
  freed at once).

The signal channel and the layerwise socket are created at pairing, long after the profile
run; the start-up warm-up runs a chunked prefill through the layerwise path inside a dummy run
(nothing registered, signalled or sent). A layer never signalled within ``signal_timeout_s``
fails the request (HTTP 500 naming the layer and step) and frees its blocks on P; the router's
Abort frees D's.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import zmq

from kvflow.cache import PagedKVCache
from kvflow.context import forward_context, sends_allowed
from kvflow.protocol import Abort, KVAck, LeaseRenew, Pair, PairResult, Prefill, Rejected, Unpair
from kvflow.sched import NoFreeBlocksError

from . import faults
from .instance import Instance, check_peer, layerwise_min_tokens, sample_token, uses_push

log = logging.getLogger("kvflow.serve.prefill")


class PrefillInstance(Instance):
    role = "prefill"
    signal_timeout_s = 30.0  # a layer unsignalled this long fails the request

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # sent blocks are held under a lease: D's LeaseRenew or KVAck, else freed after this
        self.ack_timeout_s = float(getattr(cfg, "kv_lease_s", 5.0))
        self.queue: collections.deque[Prefill] = collections.deque()
        self.pending: dict[str, tuple[list[int], Any, float]] = {}  # req -> (blocks, keep, t)
        self.links: dict[str, zmq.Socket] = {}  # paired D's instance id -> link to its data socket
        self.sender = None
        self.shared = None
        self.layerwise = None  # LayerwiseSender when --transfer-mode layerwise (pull)
        self.writer = None     # PushWriter with ipc push (kvflow.transfer.push)

    # ---- start-up -------------------------------------------------------------------
    def make_cache(self, num_blocks: int) -> PagedKVCache:
        if uses_push(self.cfg):  # P writes into D's exported cache; its own stays private
            from kvflow.transfer.push import LAYERS_PER_COPY, LAYERWISE_MAX_CTAS, PushWriter
            cache = super().make_cache(num_blocks)
            self.writer = self.sender = PushWriter(
                cache, self.cfg.backend, max_ctas=self.cfg.layerwise_max_ctas or LAYERWISE_MAX_CTAS,
                layers_per_copy=self.cfg.layers_per_copy or LAYERS_PER_COPY)
            return cache
        if self.cfg.transfer == "ipc" and str(self.cfg.device).startswith("cuda"):
            from kvflow.transfer.cuda_ipc import CudaIpcSender  # one CUDA allocation, IPC handle
            self.sender = CudaIpcSender(super().make_cache(num_blocks))
            return self.sender.cache
        if self.cfg.transfer == "ipc":
            from kvflow.transfer.ipc import IpcSender, SharedCache, clean_stale_segments
            clean_stale_segments()
            self.shared = SharedCache(self.spec, num_blocks, role="prefill")
            self.sender = IpcSender(self.shared)
            return self.shared.cache
        from kvflow.transfer.tcp import TcpSender
        self.sender = TcpSender(self.cfg.backend)
        return super().make_cache(num_blocks)

    def between_chunks(self, token_ids: list[int], start: int, end: int) -> None:
        """The engine's ``before_chunk`` hook: a heartbeat between prefill chunks (on this
        thread, so the control socket stays single-threaded), else a prefill longer than the
        router's ``--dead-after-s`` gets a live P declared dead. Not in a dummy run."""
        if self.ctrl is None or not sends_allowed():
            return
        Instance.heartbeat(self)
        delay = faults.delay_s("chunk", token_ids)
        if delay:  # test fault: a slow forward, no heartbeat meanwhile
            time.sleep(delay)

    def warmup(self) -> None:
        self.engine.before_chunk = self.between_chunks
        from kvflow.kernels import gather_blocks
        from kvflow.cache import staging_buffer
        scratch = PagedKVCache(self.spec, 2, device=self.cfg.device)
        gather_blocks(scratch, [1], staging_buffer(scratch.spec, 1, device=self.cfg.device),
                      backend=self.cfg.backend)
        if self.writer is not None:  # both grids of the push copies (full and capped)
            from kvflow.kernels import copy_blocks
            other = PagedKVCache(self.spec, 2, device=self.cfg.device)
            for cap in (None, self.writer.max_ctas):
                copy_blocks(scratch, other, [1], [0], backend=self.cfg.backend, max_ctas=cap)
            self.dummy_run()
        elif self.cfg.transfer_mode == "layerwise":
            from kvflow.transfer.layerwise import LayerwiseSender
            self.layerwise = LayerwiseSender(self.sender, self.cache, self.instance_id,
                                             signal_timeout_s=self.signal_timeout_s)
            self.dummy_run()

    def dummy_run(self, num_tokens: int = 32) -> None:
        """A chunked prefill of ``num_tokens`` dummy tokens through the layerwise path inside
        ``forward_context(is_dummy_or_profile_run=True)``: nothing is registered, signalled or
        sent (the warm-up at start; also callable after real traffic)."""
        n = min(num_tokens, self.max_model_len, self.num_blocks * self.spec.block_size)
        blocks = list(range(self.spec.num_blocks_for(n)))
        chunk = max(1, min(self.cfg.max_num_batched_tokens, n // 2))
        with forward_context(is_dummy_or_profile_run=True):
            if self.writer is not None:
                self.writer.prefill(self.engine, [0] * n, blocks, blocks, chunk)
            else:
                self.layerwise.prefill(self.engine, "dummy", [0] * n, blocks, chunk)

    def register_extra(self) -> dict[str, str]:
        return self.sender.export()

    # ---- handlers -------------------------------------------------------------------
    def on_pair(self, msg: Pair, frames, ident) -> None:
        error = check_peer(self, msg)
        if not error:
            self._unpair(msg.peer_id)  # the same D paired anew (it registered again)
            link = self.ctx.socket(zmq.DEALER)
            link.setsockopt(zmq.IDENTITY, self.instance_id.encode())
            link.connect(msg.data_addr)
            self.links[msg.peer_id] = link
            self.sockets[link] = f"decode {msg.peer_id}"
            if self.layerwise is not None:
                self.layerwise.open(self.ctx, msg.data_addr, msg.peer_id)
            if self.writer is not None:
                try:
                    self.writer.attach(msg.peer_id, msg.shm_name, self.spec, msg.peer_num_blocks)
                except Exception as exc:
                    error = f"cannot map {msg.peer_id}'s cache to push into: {exc}"
                    self._unpair(msg.peer_id)
        if error:
            log.error("%s: %s", self.instance_id, error)
        self.send_ctrl(PairResult(instance_id=self.instance_id, peer_id=msg.peer_id,
                                  ok=not error, error=error))

    def on_unpair(self, msg: Unpair, frames, ident) -> None:
        log.warning("%s: unpaired from %s (%s)", self.instance_id, msg.peer_id,
                    msg.reason or "no reason given")
        self._unpair(msg.peer_id)

    def _unpair(self, peer_id: str) -> None:
        """Drop D ``peer_id``'s link, layerwise socket and push mapping; other D's keep theirs."""
        link = self.links.pop(peer_id, None)
        if link is not None:
            self.sockets.pop(link, None)
            link.close(0)
        if self.layerwise is not None:
            self.layerwise.close_peer(peer_id)
        if self.writer is not None:
            self.writer.detach(peer_id)

    def _refusal(self, msg: Prefill) -> str:
        """Why ``msg`` cannot be taken ('' if it can): its id is live here, or its D is not
        paired with this P."""
        if msg.req_id in self.pending or any(m.req_id == msg.req_id for m in self.queue):
            return (f"request id {msg.req_id} is already live on prefill instance "
                    f"{self.instance_id}; a second Prefill with it is refused")
        return "" if msg.decode_id in self.links else self._not_paired(msg.decode_id)

    def _not_paired(self, decode_id: str) -> str:
        return (f"prefill instance {self.instance_id} is not paired with decode instance "
                f"{decode_id!r} (paired: {sorted(self.links)})")

    def on_prefill(self, msg: Prefill, frames, ident) -> None:
        error = self._refusal(msg)
        if error:  # nothing of the live request (or of an unpaired D) is touched
            log.error("%s: %s", self.instance_id, error)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error", error=error))
            return
        need = self.spec.num_blocks_for(len(msg.token_ids))
        if need > self.num_blocks or len(msg.token_ids) > self.max_model_len:
            error = (f"prompt of {len(msg.token_ids)} tokens needs {need} blocks; prefill "
                     f"instance {self.instance_id} has {self.num_blocks} (max_model_len "
                     f"{self.max_model_len})")
            self._push_failed(msg, error)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="capacity", error=error, param="prompt"))
            return
        self.queue.append(msg)

    def _push_failed(self, msg: Prefill, error: str) -> None:
        """Push: tell the request's D nothing (more) will be written into its blocks."""
        link = self.links.get(msg.decode_id)
        if self.writer is None or link is None:
            return
        try:
            self.writer.send_done(link, msg.req_id, ok=False, error=error)
        except Exception:  # D is gone: nobody holds blocks for this request any more
            log.exception("%s: could not tell %s that %s failed", self.instance_id,
                          msg.decode_id, msg.req_id)

    def on_abort(self, msg: Abort, frames, ident) -> None:
        queued = [m for m in self.queue if m.req_id == msg.req_id]
        self.queue = collections.deque(m for m in self.queue if m.req_id != msg.req_id)
        for m in queued:
            self._push_failed(m, msg.reason or "aborted")
        if self.layerwise is not None:
            self.layerwise.abort(msg.req_id)  # drop its pending signals: no further part goes
        entry = self.pending.get(msg.req_id)
        # Blocks D may still be reading stay held until D's ack (D acks an aborted request
        # "not ok") or the lease ends -- also when D was declared dead only for missed
        # heartbeats; if D's process exited nobody reads them: free now.
        if (msg.peer_dead and msg.peer_exited) or entry is None or not entry[0]:
            self._release(msg.req_id)
        self.report_blocks()  # the router sees the freed blocks now, not a heartbeat later

    def on_leaserenew(self, msg: LeaseRenew, frames, ident) -> None:
        now = time.monotonic()
        for req_id in msg.req_ids:
            entry = self.pending.get(req_id)
            if entry is not None:
                self.pending[req_id] = (entry[0], entry[1], now)

    def on_kvack(self, msg: KVAck, frames, ident) -> None:
        if not msg.ok:
            log.warning("%s: decode dropped %s: %s", self.instance_id, msg.req_id, msg.error)
        self._release(msg.req_id)

    def _release(self, req_id: str) -> None:
        if self.layerwise is not None:
            self.layerwise.abort(req_id)  # drop pending signals and staging buffers
        entry = self.pending.pop(req_id, None)
        if entry is not None and entry[0]:
            self.allocator.free(entry[0])

    # ---- work -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.queue)

    def num_running(self) -> int:
        return len(self.queue) + len(self.pending)

    def work(self) -> None:
        self._expire()
        msg = self.queue[0]
        link = self.links.get(msg.decode_id)
        if link is None:  # its D was unpaired while the request waited here
            self.queue.popleft()
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=self._not_paired(msg.decode_id)))
            return
        try:
            blocks = self.allocator.allocate(self.spec.num_blocks_for(len(msg.token_ids)))
        except NoFreeBlocksError:
            return  # wait for acks to free blocks
        self.queue.popleft()
        try:
            delay = faults.delay_s("prefill", msg.token_ids)
            end = time.monotonic() + delay
            while time.monotonic() < end:  # test fault: a slow prefill (heartbeats go on, as
                time.sleep(0.05)           # between the chunks of a long one)
                self.heartbeat()
            if self.writer is not None:
                self._prefill_push(msg, blocks, link)
                return
            if self.layerwise is not None and len(msg.token_ids) >= layerwise_min_tokens(self.cfg):
                self._prefill_layerwise(msg, blocks)
                return
            logits = self.engine.prefill(msg.token_ids, blocks,
                                         chunk_size=self.cfg.max_num_batched_tokens)
            first = sample_token(logits, msg.temperature, msg.seed, 0)
            # D holds logical blocks 0..skip_blocks-1 (prefix hit): send only the rest
            keep = self.sender.send(link, msg.req_id, self.cache,
                                    blocks[min(msg.skip_blocks, len(blocks)):], first_token=first,
                                    num_prompt_tokens=len(msg.token_ids))
        except Exception as exc:
            log.exception("%s: prefill of %s failed", self.instance_id, msg.req_id)
            self.allocator.free(blocks)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=f"prefill failed on {self.instance_id}: {exc}"))
            return
        self.messages_sent += 1
        if not self.sender.holds_blocks:
            self.allocator.free(blocks)
            blocks = []
        self.pending[msg.req_id] = (blocks, keep, time.monotonic())

    def _prefill_push(self, msg: Prefill, blocks: list[int], link: zmq.Socket) -> None:
        """Prefill writing the KV into D's blocks (layer by layer from
        ``--layerwise-min-tokens``), then one KVPushed; P's blocks are free once the copies are
        done. A failure still waits for the copies already issued before D hears of it."""
        n = len(msg.token_ids)
        layerwise = self.cfg.transfer_mode == "layerwise" and n >= layerwise_min_tokens(self.cfg)
        try:
            t0 = time.perf_counter()
            logits, stats = self.writer.prefill(
                self.engine, msg.token_ids, blocks, msg.decode_block_ids,
                self.cfg.max_num_batched_tokens, peer_id=msg.decode_id,
                skip_blocks=msg.skip_blocks, layerwise=layerwise)
            first = sample_token(logits, msg.temperature, msg.seed, 0)
            stats.prefill_ms = (time.perf_counter() - t0) * 1e3
            self.writer.finish(stats)
            self.writer.send_done(link, msg.req_id, ok=True, first_token=first,
                                  num_prompt_tokens=n, stats=stats)
        except Exception as exc:
            log.exception("%s: prefill or push of %s failed", self.instance_id, msg.req_id)
            self.writer.finish()
            self.allocator.free(blocks)
            self._push_failed(msg, f"prefill failed on {self.instance_id}: {exc}")
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=f"prefill failed on {self.instance_id}: {exc}"))
            return
        self.allocator.free(blocks)
        self.messages_sent += 1

    def _prefill_layerwise(self, msg: Prefill, blocks: list[int]) -> None:
        """Prefill with every layer signalled and sent as it completes; blocks held to the ack
        (a transfer failure arrives later through :meth:`_fail_transfers`)."""
        logits = self.layerwise.prefill(self.engine, msg.req_id, msg.token_ids, blocks,
                                        self.cfg.max_num_batched_tokens, peer_id=msg.decode_id,
                                        skip_blocks=msg.skip_blocks)
        self.layerwise.finish(msg.req_id, sample_token(logits, msg.temperature, msg.seed, 0))
        self.pending[msg.req_id] = (blocks, None, time.monotonic())

    def _fail_transfers(self) -> None:
        for req_id, exc in self.layerwise.pop_errors():
            log.error("%s: layerwise transfer of %s failed: %s", self.instance_id, req_id, exc)
            self._release(req_id)
            self.send_ctrl(Rejected(req_id=req_id, kind="error",
                                    error=f"layerwise KV transfer of {req_id} from "
                                          f"{self.instance_id} failed: {exc}"))

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id, (_, _, t) in list(self.pending.items()):
            if now - t > self.ack_timeout_s:
                log.error("%s: no ack for %s in %.0f s; blocks freed", self.instance_id, req_id,
                          self.ack_timeout_s)
                self._release(req_id)

    def heartbeat(self, force: bool = False) -> None:
        if self.layerwise is not None:
            self._fail_transfers()
        if self.pending and not self.queue:
            self._expire()
        super().heartbeat(force)

    def close(self) -> None:
        if self.layerwise is not None:
            self.layerwise.close()  # before the ZMQ context ends: it owns a socket
        super().close()
        if self.sender is not None:
            self.sender.close()
