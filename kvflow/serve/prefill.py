"""The prefill instance (P): runs each request's prefill in its own blocks, samples the first
token, and hands the KV to the decode instance (D) that the router paired it with.

Per request: WAITING (queued) -> PREFILLING (engine.prefill, chunked by
``max_num_batched_tokens``) -> SENDING (ipc: D pulls from P's shared cache, P's blocks stay
held; tcp: gathered into a staging buffer and sent, P's blocks freed at once) -> DONE on D's
:class:`~kvflow.protocol.KVAck`. An :class:`~kvflow.protocol.Abort`, a failed prefill or an ack
that never comes (``ack_timeout_s``) also frees the blocks.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

import zmq

from kvflow.cache import PagedKVCache
from kvflow.protocol import Abort, KVAck, Pair, PairResult, Prefill, Rejected
from kvflow.sched import NoFreeBlocksError

from .instance import Instance, check_pairing, sample_token

log = logging.getLogger("kvflow.serve.prefill")


class PrefillInstance(Instance):
    role = "prefill"
    ack_timeout_s = 30.0

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.queue: collections.deque[Prefill] = collections.deque()
        self.pending: dict[str, tuple[list[int], Any, float]] = {}  # req -> (blocks, keep, t)
        self.link: zmq.Socket | None = None
        self.peer_id = ""
        self.sender = None
        self.shared = None

    # ---- start-up -------------------------------------------------------------------
    def make_cache(self, num_blocks: int) -> PagedKVCache:
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

    def warmup(self) -> None:
        from kvflow.kernels import gather_blocks
        from kvflow.cache import staging_buffer
        scratch = PagedKVCache(self.spec, 2, device=self.cfg.device)
        gather_blocks(scratch, [1], staging_buffer(scratch.spec, 1, device=self.cfg.device),
                      backend=self.cfg.backend)

    def register_extra(self) -> dict[str, str]:
        return self.sender.export()

    # ---- handlers -------------------------------------------------------------------
    def on_pair(self, msg: Pair, frames, ident) -> None:
        error = check_pairing(self.spec, self.instance_id, msg.peer_spec, msg.peer_id)
        if not error:
            if self.link is not None:
                self.sockets.pop(self.link, None)
                self.link.close(0)
            self.link = self.ctx.socket(zmq.DEALER)
            self.link.setsockopt(zmq.IDENTITY, self.instance_id.encode())
            self.link.connect(msg.data_addr)
            self.sockets[self.link] = f"decode {msg.peer_id}"
            self.peer_id = msg.peer_id
        else:
            log.error("%s: %s", self.instance_id, error)
        self.send_ctrl(PairResult(instance_id=self.instance_id, peer_id=msg.peer_id,
                                  ok=not error, error=error))

    def on_prefill(self, msg: Prefill, frames, ident) -> None:
        need = self.spec.num_blocks_for(len(msg.token_ids))
        if need > self.num_blocks or len(msg.token_ids) > self.max_model_len:
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="capacity",
                                    error=f"prompt of {len(msg.token_ids)} tokens needs {need} "
                                          f"blocks; prefill instance {self.instance_id} has "
                                          f"{self.num_blocks} (max_model_len {self.max_model_len})"))
            return
        self.queue.append(msg)

    def on_abort(self, msg: Abort, frames, ident) -> None:
        self.queue = collections.deque(m for m in self.queue if m.req_id != msg.req_id)
        self._release(msg.req_id)

    def on_kvack(self, msg: KVAck, frames, ident) -> None:
        if not msg.ok:
            log.warning("%s: decode dropped %s: %s", self.instance_id, msg.req_id, msg.error)
        self._release(msg.req_id)

    def _release(self, req_id: str) -> None:
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
        try:
            blocks = self.allocator.allocate(self.spec.num_blocks_for(len(msg.token_ids)))
        except NoFreeBlocksError:
            return  # wait for acks to free blocks
        self.queue.popleft()
        if self.link is None:
            self.allocator.free(blocks)
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=f"prefill instance {self.instance_id} is not paired"))
            return
        try:
            delay = float(os.environ.get("KVFLOW_FAULT_PREFILL_DELAY_S", "0") or 0)
            if delay:  # fault injection for tests: a slow prefill to kill P in the middle of
                time.sleep(delay)
            logits = self.engine.prefill(msg.token_ids, blocks,
                                         chunk_size=self.cfg.max_num_batched_tokens)
            first = sample_token(logits, msg.temperature, msg.seed, 0)
            keep = self.sender.send(self.link, msg.req_id, self.cache, blocks, first_token=first,
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

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id, (_, _, t) in list(self.pending.items()):
            if now - t > self.ack_timeout_s:
                log.error("%s: no ack for %s in %.0f s; blocks freed", self.instance_id, req_id,
                          self.ack_timeout_s)
                self._release(req_id)

    def heartbeat(self, force: bool = False) -> None:
        if self.pending and not self.queue:
            self._expire()
        super().heartbeat(force)

    def close(self) -> None:
        super().close()
        if self.sender is not None:
            self.sender.close()
