"""``ipc-push``: P writes each request's KV straight into the blocks D allocated (one host).

D exports its cache once (CPU: a 0600 shared-memory segment, :mod:`.transport.shm`; CUDA: one
allocation's IPC handle, :mod:`.transport.cuda_ipc`) and P maps it at pairing (one mapping per
paired D).
The router gives P D's id and block table with the request (``Prefill.decode_id``,
``decode_block_ids``), so P copies its blocks into that D's with
:func:`~kvflow.kernels.copy_blocks` -- on CUDA inside P's own process and CUDA context, where
the copies can run *beside* P's compute kernels (a kernel launched on P's GPU from D's process
is in another context and time-slices with them instead).

Layerwise (prompts of at least ``layerwise_min_tokens``, default 16384: :meth:`KVSender.begin
<kvflow.connector.base.KVSender.begin>` decides): after every group of ``layers_per_copy``
layers of each chunk, the engine's per-layer hook (:meth:`PushSender.chunk_hook`) records an
event on P's compute stream; a copy stream waits on it and copies those layers of the chunk's
blocks. That is a GPU-side dependency: no host round trip, no signal thread, no message per
layer. The copies run beside the next layers' compute on a capped grid (``max_ctas`` programs,
so the prefill keeps its SMs), except the last group of the last chunk, which nothing overlaps
any more: it takes the whole GPU. On CPU the hook copies at once. Shorter prompts are copied
after the prefill. Either way P waits for its copies, then sends one
:class:`~kvflow.connector.messages.KVPushed` (``ok``, first token, timings); D starts decoding on it (the
served P sent the first token to the router already, before waiting for its copies).

A D whose cache spec differs from P's (block_size, NHD/HND, dtype) gets the whole prompt after
the prefill, one re-blocked copy over all layers (:func:`.reblocked.push_prompt`), never layer
by layer. An fp8 D's scales lie in its exported memory (:mod:`kvflow.scales`): P quantizes with
the per-tensor scales D's owner set, and the per-block scales P's copy computes are D's.

Ownership: D's blocks of a request are written by P until P's ``KVPushed`` (ok or not) for it,
so D keeps them allocated until then even if the request ends early (``lent`` blocks,
:mod:`kvflow.connector.lent`), unless P is known dead. P frees its own blocks as soon as its copies
are done (nothing reads them later). Inside a dummy or profile run nothing is copied or sent.
Measurements behind the defaults: docs/design.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.kernels import copy_blocks, payload_bytes
from kvflow.connector.messages import KVPushed, encode

from .base import (KVReceiver, KVSender, Peer, PrefillJob, Prefilling, TransferError,
                   TransferStats, check_send_allowed)
from .layer_copy import LAYERS_PER_COPY, LAYERWISE_MAX_CTAS, LayerCopier, PushStats
from .reblocked import differs, push_prompt, warm
from .transport.shm import map_decode_cache

log = logging.getLogger("kvflow.connector.ipc_push")


class PushSender(KVSender):
    """P's half: maps each paired D's cache at pairing and writes every request into the cache
    of the D that allocated its blocks (``job.decode_id``), never another one's.

    Parameters
    ----------
    spec, device, instance_id, backend, layerwise_min_tokens, max_model_len
        As :class:`~kvflow.connector.base.KVSender`.
    max_ctas : int
        Grid cap of the layerwise copies that overlap compute; the last one and copies after
        the prefill use the whole GPU (the prefill is over).
    layers_per_copy : int
        Layers per layerwise copy launch.

    Raises
    ------
    ValueError
        ``max_ctas`` or ``layers_per_copy`` not an int >= 1.
    """

    name = "ipc-push"
    # 16384 like the other kinds (docs/gpu_serving.md, 2026-12-01): with P's first token sent at
    # once, the copies beside P's compute only slow its prefill below that length (1K TTFT
    # 0.959 x colocated layerwise against 0.820 after the prefill; 8K equal).
    default_layerwise_min_tokens = 16384
    layerwise_ready = True

    def __init__(self, spec, device: Any = "cpu", *, max_ctas: int = LAYERWISE_MAX_CTAS,
                 layers_per_copy: int = LAYERS_PER_COPY, **kw: Any) -> None:
        for name, v in (("max_ctas", max_ctas), ("layers_per_copy", layers_per_copy)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        super().__init__(spec, device, **kw)
        self.max_ctas, self.layers_per_copy = max_ctas, layers_per_copy
        self.peers: dict[str, PagedKVCache] = {}  # paired D -> its mapped cache
        self.cuda = self.device.type == "cuda"
        self.copier: LayerCopier | None = None  # built with the cache

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        cache = super().make_cache(num_blocks)
        self.copier = LayerCopier(cache, self.backend, self.max_ctas, self.layers_per_copy)
        return cache

    # ---- set-up ------------------------------------------------------------------------
    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile both grids of the copies (full and capped), then a chunked prefill of 32
        dummy tokens (computed only: nothing copied or sent)."""
        a = PagedKVCache(self.spec, 2, device=self.device)
        b = PagedKVCache(self.spec, 2, device=self.device)
        for cap in (None, self.max_ctas):
            copy_blocks(a, b, [1], [0], backend=self.backend, max_ctas=cap)
        self.dummy_run(engine, chunk_size)

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """Map D ``peer``'s exported cache writable.

        Raises
        ------
        TransferError
            D exported no cache, or it cannot be mapped.
        """
        if not peer.shm_name:
            raise TransferError(f"decode instance {peer.id} exported no cache to push into "
                                f"(is it running with --kv-connector ipc-push?)")
        self.peers[peer.id] = map_decode_cache(peer.shm_name, peer.spec, peer.num_blocks,
                                               self.device)
        if differs(peer.spec, self.spec):
            warm(self.spec, peer.spec, self.device, self.backend)

    def reblocks(self, decode_id: str) -> bool:
        """D ``decode_id``'s cache spec differs from P's: the prompt moves after the prefill,
        re-blocked (:func:`.reblocked.push_prompt`)."""
        dst = self.peers.get(decode_id)
        return dst is not None and differs(dst.spec, self.spec)

    def detach(self, peer_id: str) -> None:
        """Drop D ``peer_id``'s link and mapping; other D's stay mapped."""
        super().detach(peer_id)
        if self.peers.pop(peer_id, None) is not None and self.cuda and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        super().close()
        self.peers.clear()
        if self.cuda and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    # ---- per request -------------------------------------------------------------------
    def prepare(self, job: PrefillJob, layerwise: bool) -> PushStats:
        """:meth:`plan` (a job D cannot take fails before any compute)."""
        return self.plan(job)

    def send_layerwise(self, job: PrefillJob, first_token: int, stats: PushStats, *,
                       prefill_ms: float = 0.0) -> None:
        """Wait for the layerwise copies, then one ``KVPushed``. D sends no ack: returns None
        (P's blocks are free once this returns). On an error the copies already issued are
        waited for before it propagates."""
        stats.prefill_ms = prefill_ms
        return self._finish(job, first_token, stats)

    def cancel(self, req_id: str, rec: Prefilling) -> None:
        """Wait for the layerwise copies already issued."""
        if rec.layerwise:
            self.copier.finish()

    def send_prefilled(self, job: PrefillJob, first_token: int, *,
                       prefill_ms: float = 0.0) -> None:
        """Copy the prompt's blocks past D's prefix hit into D's blocks (one launch over all
        layers, the whole GPU), wait for it, then one ``KVPushed`` (``prefill_ms``: P's
        prefill before it, reported to D). Returns None (D sends no ack)."""
        check_send_allowed("PushSender.send_prefilled")
        stats = self.plan(job)
        stats.prefill_ms = prefill_ms
        if self.reblocks(job.decode_id):
            t0, stats.t_start = time.perf_counter(), time.time()
            push_prompt(self.cache, stats.dst, job.blocks, job.decode_block_ids,
                        job.num_cached_blocks, len(job.token_ids), job.req_id, self.backend)
            stats.copy_ms = stats.exposed_ms = (time.perf_counter() - t0) * 1e3
            self.send_done(self.links.get(job.decode_id), job.req_id, ok=True,
                           first_token=first_token, num_prompt_tokens=len(job.token_ids),
                           stats=stats)
            return None
        self.copier.start()
        stats.pending = self.copier.pairs(job.blocks, job.decode_block_ids, 0,
                                          self.spec.num_blocks_for(len(job.token_ids)),
                                          job.num_cached_blocks, stats.dst)
        return self._finish(job, first_token, stats)

    def _finish(self, job: PrefillJob, first_token: int, stats: PushStats) -> None:
        """Issue the copy after the prefill (if any), wait for every copy, send ``KVPushed``."""
        try:
            self.copier.finish(stats)
        except BaseException:
            self.copier.finish()
            raise
        self.send_done(self.links.get(job.decode_id), job.req_id, ok=True,
                       first_token=first_token, num_prompt_tokens=len(job.token_ids),
                       stats=stats)

    def fail(self, req_id: str, decode_id: str, error: str) -> None:
        """End a prefill begun for ``req_id`` (its copies are waited for), then tell D
        ``decode_id`` nothing (more) will be written into ``req_id``'s blocks."""
        super().fail(req_id, decode_id, error)
        link = self.links.get(decode_id)
        if link is None:
            return
        try:
            self.send_done(link, req_id, ok=False, error=error)
        except Exception:  # D is gone: nobody holds blocks for this request any more
            log.exception("%s: could not tell %s that %s failed", self.instance_id, decode_id,
                          req_id)

    def plan(self, job: PrefillJob) -> PushStats:
        """Check ``job`` against the attached D's and P's tables; its :class:`PushStats`
        (``dst``: D's mapped cache, None inside a dummy run; ``blocks``, ``payload_bytes``:
        what will be written, in D's spec).

        Raises
        ------
        TransferError
            ``job.decode_id`` is not attached, or a block table is shorter than the prompt.
        """
        blocks, dst_ids = job.blocks, job.decode_block_ids
        n = len(job.token_ids)
        nb = self.spec.num_blocks_for(n)
        dst = self.peers.get(job.decode_id)
        if sends_allowed() and dst is None:
            raise TransferError(f"push to decode instance {job.decode_id!r}, which is not paired "
                                f"with this prefill instance (paired: {sorted(self.peers)})")
        if dst is not None and differs(dst.spec, self.spec):  # push_prompt checks the tables
            m = max(0, dst.spec.num_blocks_for(n) - job.num_cached_blocks)
            return PushStats(dst=dst, blocks=m, payload_bytes=payload_bytes(dst.spec, m))
        if len(dst_ids) < nb or len(blocks) < nb:
            raise TransferError(f"decode_block_ids has {len(dst_ids)} blocks and P's table "
                                f"{len(blocks)}; the {n}-token prompt needs {nb}")
        m = max(0, nb - job.num_cached_blocks)
        return PushStats(dst=dst, blocks=m, payload_bytes=payload_bytes(self.spec, m))

    def chunk_hook(self, job: PrefillJob, stats: PushStats) -> Any:
        """The ``on_chunk`` hook of ``job``'s prefill: each layer group of each chunk is copied
        into D ``job.decode_id``'s blocks ``job.decode_block_ids`` (logical blocks from
        ``job.num_cached_blocks`` on) as soon as it is computed (None inside a dummy run:
        compute only). The copies are issued but may still run on the device until
        :meth:`LayerCopier.finish` (:meth:`send_layerwise`).

        Raises
        ------
        TransferError
            From the hook: a chunk's block ids outside a cache (:meth:`LayerCopier.pairs`).
        """
        if not sends_allowed():  # dummy / profile run: compute only
            return None
        copier, n, bs = self.copier, len(job.token_ids), self.spec.block_size
        copier.start()
        stats.layerwise = True

        def on_chunk(start: int, end: int):
            pairs = copier.pairs(job.blocks, job.decode_block_ids, start // bs, -(-end // bs),
                                 job.num_cached_blocks, stats.dst)
            return None if pairs is None else copier.layer_hook(pairs, stats, end == n)

        return on_chunk

    def send_done(self, link: Any, req_id: str, *, ok: bool, error: str = "",
                  first_token: int = -1, num_prompt_tokens: int = 0,
                  stats: PushStats | None = None) -> None:
        """Tell D the push of ``req_id`` is over (after the copies finished): ``ok`` with the first
        token, or not (nothing more will be written; D may free the blocks).

        Raises
        ------
        RuntimeError
            Inside a dummy/profile run.
        """
        check_send_allowed("PushSender.send_done")
        s = stats or PushStats()
        link.send(encode(KVPushed(req_id=req_id, ok=ok, error=error, first_token=first_token,
                                  num_prompt_tokens=num_prompt_tokens, num_blocks=s.blocks,
                                  payload_bytes=s.payload_bytes, t_start=s.t_start,
                                  t_done=time.time(), copy_ms=s.copy_ms,
                                  exposed_ms=s.exposed_ms, prefill_ms=s.prefill_ms,
                                  layerwise=s.layerwise)))
        self.messages_sent += 1


class PushReceiver(KVReceiver):
    """D's half: exports D's cache at start-up; a ``KVPushed`` says the KV is already in D's
    blocks, so receiving only checks and reports it."""

    name = "ipc-push"
    acks = False
    peer_writes = True

    def __init__(self, spec=None, device: Any = "cpu", *, backend: str = "auto") -> None:
        super().__init__(spec, device, backend=backend)
        self.export_name = ""  # the shm segment (CPU) or published CUDA IPC export

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        """D's cache, exported: one CUDA allocation's IPC handle, or a shared-memory segment."""
        from .transport.shm import export_new_cache
        self.cache, self.export_name = export_new_cache(self.spec, num_blocks, self.device,
                                                        "decode")
        return self.cache

    def warmup(self) -> None:
        a = PagedKVCache(self.spec, 2, device=self.device)
        b = PagedKVCache(self.spec, 2, device=self.device)
        copy_blocks(a, b, [0], [1], backend=self.backend)

    def export(self) -> dict[str, str]:
        return {"shm_name": self.export_name}


    def receive(self, header: Any, frames, cache, dst_ids, peer_id=None) -> TransferStats:
        if not isinstance(header, KVPushed):
            raise TransferError(f"ipc push expects a KVPushed header, got {type(header).__name__}")
        if frames:
            raise TransferError(f"KVPushed carries no payload frames, got {len(frames)}")
        if not header.ok:
            raise TransferError(f"prefill could not push the KV: {header.error or 'no reason given'}")
        if header.num_blocks != len(dst_ids):
            raise TransferError(f"KVPushed for {header.req_id} wrote {header.num_blocks} blocks; "
                                f"D expects {len(dst_ids)}")
        return TransferStats(blocks=header.num_blocks, payload_bytes=header.payload_bytes,
                             copy_ms=header.copy_ms, layerwise=header.layerwise)

    def close(self) -> None:
        if self.export_name:  # the router also removes it if D dies
            from kvflow.segments import unlink
            unlink(self.export_name)
            self.export_name = ""
