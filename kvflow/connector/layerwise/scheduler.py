"""Which blocks of which layers go to the decode side, and when (transport-agnostic).

P runs a request's prefill in chunks, one chunk per engine step; after layer ``l`` of step ``s``
the KV of layer ``l`` is complete for every token the request's chunks up to step ``s`` cover.
A layer signal ``(l, s)`` means "layer ``l`` complete through step ``s``" (the slot of
:mod:`kvflow.signal` keeps the latest step, so a reader may skip steps). Then
the request's newly *full* blocks of layer ``l`` (and, once its last chunk is done, the partial
last block) are sent at once. Whether a prompt goes layerwise at all (``layerwise_min_tokens``)
is decided before it is registered here, by the connector.

D's destination block ids may arrive after the signals: ready blocks wait and are replayed when
they come. Every block of every layer is sent exactly once; signals may arrive out of layer
order; a signal older than (stale) or equal to (duplicate) the layer's latest step, or of a
step no live request ran (finished / aborted), sends nothing. Nothing is sent inside a profile
or dummy run (:func:`kvflow.context.sends_allowed`).

The send callable is ``send(request_id, layers, src_block_ids, dst_block_ids)`` where
``layers`` is a ``range`` of consecutive layers (one layer; several when layers stand at the same
blocks, e.g. when a replay catches up) and the id lists pair P's block ``src[i]`` with
D's block ``dst[i]`` — e.g. ``copy_blocks(p_cache, d_cache, src, dst, layers=layers)``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Sequence

from kvflow.context import sends_allowed

SendFn = Callable[[str, range, list[int], list[int]], None]


@dataclasses.dataclass
class LayerwiseStats:
    """Counters. ``sends``: send calls; ``block_layers``: blocks x layers sent; ``signals``:
    signals accepted; ``duplicate`` / ``stale`` / ``unmatched``: signals dropped (same step
    again / an older step / no live request ran that step); ``buffered``: signals that readied
    blocks of a request without D's ids yet; ``replayed``: sends made when D's ids arrived;
    ``suppressed``: signals refused inside a profile/dummy run; ``errors``: failed sends."""

    sends: int = 0
    block_layers: int = 0
    signals: int = 0
    duplicate: int = 0
    stale: int = 0
    unmatched: int = 0
    buffered: int = 0
    replayed: int = 0
    suppressed: int = 0
    errors: int = 0


@dataclasses.dataclass
class _Request:
    request_id: str
    num_tokens: int
    src: list[int]
    dst: list[int] | None = None
    chunks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (step, end_token)
    ready: list[int] = dataclasses.field(default_factory=list)  # per layer: blocks complete
    sent: list[int] = dataclasses.field(default_factory=list)  # per layer: blocks sent
    since: float = 0.0  # last progress (perf_counter seconds)


def _ids(name: str, ids: Sequence[int]) -> list[int]:
    out = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in out):
        raise ValueError(f"{name} must be non-negative block ids, got {out!r}")
    return out


class LayerwiseScheduler:
    """Per-request block bookkeeping that turns layer signals into sends.

    Parameters
    ----------
    num_layers : int
        Layers of the KV cache.
    block_size : int
        Tokens per block.
    send : callable
        ``send(request_id, layers: range, src_block_ids: list[int], dst_block_ids: list[int])``.
    on_done : callable, optional
        ``on_done(request_id)`` after the last send of a request (its state is then gone).
    on_error : callable, optional
        ``on_error(request_id, exc)`` when a send raises (the request is aborted); without it
        the exception propagates.

    Thread-safe: every method may be called from any thread; sends run outside the lock, in
    the calling thread.
    """

    def __init__(self, num_layers: int, block_size: int, send: SendFn, *,
                 on_done: Callable[[str], None] | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        for name, v in (("num_layers", num_layers), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not callable(send):
            raise TypeError(f"send must be callable, got {send!r}")
        self.num_layers, self.block_size = num_layers, block_size
        self._send, self._on_done, self._on_error = send, on_done, on_error
        self._lock = threading.Lock()
        self._reqs: dict[str, _Request] = {}
        self._done_step = [-1] * num_layers  # per layer: latest step signalled
        self.stats = LayerwiseStats()

    # ---- registration -----------------------------------------------------------------
    def add_request(self, request_id: str, num_tokens: int, src_block_ids: Sequence[int]) -> None:
        """Register a prefill request with P's block table.

        Raises
        ------
        ValueError
            Duplicate ``request_id``, ``num_tokens < 1``, or ``src_block_ids`` whose length is
            not ``ceil(num_tokens / block_size)``.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        src = _ids("src_block_ids", src_block_ids)
        need = -(-num_tokens // self.block_size)
        if len(src) != need:
            raise ValueError(f"src_block_ids has {len(src)} blocks; {num_tokens} tokens in blocks of "
                             f"{self.block_size} need {need}")
        with self._lock:
            if request_id in self._reqs:
                raise ValueError(f"request_id={request_id!r} is already registered")
            self._reqs[request_id] = _Request(request_id, num_tokens, src,
                                              ready=[0] * self.num_layers,
                                              sent=[0] * self.num_layers, since=time.perf_counter())

    def add_chunk(self, request_id: str, step: int, end_token: int) -> None:
        """Step ``step`` computes the request's prompt up to ``end_token`` (exclusive).

        Register it before (or, at the latest, right after) the step runs; a chunk of a step
        that was already signalled counts as complete at once.

        Raises
        ------
        KeyError
            Unknown (or finished) ``request_id``.
        ValueError
            ``end_token`` not after the previous chunk's or beyond ``num_tokens``; ``step`` not
            after the previous chunk's.
        """
        with self._lock:
            r = self._get(request_id)
            prev_step, prev_end = r.chunks[-1] if r.chunks else (-1, 0)
            if isinstance(step, bool) or not isinstance(step, int) or step <= prev_step:
                raise ValueError(f"step must be an int after the previous chunk's step {prev_step}, "
                                 f"got {step!r}")
            if isinstance(end_token, bool) or not isinstance(end_token, int) \
                    or not prev_end < end_token <= r.num_tokens:
                raise ValueError(f"end_token must be in ({prev_end}, {r.num_tokens}], got {end_token!r}")
            r.chunks.append((step, end_token))
            r.since = time.perf_counter()
            for layer in range(self.num_layers):
                self._update_ready(r, layer)
            pending = self._collect(r)
        self._run(pending)

    def set_dst_blocks(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """D's destination block ids (as many as P's); replays blocks already signalled.

        Raises
        ------
        KeyError
            Unknown request.
        ValueError
            Wrong count, repeated ids, or ids already set.
        """
        dst = _ids("dst_block_ids", dst_block_ids)
        with self._lock:
            r = self._get(request_id)
            if r.dst is not None:
                raise ValueError(f"dst_block_ids of request {request_id!r} are already set")
            if len(dst) != len(r.src):
                raise ValueError(f"dst_block_ids has {len(dst)} blocks; request {request_id!r} "
                                 f"has {len(r.src)} on P")
            if len(set(dst)) != len(dst):
                raise ValueError(f"dst_block_ids repeats a block: {dst!r}")
            r.dst = dst
            pending = self._collect(r)
            self.stats.replayed += len(pending)
        self._run(pending)

    def finish(self, request_id: str) -> bool:
        """Forget a request (done or aborted); later signals of its steps are dropped. Returns
        whether it was known."""
        with self._lock:
            return self._reqs.pop(request_id, None) is not None

    abort = finish

    # ---- signals ----------------------------------------------------------------------
    def on_layer_signal(self, layer: int, step: int) -> int:
        """Layer ``layer`` is complete through step ``step``; returns the number of sends made.

        Raises
        ------
        ValueError
            ``layer`` outside ``[0, num_layers)``, or ``step`` not an int.
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        with self._lock:
            if not sends_allowed():
                self.stats.suppressed += 1
                return 0
            last = self._done_step[layer]
            if step <= last:
                if step == last:
                    self.stats.duplicate += 1
                else:
                    self.stats.stale += 1
                return 0
            self._done_step[layer] = step
            pending, matched = [], False
            for r in list(self._reqs.values()):
                if not any(last < s <= step for s, _ in r.chunks):
                    continue
                matched = True
                r.since = time.perf_counter()
                if self._update_ready(r, layer) and r.dst is None:
                    self.stats.buffered += 1
                pending += self._collect(r)
            if matched:
                self.stats.signals += 1
            else:
                self.stats.unmatched += 1
        return self._run(pending)

    def overdue(self, timeout_s: float) -> list[tuple[str, int, int]]:
        """Requests with a registered chunk whose layers went unsignalled for ``timeout_s``
        seconds: ``(request_id, first missing layer, step awaited)`` each."""
        now = time.perf_counter()
        out = []
        with self._lock:
            for r in self._reqs.values():
                if not r.chunks or now - r.since < timeout_s:
                    continue
                want = r.chunks[-1][0]
                for layer in range(self.num_layers):
                    if self._done_step[layer] < want:
                        out.append((r.request_id, layer, want))
                        break
        return out

    # ---- internals (lock held unless noted) -------------------------------------------
    def _get(self, request_id: str) -> _Request:
        r = self._reqs.get(request_id)
        if r is None:
            raise KeyError(f"request_id={request_id!r} is not registered (finished or aborted?)")
        return r

    def _update_ready(self, r: _Request, layer: int) -> bool:
        end = max((e for s, e in r.chunks if s <= self._done_step[layer]), default=0)
        n = len(r.src) if end >= r.num_tokens else end // self.block_size
        grew = n > r.ready[layer]
        r.ready[layer] = max(r.ready[layer], n)
        return grew

    def _collect(self, r: _Request) -> list[tuple[str, range, list[int], list[int], bool]]:
        """Sends now due for ``r``, marked sent; the last one carries done=True."""
        if r.dst is None or not sends_allowed():
            return []
        n = len(r.src)
        out = []
        layer = 0
        while layer < self.num_layers:
            lo, hi = r.sent[layer], r.ready[layer]
            if hi <= lo:
                layer += 1
                continue
            stop = layer + 1
            while stop < self.num_layers and (r.sent[stop], r.ready[stop]) == (lo, hi):
                stop += 1
            out.append((r.request_id, range(layer, stop), r.src[lo:hi], r.dst[lo:hi], False))
            for j in range(layer, stop):
                r.sent[j] = hi
            layer = stop
        if out and all(x == n for x in r.sent):
            out[-1] = out[-1][:4] + (True,)
        if out and out[-1][4]:
            del self._reqs[r.request_id]
        return out

    def _run(self, pending: list) -> int:
        """Make the sends (lock NOT held)."""
        failed: set[str] = set()
        for rid, layers, src, dst, done in pending:
            if rid in failed:
                continue
            try:
                self._send(rid, layers, list(src), list(dst))
            except Exception as exc:  # noqa: BLE001 - reported to on_error or re-raised
                failed.add(rid)
                with self._lock:
                    self.stats.errors += 1
                    self._reqs.pop(rid, None)
                if self._on_error is None:
                    raise
                self._on_error(rid, exc)
                continue
            with self._lock:
                self.stats.sends += 1
                self.stats.block_layers += len(src) * len(layers)
            if done and self._on_done is not None:
                self._on_done(rid)
        return len(pending) - len(failed)

    def pending_requests(self) -> list[str]:
        """Ids of requests not yet fully sent."""
        with self._lock:
            return list(self._reqs)
