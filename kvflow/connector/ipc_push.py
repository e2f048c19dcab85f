"""``ipc`` push: P writes each request's KV straight into the blocks D allocated.

D exports its cache once (CPU: a 0600 shared-memory segment; CUDA: one allocation's IPC handle,
:mod:`kvflow.transfer.cuda_ipc`) and P maps it at pairing (one mapping per paired D). The
router gives P D's id and block table with the request (``Prefill.decode_id``,
``decode_block_ids``), so P copies its blocks into that D's with
:func:`~kvflow.kernels.copy_blocks` -- on CUDA inside P's own process and CUDA context, where
the copies can run *beside* P's compute kernels (a kernel launched on P's GPU from D's process
is in another context and time-slices with them instead).

Layerwise (:meth:`PushWriter.prefill` with ``layerwise=True``): after every group of
``layers_per_copy`` layers of each chunk, the engine's hook records an event on P's compute
stream; a copy stream waits on it and copies those layers of the chunk's blocks. That is a
GPU-side dependency: no host round trip, no signal thread, no message per layer. The copies run
beside the next layers' compute on a capped grid (``max_ctas`` programs, so the prefill keeps
its SMs), except the last group of the last chunk, which nothing overlaps any more: it takes the
whole GPU. On CPU the hook copies at once.
Request mode copies all layers after the prefill. Either way P waits for its copies, then sends
one :class:`~kvflow.protocol.KVPushed` (``ok``, first token, timings); D starts decoding on it.

Ownership: D's blocks of a request are written by P until P's ``KVPushed`` (ok or not) for it,
so D keeps them allocated until then even if the request ends early
(:class:`~kvflow.serve.decode.DecodeInstance` "lent" blocks), unless P is known dead. P frees
its own blocks as soon as its copies are done (nothing reads them later). Inside a dummy or
profile run nothing is copied and nothing is sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.kernels import copy_blocks, payload_bytes
from kvflow.protocol import KVPushed, encode

from .base import KVReceiver, TransferError, TransferStats, check_send_allowed

#: Programs of a layerwise copy launched beside P's compute (DESIGN.md: background copies
#: are capped so the prefill keeps its SMs; 16 measured 1-2.4% prefill slowdown on one H200,
#: bench/results/layerwise_gpu-nvidia-h200-20261129-run1.json).
LAYERWISE_MAX_CTAS = 16
#: Layers per copy launch. Each launch costs P's host thread an event, a wait and a kernel
#: launch (tens of microseconds of Python); 4 layers per launch cut that 4x while the copy
#: left after the prefill stays small (4 of 32 layers: 0.64 ms exposed at 8K tokens against
#: 0.55 ms with 1, same TTFT, bench/results/ipc_gpu-served-nvidia-h200x2-20261130.json).
LAYERS_PER_COPY = 4


@dataclasses.dataclass
class PushStats:
    """One request's push as seen by P.

    Attributes
    ----------
    blocks, payload_bytes : int
        Blocks (per layer) and payload bytes written into D's cache.
    t_start : float
        ``time.time()`` when the first copy was issued (0 if nothing moved).
    layerwise : bool
        Copied layer by layer during the prefill.
    copy_ms : float
        Wall time of the copy calls on P (CPU: the copies; CUDA: issuing them, the device
        runs them on P's copy stream).
    exposed_ms : float
        Time from the first token (sampled after the prefill) until every copy was done:
        the request-mode copy, or the layerwise copies still running (ms).
    prefill_ms : float
        P's prefill until the first token was sampled (ms; set by the caller).
    """

    blocks: int = 0
    payload_bytes: int = 0
    t_start: float = 0.0
    copy_ms: float = 0.0
    exposed_ms: float = 0.0
    prefill_ms: float = 0.0
    layerwise: bool = False
    pending: Any = dataclasses.field(default=None, repr=False)  # request mode: ids to copy
    dst: Any = dataclasses.field(default=None, repr=False)      # the D cache written into


def map_decode_cache(shm_name: str, spec, num_blocks: int, device: torch.device) -> PagedKVCache:
    """Map D's exported cache writable in P's process, usable by kernels on ``device``.

    CPU: the shared-memory segment ``shm_name``; CUDA: the IPC export published under that name,
    mapped into ``device``'s context (``import_cache(map_on=device)``), so P's kernels write D's
    GPU memory over NVLink.

    Raises
    ------
    TransferError
        Missing segment or export, size or spec mismatch, a GPU this process cannot see.
    """
    if device.type == "cuda":
        from .cuda_ipc import import_cache, read_export
        return import_cache(read_export(shm_name), spec, num_blocks, map_on=device)
    from .ipc import map_peer_cache
    return map_peer_cache(shm_name, spec, num_blocks, writable=True)


class PushWriter:
    """P's half: maps each paired D's cache at pairing and writes every request into the cache
    of the D that allocated its blocks (``peer_id``), never another one's.

    Parameters
    ----------
    cache : PagedKVCache
        P's cache.
    backend : str
        Kernel backend for copy_blocks.
    max_ctas : int or None
        Grid cap of the layerwise copies that overlap compute (default
        :data:`LAYERWISE_MAX_CTAS`); the last one and request-mode copies use the whole GPU
        (the prefill is over).
    layers_per_copy : int
        Layers per layerwise copy launch (default :data:`LAYERS_PER_COPY`).

    Raises
    ------
    ValueError
        ``max_ctas`` or ``layers_per_copy`` below 1.
    """

    name = "ipc"
    holds_blocks = False

    def __init__(self, cache: PagedKVCache, backend: str = "auto",
                 max_ctas: int | None = LAYERWISE_MAX_CTAS,
                 layers_per_copy: int = LAYERS_PER_COPY) -> None:
        for name, v in (("max_ctas", max_ctas if max_ctas is not None else 1),
                        ("layers_per_copy", layers_per_copy)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.cache, self.backend, self.max_ctas = cache, backend, max_ctas
        self.layers_per_copy = layers_per_copy
        self.peers: dict[str, PagedKVCache] = {}  # paired D -> its mapped cache
        self.cuda = cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self._events = [torch.cuda.Event() for _ in range(cache.spec.num_layers)] if self.cuda else []
        self._keep: list = []
        self.messages_sent = 0

    def attach(self, peer_id: str, shm_name: str, peer_spec, peer_num_blocks: int) -> None:
        """Map D ``peer_id``'s cache (at pairing; replaces an earlier mapping of that D only)."""
        if not shm_name:
            raise TransferError(f"decode instance {peer_id} exported no cache to push into "
                                f"(is it running with --ipc-direction push?)")
        self.peers.pop(peer_id, None)
        self.peers[peer_id] = map_decode_cache(shm_name, peer_spec, peer_num_blocks,
                                               self.cache.device)

    def detach(self, peer_id: str) -> None:
        """Drop D ``peer_id``'s mapping (it was unpaired); other D's stay mapped."""
        if self.peers.pop(peer_id, None) is not None and self.cuda and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def export(self) -> dict[str, str]:
        """Fields for P's Register message: none (P maps D's cache, not the other way)."""
        return {}

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self.peers.clear()
        if self.cuda and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    # ---- the prefill -------------------------------------------------------------------
    def _pairs(self, blocks: list[int], dst_ids: list[int], first: int, stop: int, skip: int,
               peer: PagedKVCache):
        """P's and D's ids of logical blocks ``[max(first, skip), stop)``, checked once here
        (the per-layer copies skip validation) and, on CUDA, put on the device once through
        the copy stream (no host sync per layer)."""
        lo = max(first, skip)
        if lo >= stop:
            return None
        src, dst = blocks[lo:stop], dst_ids[lo:stop]
        for name, ids, limit in (("P's block table", src, self.cache.num_blocks),
                                 ("decode_block_ids", dst, peer.num_blocks)):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise TransferError(f"{name} holds block {bad[0]}, not in [0, {limit})")
        if len(set(dst)) != len(dst):
            raise TransferError(f"decode_block_ids repeats a block: {dst}")
        pairs = tuple(torch.tensor(x, dtype=torch.int64, pin_memory=self.cuda) for x in (src, dst))
        if not self.cuda:
            return pairs
        with torch.cuda.stream(self._stream):
            dev = tuple(t.to(self.cache.device, non_blocking=True) for t in pairs)
        self._keep.append(pairs)  # pinned sources live until finish()
        return dev

    def prefill(self, engine: Any, token_ids: list[int], blocks: list[int], dst_ids: list[int],
                chunk_size: int | None, *, peer_id: str = "", skip_blocks: int = 0,
                layerwise: bool = True) -> tuple[torch.Tensor, PushStats]:
        """Run ``engine``'s prefill and write the prompt's KV into D ``peer_id``'s blocks
        ``dst_ids``.

        Parameters
        ----------
        engine : kvflow.engine.Engine
            P's engine (its cache is :attr:`cache`).
        token_ids : list[int]
            The prompt.
        blocks, dst_ids : list[int]
            P's and D's block tables (logical block ``i`` is ``blocks[i]`` here and
            ``dst_ids[i]`` in D); both must cover the prompt.
        chunk_size : int or None
            Prefill chunk (tokens).
        peer_id : str
            The D that allocated ``dst_ids`` (attached with :meth:`attach`).
        skip_blocks : int
            D already holds logical blocks ``0..skip_blocks-1`` (prefix hit): not written.
        layerwise : bool
            Copy each layer of each chunk as soon as it is computed (else after the prefill).

        Returns
        -------
        (logits, PushStats)
            The last token's logits; layerwise copies are issued but may still run on the
            device, a request-mode copy is left to :meth:`finish`.

        Raises
        ------
        TransferError
            ``peer_id`` is not attached, or ``dst_ids`` is shorter than the prompt's blocks.
        """
        n, bs = len(token_ids), self.cache.spec.block_size
        nb = -(-n // bs)
        real = sends_allowed()
        dst = self.peers.get(peer_id)
        if real and dst is None:
            raise TransferError(f"push to decode instance {peer_id!r}, which is not paired with "
                                f"this prefill instance (paired: {sorted(self.peers)})")
        if len(dst_ids) < nb or len(blocks) < nb:
            raise TransferError(f"decode_block_ids has {len(dst_ids)} blocks and P's table "
                                f"{len(blocks)}; the {n}-token prompt needs {nb}")
        stats = PushStats(dst=dst)
        chunk = chunk_size or n
        if not real:  # dummy / profile run: compute only
            logits = None
            for start in range(0, n, chunk):
                logits = engine.prefill(token_ids[:min(start + chunk, n)], blocks,
                                        num_computed_tokens=start)
            return logits, stats
        if self.cuda:  # P's earlier writes into its blocks (other streams) come first
            self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        logits = None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            pairs = self._pairs(blocks, dst_ids, start // bs, -(-end // bs), skip_blocks, dst) \
                if layerwise else None
            hook = None if pairs is None else self._layer_hook(pairs, stats, end == n)
            logits = engine.prefill(token_ids[:end], blocks, num_computed_tokens=start,
                                    on_layer_done=hook)
        if not layerwise:  # copied by finish(), after the first token
            stats.pending = self._pairs(blocks, dst_ids, 0, nb, skip_blocks, dst)
        m = max(0, nb - skip_blocks)
        stats.blocks, stats.payload_bytes = m, payload_bytes(self.cache.spec, m)
        stats.layerwise = layerwise
        return logits, stats

    def _layer_hook(self, pairs, stats: PushStats, last_chunk: bool):
        L, G = self.cache.spec.num_layers, self.layers_per_copy

        def hook(layer: int) -> None:
            if (layer + 1) % G and layer != L - 1:
                return  # the group of layers is not complete yet
            if self.cuda:
                ev = self._events[layer]
                ev.record(torch.cuda.current_stream(self.cache.device))
                self._stream.wait_event(ev)
            final = last_chunk and layer == L - 1  # nothing left to overlap: the whole GPU
            self._copy(pairs, (layer - layer % G, layer + 1), None if final else self.max_ctas,
                       stats)
        return hook

    def _copy(self, pairs, layers, max_ctas, stats: PushStats) -> None:
        t0 = time.perf_counter()
        if not stats.t_start:
            stats.t_start = time.time()
        src, dst = pairs
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext():
            copy_blocks(self.cache, stats.dst, src, dst, layers, backend=self.backend,
                        max_ctas=max_ctas, validate=False)
        stats.copy_ms += (time.perf_counter() - t0) * 1e3

    def finish(self, stats: PushStats | None = None) -> None:
        """Issue the request-mode copy (if :meth:`prefill` left one) and block until every copy
        issued so far is done (D may read the blocks after this). The time spent here is the
        part of the transfer not hidden behind the prefill (``stats.exposed_ms``)."""
        t0 = time.perf_counter()
        if stats is not None and stats.pending is not None:
            if self.cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            self._copy(stats.pending, None, None, stats)
            stats.pending = None
        if self._stream is not None:
            self._stream.synchronize()
        self._keep.clear()
        if stats is not None:
            stats.exposed_ms = (time.perf_counter() - t0) * 1e3

    def send_done(self, link: Any, req_id: str, *, ok: bool, error: str = "",
                  first_token: int = -1, num_prompt_tokens: int = 0,
                  stats: PushStats | None = None) -> None:
        """Tell D the push of ``req_id`` is over (after :meth:`finish`): ``ok`` with the first
        token, or not (nothing more will be written; D may free the blocks)."""
        check_send_allowed("PushWriter.send_done")
        s = stats or PushStats()
        link.send(encode(KVPushed(req_id=req_id, ok=ok, error=error, first_token=first_token,
                                  num_prompt_tokens=num_prompt_tokens, num_blocks=s.blocks,
                                  payload_bytes=s.payload_bytes, t_start=s.t_start,
                                  t_done=time.time(), copy_ms=s.copy_ms,
                                  exposed_ms=s.exposed_ms, prefill_ms=s.prefill_ms,
                                  layerwise=s.layerwise)))
        self.messages_sent += 1


class PushReceiver(KVReceiver):
    """D's half: exports D's cache (done by the instance at start-up); a ``KVPushed`` says the
    KV is already in D's blocks, so receiving only checks and reports it."""

    name = "ipc"

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.peer_id = ""

    def attach(self, peer_id, peer_spec, peer_num_blocks, shm_name=""):
        self.peer_id = peer_id

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
                             copy_ms=header.copy_ms)
