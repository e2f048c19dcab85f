"""Which blocks of which layers go to the decode side, and when (transport-agnostic). A layer signal
``(l, s)`` means "layer ``l`` is complete through engine step ``s``" (a :mod:`kvflow.signal` slot
keeps the latest step, so steps may be skipped): it sends the request's newly full blocks of layer
``l``, after its last chunk the partial last block too, as ``range``s of consecutive layers standing
at the same blocks. Every block of every layer goes exactly once; blocks ready before D's ids arrive
are replayed then. A stale, duplicate or unmatched signal sends nothing, nor does anything inside a
profile/dummy run (:func:`kvflow.context.sends_allowed`).
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
    """Counters: ``sends``, ``block_layers`` (blocks x layers sent), ``signals`` accepted; dropped:
    ``duplicate`` (same step again), ``stale`` (older), ``unmatched`` (no live request ran it),
    ``suppressed`` (in a profile/dummy run); ``buffered`` (readied blocks before D's ids),
    ``replayed`` (sends when they came), ``errors`` (failed sends)."""

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
    ready: list[int]  # per layer: blocks complete
    sent: list[int]  # per layer: blocks sent
    since: float  # last progress (perf_counter seconds)
    dst: list[int] | None = None
    chunks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (step, end_token)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(name: str, v) -> None:
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _ids(name: str, ids: Sequence[int]) -> list[int]:
    out = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if not all(_is_int(i) and i >= 0 for i in out):
        raise ValueError(f"{name} must be non-negative block ids, got {out!r}")
    return out


class LayerwiseScheduler:
    """Per-request block bookkeeping that turns layer signals into sends, for a cache of
    ``num_layers`` layers and ``block_size``-token blocks (ValueError unless positive ints):
    ``send(request_id, layers: range, src_block_ids, dst_block_ids)`` (TypeError unless callable);
    ``on_done(request_id)`` after a request's last send (its state is then gone);
    ``on_error(request_id, exc)`` when a send raises (the request is aborted; without it the
    exception propagates). Thread-safe; sends run outside the lock, in the calling thread."""

    def __init__(self, num_layers: int, block_size: int, send: SendFn, *,
                 on_done: Callable[[str], None] | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        _positive("num_layers", num_layers)
        _positive("block_size", block_size)
        if not callable(send):
            raise TypeError(f"send must be callable, got {send!r}")
        self.num_layers, self.block_size = num_layers, block_size
        self._send, self._on_done, self._on_error = send, on_done, on_error
        self._lock = threading.Lock()
        self._reqs: dict[str, _Request] = {}
        self._done_step = [-1] * num_layers  # per layer: latest step signalled
        self.stats = LayerwiseStats()

    def add_request(self, request_id: str, num_tokens: int, src_block_ids: Sequence[int]) -> None:
        """Register a prefill request with P's block table; ValueError: a duplicate ``request_id``,
        ``num_tokens < 1``, or not ``ceil(num_tokens / block_size)`` blocks."""
        _positive("num_tokens", num_tokens)
        src = _ids("src_block_ids", src_block_ids)
        need = -(-num_tokens // self.block_size)
        if len(src) != need:
            raise ValueError(f"src_block_ids has {len(src)} blocks; {num_tokens} tokens in blocks of "
                             f"{self.block_size} need {need}")
        with self._lock:
            if request_id in self._reqs:
                raise ValueError(f"request_id={request_id!r} is already registered")
            self._reqs[request_id] = _Request(request_id, num_tokens, src, [0] * self.num_layers,
                                              [0] * self.num_layers, time.perf_counter())

    def add_chunk(self, request_id: str, step: int, end_token: int) -> None:
        """Step ``step`` computes the prompt up to ``end_token`` (exclusive); register it before, or
        right after, the step runs (a step already signalled counts as complete). KeyError: unknown
        or finished request; ValueError: not after the previous chunk, or ``end_token >
        num_tokens``."""
        with self._lock:
            r = self._get(request_id)
            prev_step, prev_end = r.chunks[-1] if r.chunks else (-1, 0)
            if not _is_int(step) or step <= prev_step:
                raise ValueError(f"step must be an int after the previous chunk's step {prev_step}, "
                                 f"got {step!r}")
            if not _is_int(end_token) or not prev_end < end_token <= r.num_tokens:
                raise ValueError(f"end_token must be in ({prev_end}, {r.num_tokens}], got {end_token!r}")
            r.chunks.append((step, end_token))
            r.since = time.perf_counter()
            for layer in range(self.num_layers):
                self._update_ready(r, layer)
            pending = self._collect(r)
        self._run(pending)

    def set_dst_blocks(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """D's destination block ids (as many as P's); replays blocks already signalled.
        Raises KeyError: unknown request; ValueError: wrong count, repeated ids, or already set."""
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

    def abort(self, request_id: str) -> bool:
        """Forget a request (done or aborted); later signals of its steps are dropped. Returns
        whether it was known."""
        with self._lock:
            return self._reqs.pop(request_id, None) is not None

    def on_layer_signal(self, layer: int, step: int) -> int:
        """Layer ``layer`` is complete through step ``step``; returns the number of sends made.
        Raises ValueError: ``layer`` outside ``[0, num_layers)``, or ``step`` not an int."""
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if not _is_int(step):
            raise ValueError(f"step must be an int, got {step!r}")
        with self._lock:
            if not sends_allowed():
                self.stats.suppressed += 1
                return 0
            last = self._done_step[layer]
            if step <= last:
                self.stats.duplicate += step == last
                self.stats.stale += step < last
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
            self.stats.signals += matched
            self.stats.unmatched += not matched
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
                missing = [l for l in range(self.num_layers) if self._done_step[l] < want]
                if missing:
                    out.append((r.request_id, missing[0], want))
        return out

    def pending_requests(self) -> list[str]:
        """Ids of requests not yet fully sent."""
        with self._lock:
            return list(self._reqs)

    def _get(self, request_id: str) -> _Request:  # lock held (as below, unless noted)
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
        """Sends now due for ``r``, marked sent; the last one of the request carries done=True."""
        if r.dst is None or not sends_allowed():
            return []
        out, layer = [], 0
        while layer < self.num_layers:
            lo, hi = r.sent[layer], r.ready[layer]
            stop = layer + 1
            if hi > lo:
                while stop < self.num_layers and (r.sent[stop], r.ready[stop]) == (lo, hi):
                    stop += 1
                out.append((r.request_id, range(layer, stop), r.src[lo:hi], r.dst[lo:hi], False))
                r.sent[layer:stop] = [hi] * (stop - layer)
            layer = stop
        if out and all(x == len(r.src) for x in r.sent):
            out[-1] = out[-1][:4] + (True,)
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
