"""The two ends of a pull over ZMQ: P's :class:`KVServer` gathers held blocks out of vLLM's
cache with :func:`kvflow.kernels.gather_blocks`; D's :class:`KVPuller` receives the layer frames
without copying and :func:`kvflow.kernels.scatter_blocks` them into the blocks D allocated.

Works on one host and across hosts (``tcp://``). P only serves a request it holds (announced
by its scheduler through :meth:`KVServer.hold`, waiting up to ``hold_wait_s`` for it); a pull
for anything else is answered with an error, never with whatever the blocks hold now.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any

import torch
import zmq

from kvflow.cache import PagedKVCache, staging_buffer, staging_shape
from kvflow.kernels import gather_blocks, scatter_blocks
from kvflow.layout import KVCacheSpec
from kvflow.protocol import ProtocolError

from .messages import Pull, PullReply, Release, decode, encode

log = logging.getLogger("kvflow.integrations.vllm")


class KVServer:
    """P's end: a ROUTER socket served by one thread.

    Parameters
    ----------
    cache : PagedKVCache
        P's cache (:meth:`PagedKVCache.from_vllm`).
    addr : str
        Where to bind, e.g. ``"tcp://127.0.0.1:5601"``.
    backend : str
        kvflow backend for ``gather_blocks``.
    hold_wait_s : float
        How long a pull waits for its request to be held (seconds).
    delay_s : float
        Test hook: sleep before answering a pull (to abort a transfer in flight).
    """

    def __init__(self, cache: PagedKVCache, addr: str, *, backend: str = "auto",
                 hold_wait_s: float = 5.0, delay_s: float = 0.0) -> None:
        self.cache, self.addr, self.backend = cache, addr, backend
        self.hold_wait_s, self.delay_s = hold_wait_s, delay_s
        self._held: dict[str, float] = {}      # req_id -> deadline (monotonic seconds)
        self._done: set[str] = set()           # pulled, released or expired: P may free
        self._cond = threading.Condition()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvflow-kv-server", daemon=True)
        self._thread.start()

    # ---- called by the worker connector ---------------------------------------------------
    def hold(self, req_id: str, lease_s: float) -> None:
        """P's scheduler kept ``req_id``'s blocks for D: serve pulls until ``lease_s`` ends."""
        with self._cond:
            self._held[req_id] = time.monotonic() + lease_s
            self._cond.notify_all()

    def take_done(self) -> set[str]:
        """Requests whose blocks P may free now (pulled, released, or lease expired)."""
        now = time.monotonic()
        with self._cond:
            for req_id, deadline in list(self._held.items()):
                if deadline <= now:
                    log.warning("request %s: no pull within its lease; freeing P's blocks", req_id)
                    self._held.pop(req_id)
                    self._done.add(req_id)
            done, self._done = self._done, set()
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)

    # ---- the serving thread ---------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            try:
                msg = decode(frames[0]) if len(frames) == 1 else None
            except ProtocolError as exc:
                log.error("KVServer %s: %s", self.addr, exc)
                continue
            if isinstance(msg, Release):
                self._finish(msg.req_id)
            elif isinstance(msg, Pull):
                self._answer(ident, msg)
            else:
                log.error("KVServer %s: unexpected frame(s) %s", self.addr, type(msg).__name__)

    def _finish(self, req_id: str) -> None:
        with self._cond:
            if self._held.pop(req_id, None) is not None:
                self._done.add(req_id)

    def _answer(self, ident: Any, msg: Pull) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        error = self._check(msg)
        if error:
            self._sock.send_multipart([ident, encode(PullReply(msg.req_id, False, error=error))])
            return
        ids = torch.tensor(msg.block_ids, dtype=torch.int64)
        buf = gather_blocks(self.cache, ids, staging_buffer(self.cache.spec, len(ids)),
                            backend=self.backend)
        frames = [memoryview(buf[l].view(torch.uint8).numpy()) for l in range(buf.shape[0])]
        header = encode(PullReply(msg.req_id, True, num_layers=len(frames)))
        self._sock.send_multipart([ident, header, *frames], copy=False)
        self._finish(msg.req_id)

    def _check(self, msg: Pull) -> str:
        try:
            theirs = KVCacheSpec.from_dict(msg.spec)
        except (TypeError, ValueError) as exc:
            return f"D's spec {msg.spec} is not a KVCacheSpec: {exc}"
        diff = self.cache.spec.diff(theirs)
        if diff:
            return "P and D caches differ: " + "; ".join(f"{d} (P vs D)" for d in diff)
        bad = [b for b in msg.block_ids if b >= self.cache.num_blocks]
        if bad:
            return (f"block id {bad[0]} is out of range for P's cache of "
                    f"{self.cache.num_blocks} blocks")
        deadline = time.monotonic() + self.hold_wait_s
        with self._cond:
            while msg.req_id not in self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"P holds no blocks for request {msg.req_id!r} (freed or never held)"
                self._cond.wait(left)
        return ""


class PullError(RuntimeError):
    """A pull that did not put the KV into D's blocks (P refused, timed out, bad frames)."""


class KVPuller:
    """D's end: one DEALER socket per P address, used from one thread.

    Parameters
    ----------
    cache : PagedKVCache
        D's cache.
    timeout_s : float
        Longest wait for P's answer (seconds); then :class:`PullError`.
    backend : str
        kvflow backend for ``scatter_blocks``.
    corrupt : bool
        Test hook (the negative control): add noise to the received KV before it is written.
    """

    def __init__(self, cache: PagedKVCache, *, timeout_s: float = 30.0, backend: str = "auto",
                 corrupt: bool = False) -> None:
        self.cache, self.timeout_s, self.backend, self.corrupt = cache, timeout_s, backend, corrupt
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        s = self._socks.get(addr)
        if s is None:
            s = self._socks[addr] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
        return s

    def release(self, addr: str, req_id: str) -> None:
        """Tell P at ``addr`` to free ``req_id``'s blocks (D will not pull them)."""
        self._sock(addr).send(encode(Release(req_id)))

    def pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> int:
        """Copy P's blocks ``remote_ids`` into D's ``local_ids`` (same length, logical order).

        Returns
        -------
        int
            Payload bytes written into D's cache.

        Raises
        ------
        PullError
            P refused (its message), no answer within ``timeout_s``, or frames of the wrong size.
        """
        if len(remote_ids) != len(local_ids):
            raise PullError(f"request {req_id}: {len(remote_ids)} remote blocks for "
                            f"{len(local_ids)} local blocks")
        sock = self._sock(addr)
        sock.send(encode(Pull(req_id, list(remote_ids), self.cache.spec.to_dict())))
        while True:  # answers to an earlier, timed-out pull on this socket are skipped
            if not sock.poll(int(self.timeout_s * 1000)):
                self._drop(addr)
                raise PullError(f"request {req_id}: no answer from P at {addr} within "
                                f"{self.timeout_s} s")
            header, *frames = sock.recv_multipart(copy=False)
            reply = decode(header)
            if isinstance(reply, PullReply) and reply.req_id == req_id:
                break
        if not reply.ok:
            raise PullError(f"request {req_id}: P refused the pull: {reply.error}")
        spec, n = self.cache.spec, len(remote_ids)
        shape = staging_shape(spec, n, 0)
        if reply.num_layers != spec.num_layers or len(frames) != spec.num_layers:
            raise PullError(f"request {req_id}: {len(frames)} layer frames, expected "
                            f"{spec.num_layers}")
        ids = torch.tensor(local_ids, dtype=torch.int64)
        for layer, frame in enumerate(frames):
            with warnings.catch_warnings():  # zmq frames are read-only; scatter only reads
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(bytearray(frame.buffer) if self.corrupt else frame.buffer,
                                       dtype=torch.uint8)
            if src.numel() != spec.block_bytes * spec.tensors_per_layer * n:
                raise PullError(f"request {req_id}: layer {layer} frame holds {src.numel()} "
                                f"bytes, expected {spec.block_bytes * spec.tensors_per_layer * n}")
            src = src.view(spec.dtype).view(shape)
            if self.corrupt:
                src.copy_(torch.randn(shape).to(spec.dtype))
            scatter_blocks(src, self.cache, ids, layer, backend=self.backend)
        return n * spec.bytes_per_block

    def _drop(self, addr: str) -> None:
        s = self._socks.pop(addr, None)
        if s is not None:
            s.close(linger=0)

    def close(self) -> None:
        for addr in list(self._socks):
            self._drop(addr)
