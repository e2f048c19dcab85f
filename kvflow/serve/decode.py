"""The decode instance (D); the colocated instance (:mod:`kvflow.serve.colocated`) reuses it.

D, per request: ``Allocate`` -> admission (:func:`kvflow.sched.admission_check`) and D's *own*
blocks for prompt + max_tokens (the block table is D's; P's ids only say where to read) ->
ALLOCATED -> the KV arrives from P (``KVReady``: pull with copy_blocks; ``KVData``: scatter
the frames) into the first ``ceil(prompt_len / block_size)`` blocks of D's table -> RECEIVING
-> DECODING: the first token (sampled by P) is emitted, then one token per decode step; all
running requests of D step together (continuous batching) -> DONE. Abort, transfer error and
timeout (``receive_timeout_s`` without KV) end the request too; every end frees its blocks.

Prefix cache (``--enable-prefix-caching``): D looks the prompt's full blocks up in its
:class:`~kvflow.sched.PrefixCache`; a hit on logical blocks ``0..k-1`` puts those (shared,
ref-counted) blocks first in the new table and answers ``Allocated(num_cached_blocks=k)``;
P then sends only its logical blocks ``k..n-1``, which land in D's ``table[k:n]`` (paired by
logical position). ``k`` may be every prompt block: nothing moves, the first token still
arrives. Blocks enter the cache once their KV arrived. Evictable cached blocks count as free
in heartbeats (``free_blocks``) and are evicted, least recently used first, when needed.

Lease: every heartbeat D sends P a :class:`~kvflow.protocol.LeaseRenew` naming the requests
whose KV it still means to read; P frees sent blocks whose lease (``kv_lease_s``) ran out.
Before pulling from P's shared cache (ipc), D checks that P's lease still holds (with a 20%
margin) and otherwise refuses the transfer rather than read blocks P may have reused.

Push (P writes into D's blocks): blocks of a request that ended before P's ``KVPushed`` stay
*lent* -- never reused while the writing process exists. They come back on P's ``KVPushed``;
when P's process is gone (judged as the router judges instances: P's pid, only when P's host
id equals D's, :mod:`kvflow.serve.liveness`; or the router saw it exit, ``Abort.peer_exited``);
or, for a P that D cannot judge (another pid namespace), ``kv_lease_s`` after the router
declared it dead. A router's "dead" alone (missed heartbeats: a slow prefill) frees nothing.

"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import zmq

from kvflow.cache import PagedKVCache
from kvflow.protocol import (Abort, Allocate, Allocated, KVAck, KVPushed, LeaseRenew, Pair,
                             PairResult, Rejected, Tokens)
from kvflow.sched import (AdmissionError, DecodeState, NoFreeBlocksError,
                          PrefixCache, Request, admission_check)

from . import faults
from .instance import Instance, check_peer, sample_token, stop_reason, uses_push

log = logging.getLogger("kvflow.serve.decode")


@dataclasses.dataclass
class Seq:
    """A request live on this instance, with what decoding needs beyond :class:`Request`."""
    req: Request
    seed: int
    ignore_eos: bool
    kvflow: dict[str, Any] = dataclasses.field(default_factory=dict)
    t_alloc: float = dataclasses.field(default_factory=time.monotonic)
    num_cached: int = 0             # logical blocks 0..num_cached-1 came from the prefix cache
    t_renewed: float = 0.0          # time.time() of the last LeaseRenew that named it


@dataclasses.dataclass
class Lent:
    """Blocks of an ended request that a P may still write (ipc push): freed on its KVPushed or
    once that P's process is gone; ``prefill_id`` is "" until the router's Abort names it;
    ``dead_at`` (monotonic) when the router declared that P dead, ``exited`` when it saw the
    process exit."""
    blocks: list[int]
    prefill_id: str = ""
    since: float = dataclasses.field(default_factory=time.monotonic)
    warned: bool = False
    dead_at: float = 0.0
    exited: bool = False


class DecodeInstance(Instance):
    role = "decode"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.receive_timeout_s = float(getattr(cfg, "receive_timeout_s", 120.0))
        self.kv_lease_s = float(getattr(cfg, "kv_lease_s", 5.0))
        self.seqs: dict[str, Seq] = {}
        self.inflight: dict[str, tuple[Any, list, Any, float]] = {}  # req -> (msg, frames, ident, due)
        self.data: zmq.Socket | None = None
        self.data_addr = ""
        self.peer_id = ""
        self.receiver = None
        self.prefix: PrefixCache | None = None
        self.states = DecodeState
        self.push = uses_push(cfg)  # P writes into this cache (kvflow.transfer.push)
        self.export_name = ""        # push: D's exported cache (shm segment / CUDA IPC export)
        self._shared = None
        # push: blocks of requests that ended before their P said it is done writing them
        self.lent: dict[str, Lent] = {}
        self.peer_pids: dict[str, int] = {}  # paired P -> its pid (one host: liveness)
        self.peer_hosts: dict[str, str] = {}  # paired P -> its host id (pids comparable if ours)
        self.gone_peers: set[str] = set()     # P's whose process D saw gone
        self._last_peer_check = 0.0

    def startup(self) -> None:
        super().startup()
        if getattr(self.cfg, "enable_prefix_caching", False):
            self.prefix = PrefixCache(self.allocator, self.spec.block_size)

    def free_blocks(self) -> int:
        """Blocks a new request can get: free ones plus evictable prefix-cache blocks."""
        return self.allocator.num_free + (self.prefix.num_evictable if self.prefix else 0)

    # ---- start-up -------------------------------------------------------------------
    def make_cache(self, num_blocks: int) -> PagedKVCache:
        if not self.push:
            return super().make_cache(num_blocks)
        if str(self.cfg.device).startswith("cuda"):  # one allocation, CUDA IPC export
            from kvflow.transfer.cuda_ipc import export_cache, publish_export
            cache = super().make_cache(num_blocks)
            self.export_name = publish_export(export_cache(cache), role="decodecuda")
            return cache
        from kvflow.transfer.ipc import SharedCache, clean_stale_segments
        clean_stale_segments()
        self._shared = SharedCache(self.spec, num_blocks, role="decode")
        self.export_name = self._shared.name
        return self._shared.cache

    def warmup(self) -> None:
        from kvflow.transfer import make_receiver
        self.receiver = make_receiver(self.cfg.transfer, self.cfg.backend)
        if self.push:
            from kvflow.transfer.push import PushReceiver  # P writes; D only checks
            self.receiver = PushReceiver(self.cfg.backend)
        elif self.cfg.transfer == "ipc" and str(self.cfg.device).startswith("cuda"):
            from kvflow.transfer.cuda_ipc import CudaIpcReceiver  # opens P's CUDA IPC handle
            self.receiver = CudaIpcReceiver(self.cfg.backend)
        from kvflow.kernels import copy_blocks, scatter_blocks
        from kvflow.cache import staging_buffer
        a = PagedKVCache(self.spec, 2, device=self.cfg.device)
        b = PagedKVCache(self.spec, 2, device=self.cfg.device)
        if self.cfg.transfer == "ipc":
            copy_blocks(a, b, [0], [1], backend=self.cfg.backend)
        else:
            scatter_blocks(staging_buffer(a.spec, 1, device=self.cfg.device), b, [1],
                           backend=self.cfg.backend)

    def open_channels(self) -> None:
        super().open_channels()
        self.data = self.ctx.socket(zmq.ROUTER)
        # a P paired anew (it registered again) reconnects under the same identity: let the
        # new connection take over instead of being refused while the old one lingers
        self.data.setsockopt(zmq.ROUTER_HANDOVER, 1)
        port = self.data.bind_to_random_port(f"tcp://{self.cfg.host}")
        self.data_addr = f"tcp://{self.cfg.host}:{port}"
        self.sockets[self.data] = "prefill link"

    def register_extra(self) -> dict[str, str]:
        return {"data_addr": self.data_addr, "shm_name": self.export_name}

    # ---- control handlers -----------------------------------------------------------
    def on_pair(self, msg: Pair, frames, ident) -> None:
        error = check_peer(self, msg)
        if not error:
            try:
                self.receiver.attach(msg.peer_id, self.spec, msg.peer_num_blocks, msg.shm_name)
                self.peer_id = msg.peer_id
                self.peer_pids[msg.peer_id] = msg.peer_pid
                self.peer_hosts[msg.peer_id] = msg.peer_host_id
                self._check_peers()
            except Exception as exc:
                error = f"cannot attach to {msg.peer_id}'s cache: {exc}"
        if error:
            log.error("%s: %s", self.instance_id, error)
        self.send_ctrl(PairResult(instance_id=self.instance_id, peer_id=msg.peer_id,
                                  ok=not error, error=error))

    def on_allocate(self, msg: Allocate, frames, ident) -> None:
        n = len(msg.token_ids)
        if msg.req_id in self.seqs or msg.req_id in self.lent:  # live, or its blocks still lent
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error", error=(
                f"request id {msg.req_id} is already live on decode instance {self.instance_id}; "
                f"a second Allocate with it is refused")))
            return
        try:
            need = admission_check(max(n, 1), msg.max_tokens, max_model_len=self.max_model_len,
                                   num_blocks=self.num_blocks, block_size=self.spec.block_size)
            blocks = self._allocate(msg.token_ids, need)
        except (AdmissionError, ValueError) as exc:
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="capacity", error=str(exc),
                                    param=getattr(exc, "param", "prompt")))
            return
        except NoFreeBlocksError as exc:
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="busy", error=str(exc)))
            return
        cached, blocks = blocks
        req = Request(request_id=msg.req_id, prompt_token_ids=list(msg.token_ids),
                      max_tokens=msg.max_tokens, temperature=msg.temperature, role=self.role)
        req.set_block_table(blocks)  # D's own table: replaces anything P used
        self.seqs[msg.req_id] = Seq(req, msg.seed, msg.ignore_eos, num_cached=cached)
        self.send_ctrl(Allocated(req_id=msg.req_id, block_ids=blocks, num_cached_blocks=cached))

    def _allocate(self, token_ids: list[int], need: int) -> tuple[int, list[int]]:
        """(k, table): the prefix-cache hit (logical blocks 0..k-1) then ``need - k`` new
        blocks, evicting unused cached blocks if short. Raises NoFreeBlocksError (nothing
        kept) when even eviction cannot make room."""
        cached = self.prefix.match(token_ids, max_blocks=need) if self.prefix else []
        short = need - len(cached) - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        try:
            return len(cached), cached + self.allocator.allocate(need - len(cached))
        except NoFreeBlocksError:
            self.allocator.free(cached)
            raise

    def on_abort(self, msg: Abort, frames, ident) -> None:
        # push: a P that got the Prefill may still write the blocks, even one the router
        # declared dead (a slow prefill misses heartbeats): they stay lent (_settle_lent)
        self._end(msg.req_id, self.states.ABORTED, msg.reason or "aborted", notify=False,
                  lend=msg.prefill_sent)
        entry = self.lent.get(msg.req_id)
        if entry is not None:
            entry.prefill_id = msg.prefill_id or entry.prefill_id
            if msg.peer_dead and msg.peer_dead == entry.prefill_id:
                entry.dead_at = entry.dead_at or time.monotonic()
                entry.exited = entry.exited or msg.peer_exited
            self._settle_lent()
        self.report_blocks()  # the router sees the freed blocks now, not a heartbeat later

    def _free_lent(self, req_ids: list[str]) -> None:
        for r in req_ids:
            entry = self.lent.pop(r, None)
            if entry is not None:
                self.allocator.free(entry.blocks)

    def _settle_lent(self) -> None:
        """Give back lent blocks whose writer can write no more: its process is gone, or D
        cannot judge it and ``kv_lease_s`` has passed since the router declared it dead."""
        from .liveness import DEAD, UNKNOWN, process_state
        now = time.monotonic()
        done = []
        for req_id, e in self.lent.items():
            p = e.prefill_id
            state = DEAD if e.exited or p in self.gone_peers else \
                process_state(self.peer_pids.get(p, 0), self.peer_hosts.get(p, ""))
            if state == DEAD or (state == UNKNOWN and e.dead_at
                                 and now - e.dead_at >= self.kv_lease_s):
                done.append(req_id)
        self._free_lent(done)

    def _check_peers(self) -> None:
        """Forget P's whose process is gone (judged only on this host and pid namespace):
        drop their mappings and give back the blocks lent to them (a dead P writes nothing
        more)."""
        if self.cfg.transfer != "ipc":  # tcp peers may live on other hosts
            return
        from .liveness import DEAD, process_state
        for peer, pid in list(self.peer_pids.items()):
            if process_state(pid, self.peer_hosts.get(peer, "")) == DEAD:
                del self.peer_pids[peer]
                self.gone_peers.add(peer)
                self.receiver.detach(peer)
                log.warning("%s: prefill instance %s (pid %d) is gone", self.instance_id, peer, pid)
        self._settle_lent()
    # ---- transfer handlers ----------------------------------------------------------
    def on_kvready(self, msg, frames, ident) -> None:
        self._arrive(msg, frames, ident)

    def on_kvdata(self, msg, frames, ident) -> None:
        self._arrive(msg, frames, ident)

    def on_kvpushed(self, msg: KVPushed, frames, ident) -> None:
        if msg.req_id in self.lent:  # ended here meanwhile: P is done with the blocks now
            self._free_lent([msg.req_id])
            return
        self._arrive(msg, frames, ident)

    def on_kvlayer(self, msg, frames, ident) -> None:
        # layerwise parts come from P's sender thread; D acks to P's control link (reply_to)
        self._arrive(msg, frames, msg.reply_to.encode())

    def _arrive(self, msg, frames, ident) -> None:
        seq = self.seqs.get(msg.req_id)
        if seq is None or seq.req.state not in (DecodeState.ALLOCATED, DecodeState.RECEIVING) \
                or msg.req_id in self.inflight:  # late, aborted or unknown: ignored
            if not isinstance(msg, KVPushed):  # P waits for no ack of a push
                self.send(self.data, KVAck(req_id=msg.req_id, ok=False,
                                           error="unknown or aborted request"), ident=ident)
            return
        if seq.req.state is DecodeState.ALLOCATED:
            seq.req.transition(DecodeState.RECEIVING)
        delay = faults.delay_s("receive", seq.req.prompt_token_ids)
        if delay:  # test fault: the transfer stays in flight; abort or kill D meanwhile
            self.inflight[msg.req_id] = (msg, [bytes(getattr(f, "buffer", f)) for f in frames],
                                         ident, time.monotonic() + delay)
            return
        self._receive(msg, frames, ident)

    def _lease_ok(self, msg, seq: Seq) -> bool:
        """P's lease on the sent blocks still holds (20% margin); only ipc reads P's memory."""
        if self.cfg.transfer != "ipc" or self.push or not getattr(msg, "t_start", 0.0):
            return True
        start = max(msg.t_start, seq.t_renewed if seq.t_renewed >= msg.t_start else 0.0)
        return time.time() - start < 0.8 * self.kv_lease_s

    def _receive(self, msg, frames, ident) -> None:
        seq = self.seqs[msg.req_id]
        req = seq.req
        n = self.spec.num_blocks_for(len(req.prompt_token_ids))
        try:
            if not self._lease_ok(msg, seq):
                raise TimeoutError(f"P's lease of {self.kv_lease_s:g} s on the sent blocks "
                                   f"expired before D could read them")
            # logical blocks 0..num_cached-1 are D's prefix-cache hit; P sends the rest
            stats = self.receiver.receive(msg, frames, self.cache, req.block_table[seq.num_cached:n],
                                          ident.decode() if ident else None)
        except Exception as exc:
            log.exception("%s: transfer of %s failed", self.instance_id, msg.req_id)
            pushed = isinstance(msg, KVPushed)  # P is done with D's blocks: free them now
            if not pushed:
                self.send(self.data, KVAck(req_id=msg.req_id, ok=False, error=str(exc)), ident=ident)
            self._end(msg.req_id, DecodeState.FAILED, f"KV transfer failed: {exc}", lend=not pushed)
            return
        if stats is None:  # a layerwise part: more layers to come
            return
        now = time.time()
        transfer_ms = (now - msg.t_start) * 1e3 if msg.t_start else 0.0
        if not isinstance(msg, KVPushed):
            self.send(self.data, KVAck(req_id=msg.req_id, ok=True), ident=ident)
        seq.kvflow = {"prefill_instance": ident.decode() if ident else self.peer_id,
                      "decode_instance": self.instance_id, "transfer": self.cfg.transfer,
                      "blocks": stats.blocks, "payload_bytes": stats.payload_bytes,
                      "transfer_ms": round(transfer_ms, 3), "copy_ms": round(stats.copy_ms, 3),
                      "gather_ms": round(getattr(msg, "gather_ms", 0.0), 3),
                      "block_table": list(req.block_table), "cached_blocks": seq.num_cached,
                      "transfer_mode": "layerwise" if type(msg).__name__ == "KVLayer"
                      or getattr(msg, "layerwise", False) else "request",
                      "ipc_direction": None if self.cfg.transfer != "ipc"
                      else "push" if self.push else "pull"}
        digest = faults.kv_digest(self.cache, req.block_table, len(req.prompt_token_ids))
        if digest is not None:
            seq.kvflow["kv_digest"] = digest
        if isinstance(msg, KVPushed):  # the part P waited for after the prefill, + the message
            seq.kvflow["exposed_ms"] = round(msg.exposed_ms + max(0.0, now - msg.t_done) * 1e3, 3)
            seq.kvflow["prefill_ms"] = round(msg.prefill_ms, 3)
        if self.prefix is not None:  # the prompt's full blocks now hold their KV
            self.prefix.insert(req.prompt_token_ids, req.block_table[:n])
        req.transition(DecodeState.DECODING)
        self._emit(seq, msg.first_token)

    # ---- decoding -------------------------------------------------------------------
    def _emit(self, seq: Seq, token: int) -> None:
        req = seq.req
        req.append_token(token)
        reason = stop_reason(token, len(req.output_token_ids), req.max_tokens, req.num_tokens,
                             self.max_model_len, self.tokenizer.eos_token_id, seq.ignore_eos)
        first = len(req.output_token_ids) == 1
        self.send_ctrl(Tokens(req_id=req.request_id, token_ids=[token], finished=bool(reason),
                              finish_reason=reason, kvflow=seq.kvflow if first else {}))
        if reason:
            self._end(req.request_id, self.states.DONE, "", notify=False)

    def _end(self, req_id: str, state, error: str, *, notify: bool = True,
             lend: bool = True) -> None:
        """End a live request and free its blocks -- or, with push, keep them "lent" while P
        may still write them (``lend``: the Prefill went out and P has not said it is done)."""
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return
        held = self.inflight.pop(req_id, None)
        if held is not None and isinstance(held[0], KVPushed):
            lend = False  # P's KVPushed already came: it writes nothing more
        elif held is not None:  # a transfer in flight is dropped; P may free its blocks
            self.send(self.data, KVAck(req_id=req_id, ok=False, error=error or "aborted"),
                      ident=held[2])
        if self.push and lend and seq.req.state in (DecodeState.ALLOCATED, DecodeState.RECEIVING):
            self.lent[req_id] = Lent(list(seq.req.block_table))
        else:
            self.allocator.free(seq.req.block_table)
        if self.receiver is not None:
            self.receiver.forget(req_id)  # drop a partly received layerwise transfer
        if not seq.req.finished:
            seq.req.transition(state, error=error or None)
        if notify:
            self.send_ctrl(Tokens(req_id=req_id, token_ids=[], finished=True,
                                  finish_reason="error", error=error))

    def close(self) -> None:
        super().close()
        if self.export_name:  # the router also removes it if D dies
            from kvflow.transfer.shm import unlink_segment
            unlink_segment(self.export_name)

    def running(self) -> list[Seq]:
        return [s for s in self.seqs.values() if s.req.state is self.states.DECODING]

    def has_work(self) -> bool:
        return any(s.req.state is self.states.DECODING for s in self.seqs.values())

    def num_running(self) -> int:
        return len(self.seqs)

    def work(self) -> None:
        batch = self.running()
        items = [(s.req.output_token_ids[-1], s.req.num_tokens - 1, s.req.block_table) for s in batch]
        try:
            logits = self.engine.decode(items)
        except Exception as exc:
            log.exception("%s: decode step failed", self.instance_id)
            for s in batch:
                self._end(s.req.request_id, self.states.FAILED, f"decode failed: {exc}")
            return
        for i, s in enumerate(batch):
            req = s.req
            self._emit(s, sample_token(logits[i], req.temperature, s.seed, len(req.output_token_ids)))

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_peer_check >= (0.1 if self.lent else 1.0):
            self._last_peer_check = now
            self._check_peers()
        for req_id, entry in self.lent.items():
            if not entry.warned and now - entry.since > self.receive_timeout_s:
                # P may still write these blocks: they stay lent until its KVPushed or its death
                entry.warned = True
                log.warning("%s: ended request %s still waits for KVPushed from %s after %g s; "
                            "its blocks stay held", self.instance_id, req_id,
                            entry.prefill_id or "its prefill instance", self.receive_timeout_s)
        for req_id, (msg, frames, ident, due) in list(self.inflight.items()):
            if now >= due:
                del self.inflight[req_id]
                self._receive(msg, frames, ident)
        waiting = []
        for req_id, s in list(self.seqs.items()):
            if s.req.state in (DecodeState.ALLOCATED, DecodeState.RECEIVING) \
                    and now - s.t_alloc > self.receive_timeout_s:
                self._end(req_id, DecodeState.TIMED_OUT,
                          f"no KV from prefill within {self.receive_timeout_s:g} s")
            elif s.req.state in (DecodeState.ALLOCATED, DecodeState.RECEIVING):
                waiting.append(s.req.request_id)
        if waiting and self.peer_id and (force or now - self._last_hb >= self.cfg.heartbeat_s):
            self._renew(waiting)
        super().heartbeat(force)

    def _renew(self, req_ids: list[str]) -> None:
        """LeaseRenew to every paired P (D does not know which one prefills a request before
        its KV arrives; a P ignores ids it does not hold) for requests D still means to read."""
        wall = time.time()
        for peer in self.peer_pids or [self.peer_id]:
            self.send(self.data, LeaseRenew(req_ids=req_ids), ident=peer.encode())
        for r in req_ids:
            self.seqs[r].t_renewed = wall

