"""``ipc-push`` (one host): P maps D's exported cache and copies each request's blocks into the
ones D allocated, per layer group (:mod:`.layer_copy`) or after the prefill (re-blocked:
:func:`.reblocked.push_prompt`), then one ``KVPushed``; D keeps the blocks lent until then
(:mod:`.lent`). docs/gpu_serving.md, "`ipc-push` (the default on CUDA): P writes into D's
cache, layer by layer".
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.kernels import payload_bytes
from kvflow.connector.messages import KVPushed, encode

from .base import (KVReceiver, KVSender, Peer, PrefillJob, Prefilling, TransferError,
                   TransferStats, check_send_allowed)
from .layer_copy import LAYERS_PER_COPY, LAYERWISE_MAX_CTAS, LayerCopier, PushStats
from .reblocked import push_prompt, warm
from .records import ExportedCache, warm_copy
from .transport.shm import map_decode_cache

log = logging.getLogger("kvflow.connector.ipc_push")


class PushSender(KVSender):
    """P's half: maps each paired D's cache and writes each request into its D's. Arguments: as
    :class:`~kvflow.connector.base.KVSender`, and ``max_ctas``, ``layers_per_copy`` (ints >= 1)."""

    name = "ipc-push"
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

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile both grids of the copies (full and capped), then a dummy chunked prefill."""
        warm_copy(self.spec, self.device, self.backend, None, self.max_ctas)
        self.dummy_run(engine, chunk_size)

    def _attach(self, peer: Peer, ctx: Any) -> None:
        """Map D ``peer``'s exported cache writable (TransferError: none exported, or it cannot
        be mapped)."""
        if not peer.shm_name:
            raise TransferError(f"decode instance {peer.id} exported no cache to push into "
                                f"(is it running with --kv-connector ipc-push?)")
        self.peers[peer.id] = map_decode_cache(peer.shm_name, peer.spec, peer.num_blocks,
                                               self.device)
        if peer.spec != self.spec:
            warm(self.spec, peer.spec, self.device, self.backend)

    def reblocks(self, decode_id: str) -> bool:
        dst = self.peers.get(decode_id)
        return dst is not None and dst.spec != self.spec

    def detach(self, peer_id: str) -> None:
        super().detach(peer_id)
        if self.peers.pop(peer_id, None) is not None:
            self._ipc_collect()

    def _ipc_collect(self) -> None:
        if self.cuda and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        super().close()
        self.peers.clear()
        self._ipc_collect()

    def prepare(self, job: PrefillJob, layerwise: bool) -> PushStats:
        return self.plan(job)

    def send_layerwise(self, job: PrefillJob, first_token: int, stats: PushStats, *,
                       prefill_ms: float = 0.0) -> None:
        """Wait for the layerwise copies, then one ``KVPushed``; returns None (D sends no
        ack). On an error the copies already issued are waited for before it propagates."""
        stats.prefill_ms = prefill_ms
        return self._finish(job, first_token, stats)

    def cancel(self, req_id: str, rec: Prefilling) -> None:
        if rec.layerwise:
            self.copier.finish()

    def send_prefilled(self, job: PrefillJob, first_token: int, *,
                       prefill_ms: float = 0.0) -> None:
        """Copy the prompt's blocks past D's prefix hit into D's (one launch over all layers),
        wait for it, then one ``KVPushed``; returns None (D sends no ack)."""
        check_send_allowed("PushSender.send_prefilled")
        stats = self.plan(job)
        stats.prefill_ms = prefill_ms
        if self.reblocks(job.decode_id):
            t0, stats.t_start = time.perf_counter(), time.time()
            push_prompt(self.cache, stats.dst, job.blocks, job.decode_block_ids,
                        job.num_cached_blocks, len(job.token_ids), job.req_id, self.backend)
            stats.copy_ms = stats.exposed_ms = (time.perf_counter() - t0) * 1e3
            return self._pushed(job, first_token, stats)
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
        self._pushed(job, first_token, stats)

    def _pushed(self, job: PrefillJob, first_token: int, stats: PushStats) -> None:
        self.send_done(self.links.get(job.decode_id), job.req_id, ok=True,
                       first_token=first_token, num_prompt_tokens=len(job.token_ids),
                       stats=stats)

    def fail(self, req_id: str, decode_id: str, error: str) -> None:
        """End a prefill begun for ``req_id`` (its copies are waited for), then tell D
        ``decode_id`` nothing more will be written into ``req_id``'s blocks."""
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
        """``job``'s :class:`PushStats` (``dst``: D's mapped cache, None in a dummy run; what will
        be written, in D's spec). TransferError: D not attached, or a table short of the prompt."""
        n, dst = len(job.token_ids), self.peers.get(job.decode_id)
        if sends_allowed() and dst is None:
            raise TransferError(f"push to decode instance {job.decode_id!r}, which is not paired "
                                f"with this prefill instance (paired: {sorted(self.peers)})")
        spec = dst.spec if dst is not None and dst.spec != self.spec else self.spec
        nb = spec.num_blocks_for(n)
        # re-blocked: push_prompt checks the tables
        if spec is self.spec and (len(job.decode_block_ids) < nb or len(job.blocks) < nb):
            raise TransferError(f"decode_block_ids has {len(job.decode_block_ids)} blocks and "
                                f"P's table {len(job.blocks)}; the {n}-token prompt needs {nb}")
        m = max(0, nb - job.num_cached_blocks)
        return PushStats(dst=dst, blocks=m, payload_bytes=payload_bytes(spec, m))

    def chunk_hook(self, job: PrefillJob, stats: PushStats) -> Any:
        """The ``on_chunk`` hook of ``job``'s prefill (None in a dummy run): each layer group of a
        chunk is copied into D's blocks once computed; TransferError for ids outside a cache."""
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
        """Tell D the push of ``req_id`` is over: ``ok`` with the first token, or not (nothing
        more will be written). RuntimeError inside a dummy/profile run."""
        check_send_allowed("PushSender.send_done")
        s = stats or PushStats()
        link.send(encode(KVPushed(req_id=req_id, ok=ok, error=error, first_token=first_token,
                                  num_prompt_tokens=num_prompt_tokens, num_blocks=s.blocks,
                                  payload_bytes=s.payload_bytes, t_start=s.t_start,
                                  t_done=time.time(), copy_ms=s.copy_ms,
                                  exposed_ms=s.exposed_ms, prefill_ms=s.prefill_ms,
                                  layerwise=s.layerwise)))
        self.messages_sent += 1


def pushed_stats(header: KVPushed, frames, dst_ids, failed: str) -> TransferStats:
    """The stats of a ``KVPushed``; TransferError (``failed``: the text for ``ok=False``) for
    payload frames, a failed push, or another number of blocks than ``dst_ids``."""
    if frames:
        raise TransferError(f"KVPushed carries no payload frames, got {len(frames)}")
    if not header.ok:
        raise TransferError(f"{failed}: {header.error or 'no reason given'}")
    if header.num_blocks != len(dst_ids):
        raise TransferError(f"KVPushed for {header.req_id} wrote {header.num_blocks} blocks; "
                            f"D expects {len(dst_ids)}")
    return TransferStats(blocks=header.num_blocks, payload_bytes=header.payload_bytes,
                         copy_ms=header.copy_ms, layerwise=header.layerwise)


class PushReceiver(ExportedCache, KVReceiver):
    """D's half: exports D's cache; a ``KVPushed`` says the KV is in D's blocks already."""

    name = "ipc-push"
    acks = False
    peer_writes = True
    export_role = "decode"

    def warmup(self) -> None:
        warm_copy(self.spec, self.device, self.backend)

    def receive(self, header: Any, frames, cache, dst_ids, peer_id=None) -> TransferStats:
        if not isinstance(header, KVPushed):
            raise TransferError(f"ipc push expects a KVPushed header, got {type(header).__name__}")
        return pushed_stats(header, frames, dst_ids, "prefill could not push the KV")

    def close(self) -> None:
        self.unexport()
