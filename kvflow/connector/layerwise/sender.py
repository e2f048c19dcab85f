"""P's side of the layerwise transfer: each layer's blocks leave as a
:class:`~kvflow.connector.messages.KVLayer` as soon as the prefill signals them (a
:class:`~kvflow.signal.LayerSignaller` segment read by a :class:`.LayerwiseWorker`); the last
part carries the first token, failures go to :meth:`LayerwiseSender.pop_errors`. docs/design.md,
"Nothing is signalled or sent during a profile run".
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import zmq

from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.connector.messages import KVLayer, encode
from kvflow.signal import LayerSignaller

from ..base import PrefillJob, check_send_allowed
from .scheduler import LayerwiseScheduler
from .worker import LayerwiseWorker


@dataclasses.dataclass
class _Live:
    num_prompt_tokens: int
    peer_id: str = ""               # the D this request's parts go to
    num_cached_blocks: int = 0
    t_start: float = 0.0
    gather_ms: float = 0.0
    keep: list = dataclasses.field(default_factory=list)
    all_sent: bool = False
    first_token: int | None = None
    finished: bool = False


class LayerwiseSender:
    """Signal segment, scheduler and worker thread of one prefill instance, and a send-only part
    socket per paired D (used by the worker and :meth:`finish`, under one lock). ``sender``: the
    connector whose :meth:`send_part` moves each part; ``instance_id``: P's (D acks to it; names the
    signal segment); ``signal_timeout_s``: a chunk's layers unsignalled this long fail the request;
    ``poll_s``: the worker's longest wait (bounds :meth:`close`); ``send_timeout_ms``: of the part
    sockets (a dead D fails the request, never hangs it)."""

    def __init__(self, sender: Any, cache: PagedKVCache, instance_id: str, *,
                 signal_timeout_s: float = 30.0, poll_s: float = 0.05,
                 send_timeout_ms: int = 10_000) -> None:
        spec = cache.spec
        self.sender, self.cache, self.instance_id = sender, cache, instance_id
        self.signal_timeout_s, self.poll_s, self.send_timeout_ms = signal_timeout_s, poll_s, send_timeout_ms
        self.signaller = LayerSignaller(instance_id.replace("-", "_"), spec.num_layers,
                                        device=cache.device)
        self.scheduler = LayerwiseScheduler(spec.num_layers, spec.block_size, self._send_part,
                                            on_done=self._all_sent, on_error=self._failed)
        self.worker: LayerwiseWorker | None = None
        self.socks: dict[str, zmq.Socket] = {}  # paired D -> part socket connected to it
        self.step = 0
        self.messages_sent = 0
        self._lock = threading.Lock()  # the socket and self._live
        self._live: dict[str, _Live] = {}
        self._errors: queue.SimpleQueue[tuple[str, BaseException]] = queue.SimpleQueue()

    def open(self, ctx: zmq.Context, data_addr: str, peer_id: str) -> bool:
        """Start the signal channel and worker (first call) and D ``peer_id``'s part socket to
        ``data_addr``, replacing its earlier one; False, nothing made, inside a dummy run."""
        if not sends_allowed():
            self.signaller.init()  # counted as a refused set-up
            return False
        channel = self.signaller.init()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.instance_id}/layerwise".encode())
        sock.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(data_addr)
        with self._lock:
            self._close_sock(peer_id)
            self.socks[peer_id] = sock
        if self.worker is None:
            self.worker = LayerwiseWorker(self.scheduler, channel, poll_s=self.poll_s,
                                          signal_timeout_s=self.signal_timeout_s,
                                          on_error=self._failed).start()
        return True

    def close_peer(self, peer_id: str) -> None:
        """Close D ``peer_id``'s socket (it was unpaired); its requests still sending fail
        (:meth:`pop_errors`), those of other D's go on."""
        with self._lock:
            self._close_sock(peer_id)
            gone = [r for r, live in self._live.items() if live.peer_id == peer_id]
        for req_id in gone:
            self.scheduler.abort(req_id)
            self._failed(req_id, ConnectionError(f"decode instance {peer_id} was unpaired"))

    def begin(self, job: PrefillJob) -> Callable[[int, int], Callable[[int], None]]:
        """Register ``job`` and return the ``on_chunk`` hook of its prefill (:meth:`Engine.prefill
        <kvflow.engine.Engine.prefill>`; nothing is registered, signalled or sent inside a dummy
        run). The parts go to D ``job.decode_id``, less the ``job.num_cached_blocks`` blocks D
        holds; a failed prefill calls :meth:`abort`. RuntimeError outside a dummy run before
        :meth:`open` or for a D not opened; ValueError as :meth:`LayerwiseScheduler.add_request`."""
        req_id, n = job.req_id, len(job.token_ids)
        real = sends_allowed()
        if real:
            if self.worker is None:
                raise RuntimeError("layerwise prefill before LayerwiseSender.open (no channel)")
            nb = -(-n // self.cache.spec.block_size)
            with self._lock:
                if job.decode_id not in self.socks:
                    raise RuntimeError(f"layerwise prefill for decode instance {job.decode_id!r}, "
                                       f"which is not paired (paired: {sorted(self.socks)})")
                self._live[req_id] = _Live(n, job.decode_id, job.num_cached_blocks)
            self.scheduler.add_request(req_id, n, job.blocks[:nb])
            self.scheduler.set_dst_blocks(req_id, range(nb))
            self.worker.wake()

        def on_chunk(start: int, end: int):
            self.step += 1
            if real:
                self.scheduler.add_chunk(req_id, self.step, end)
            return self.signaller.layer_hook(self.step)

        return on_chunk

    def finish(self, req_id: str, first_token: int) -> bool:
        """The first token is sampled: send the last part now if every layer went, else the
        worker sends it after the last layer. False if the request already failed."""
        with self._lock:
            live = self._live.get(req_id)
            if live is None:
                return False
            live.first_token = first_token
            self._send_last(req_id, live)
        return True

    def abort(self, req_id: str) -> list:
        """Forget a request (abort, ack, failure): later signals send nothing. Returns what
        had to stay alive until now (staging buffers)."""
        self.scheduler.abort(req_id)
        with self._lock:
            live = self._live.pop(req_id, None)
        return live.keep if live is not None else []

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        """Failed requests since the last call (already dropped here): ``(req_id, error)``."""
        out = []
        while not self._errors.empty():
            out.append(self._errors.get_nowait())
        return out

    def _send_part(self, req_id: str, layers: range, src: list[int], dst: list[int]) -> None:
        with self._lock:
            live = self._live.get(req_id)
            if live is None:
                return  # aborted between the signal and now
            cut = max(0, live.num_cached_blocks - dst[0])  # positions D already holds
            src, dst = src[cut:], dst[cut:]
            if not src:
                return
            check_send_allowed("LayerwiseSender part")
            if not live.t_start:
                live.t_start = time.time()
            keep, gather_ms = self.sender.send_part(
                self._sock(live), self.cache, src, layers, req_id=req_id, reply_to=self.instance_id,
                block_offset=dst[0] - live.num_cached_blocks, num_prompt_tokens=live.num_prompt_tokens, t_start=live.t_start)
            live.gather_ms += gather_ms
            self.messages_sent += 1
            if keep is not None:
                live.keep.append(keep)

    def _all_sent(self, req_id: str) -> None:
        with self._lock:
            live = self._live.get(req_id)
            if live is None:
                return
            live.all_sent = True
            self._send_last(req_id, live)

    def _send_last(self, req_id: str, live: _Live) -> None:  # lock held; once both are in
        if live.finished or not live.all_sent or live.first_token is None:
            return
        live.finished = True
        check_send_allowed("LayerwiseSender last part")
        self._sock(live).send(encode(KVLayer(req_id=req_id, reply_to=self.instance_id, last=True,
                                      first_token=live.first_token,
                                      num_prompt_tokens=live.num_prompt_tokens,
                                      t_start=live.t_start, gather_ms=live.gather_ms)))
        self.messages_sent += 1

    def _sock(self, live: _Live) -> zmq.Socket:  # lock held
        sock = self.socks.get(live.peer_id)
        if sock is None:
            raise ConnectionError(f"decode instance {live.peer_id} was unpaired")
        return sock

    def _close_sock(self, peer_id: str) -> None:  # lock held
        sock = self.socks.pop(peer_id, None)
        if sock is not None:
            sock.close(0)

    def _failed(self, req_id: str, exc: BaseException) -> None:
        if req_id == "?":
            return
        with self._lock:
            self._live.pop(req_id, None)
        self._errors.put((req_id, exc))

    def close(self) -> None:
        """Stop the worker (bounded), close the socket, remove the signal segment."""
        if self.worker is not None:
            self.worker.stop(max(1.0, 4 * self.poll_s))
            self.worker = None
        with self._lock:
            for peer_id in list(self.socks):
                self._close_sock(peer_id)
        self.signaller.close()
