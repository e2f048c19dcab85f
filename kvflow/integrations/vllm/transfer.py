"""P's :class:`KVServer` (every transport) and D's :class:`KVPuller` (transport ``tcp``).

tcp: P gathers held blocks out of vLLM's cache with :func:`kvflow.kernels.gather_blocks` and
sends one zero-copy frame per layer (:func:`kvflow.connector.transport.frames.layer_frames`);
D checks every frame, views it without copying and :func:`kvflow.kernels.scatter_blocks` it
into the blocks D allocated (:func:`kvflow.connector.transport.frames.scatter_frames`).
nixl: P answers D's :class:`~.messages.NixlHello` with its agent and cache addresses and a
``Pull(nixl=True)`` with a check only; D READs the blocks itself (:mod:`.nixl_pull`) and then
sends ``Release``. ipc: P copies the blocks into D's staging cache, mapped once per D
(:mod:`.ipc_pull`), and answers; D copies them on and sends ``Release``.

Works on one host and across hosts (``tcp://``). P only serves a request it holds (announced
by its scheduler through :meth:`KVServer.hold`, waiting up to ``hold_wait_s`` for it); a pull
for anything else is answered with an error, never with whatever the blocks hold now.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import zmq

from kvflow.cache import PagedKVCache, staging_buffer
from kvflow.connector.transport.frames import layer_frames, scatter_frames
from kvflow.kernels import gather_blocks, scatter_blocks
from kvflow.layout import KVCacheSpec
from kvflow.wire import ProtocolError

from .ipc_pull import StagingMaps, check_ipc_pull
from .link import Puller, PullError
from .messages import NixlHello, NixlInfo, Pull, PullReply, Release, decode, encode

log = logging.getLogger("kvflow.integrations.vllm")

# D's messages for a reply's frames (tests assert them)
FRAME_COUNT = "request {req_id}: {got} layer frames, expected {expected}"
FRAME_SIZE = "request {req_id}: layer {layer} frame holds {nbytes} bytes, expected {expected}"


class KVServer:
    """P's end: a ROUTER socket served by one thread.

    Parameters
    ----------
    cache : PagedKVCache
        P's cache (:func:`kvflow.vllm_layout.from_vllm`).
    addr : str
        Where to bind, e.g. ``"tcp://127.0.0.1:5601"``.
    backend : str
        kvflow backend for ``gather_blocks``.
    hold_wait_s : float
        How long a pull waits for its request to be held (seconds).
    delay_s : float
        Test hook: sleep before answering a pull (to abort a transfer in flight).
    nixl : NixlInfo or None
        P's NIXL agent and cache (:func:`.nixl_pull.export`): P also serves transport nixl.
    progress : callable or None
        With ``nixl``: P's ``Agent.progress``, called about every millisecond while some D may
        be READing (between a ``Pull(nixl=True)`` and its ``Release`` or lease end), so P's
        agent needs no progress thread polling while idle.
    ipc : bool
        Serve transport ``ipc`` (copy into D's mapped staging cache; one host).
    """

    def __init__(self, cache: PagedKVCache, addr: str, *, backend: str = "auto",
                 hold_wait_s: float = 5.0, delay_s: float = 0.0,
                 nixl: NixlInfo | None = None, progress: Any = None, ipc: bool = False) -> None:
        self.cache, self.addr, self.backend = cache, addr, backend
        self.staging = StagingMaps(cache.spec, cache.device) if ipc else None
        self.transport = "ipc" if ipc else "nixl" if nixl is not None else "tcp"
        self.hold_wait_s, self.delay_s, self.nixl = hold_wait_s, delay_s, nixl
        self.progress = progress
        self._reading: set[str] = set()        # nixl: requests some D may be READing now
        # compile the gather now, not in the first tcp pull's TTFT (P serves tcp pulls always)
        gather_blocks(PagedKVCache(cache.spec, 2, device=cache.device), [1],
                      staging_buffer(cache.spec, 1, device=cache.device), backend=backend)
        self._held: dict[str, float] = {}      # req_id -> deadline (monotonic seconds)
        self._held_ids: dict[str, frozenset[int]] = {}  # req_id -> P's blocks of it
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
    def hold(self, req_id: str, lease_s: float, block_ids: list[int] | None = None) -> None:
        """P's scheduler kept ``req_id``'s blocks ``block_ids`` for D: serve pulls of those
        blocks (any block of P's cache when None) until ``lease_s`` ends."""
        with self._cond:
            self._held[req_id] = time.monotonic() + lease_s
            if block_ids is not None:
                self._held_ids[req_id] = frozenset(block_ids)
            self._cond.notify_all()

    def take_done(self) -> set[str]:
        """Requests whose blocks P may free now (pulled, released, or lease expired)."""
        now = time.monotonic()
        with self._cond:
            for req_id, deadline in list(self._held.items()):
                if deadline <= now:
                    log.warning("request %s: no pull within its lease; freeing P's blocks", req_id)
                    self._held.pop(req_id)
                    self._held_ids.pop(req_id, None)
                    self._reading.discard(req_id)
                    self._done.add(req_id)
            done, self._done = self._done, set()
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        if self.staging is not None:
            self.staging.close()

    # ---- the serving thread ---------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._reading and self.progress is not None:
                self.progress()  # a D READs P's memory: UCX needs P's side to progress
            if not poller.poll(1 if self._reading else 100):
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
            elif isinstance(msg, NixlHello):
                self._sock.send_multipart([ident, encode(self._hello(msg))])
            else:
                log.error("KVServer %s: unexpected frame(s) %s", self.addr, type(msg).__name__)

    def _finish(self, req_id: str) -> None:
        with self._cond:
            self._reading.discard(req_id)
            self._held_ids.pop(req_id, None)
            if self._held.pop(req_id, None) is not None:
                self._done.add(req_id)

    def _answer(self, ident: Any, msg: Pull) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        error = self._check(msg)
        if error:
            self._sock.send_multipart([ident, encode(PullReply(msg.req_id, False, error=error))])
            return
        if msg.nixl:  # D READs the blocks; they stay held until its Release (or the lease)
            with self._cond:
                self._reading.add(msg.req_id)
            self._sock.send_multipart([ident, encode(PullReply(msg.req_id, True,
                                                               agent=self.nixl.agent))])
            return
        if msg.staging:  # ipc: into D's staging cache; held until D's Release (or the lease)
            self.staging.copy_in(self.cache, msg.staging, msg.staging_blocks, msg.block_ids,
                                 self.backend)
            self._sock.send_multipart([ident, encode(PullReply(msg.req_id, True))])
            return
        ids = torch.tensor(msg.block_ids, dtype=torch.int64)
        buf = gather_blocks(self.cache, ids, staging_buffer(self.cache.spec, len(ids),
                                                            device=self.cache.device),
                            backend=self.backend)
        if buf.device.type != "cpu":
            buf = buf.cpu()  # frames are host memory
        frames = layer_frames(buf)
        header = encode(PullReply(msg.req_id, True, num_layers=len(frames)))
        self._sock.send_multipart([ident, header, *frames], copy=False)
        self._finish(msg.req_id)

    def _hello(self, msg: NixlHello) -> NixlInfo:
        if self.nixl is None:
            return NixlInfo(False, error=self._other_transport("nixl"))
        error = self._spec_error(msg.spec)
        return NixlInfo(False, error=error) if error else self.nixl

    def _other_transport(self, wanted: str) -> str:
        return (f"P at {self.addr} has transport {self.transport!r}; set "
                f"kv_connector_extra_config transport {wanted!r} on P too")

    def _spec_error(self, spec: dict[str, Any]) -> str:
        try:
            theirs = KVCacheSpec.from_dict(spec)
        except (TypeError, ValueError) as exc:
            return f"D's spec {spec} is not a KVCacheSpec: {exc}"
        diff = self.cache.spec.diff(theirs)
        if diff:
            return "P and D caches differ: " + "; ".join(f"{d} (P vs D)" for d in diff)
        return ""

    def _check(self, msg: Pull) -> str:
        error = self._spec_error(msg.spec)
        if error:
            return error
        if msg.nixl and self.nixl is None:
            return self._other_transport("nixl")
        bad = [b for b in msg.block_ids if b >= self.cache.num_blocks]
        if bad:
            return (f"block id {bad[0]} is out of range for P's cache of "
                    f"{self.cache.num_blocks} blocks")
        if msg.staging:
            error = (self._other_transport("ipc") if self.staging is None
                     else check_ipc_pull(msg, self.staging))
            if error:
                return error
        deadline = time.monotonic() + self.hold_wait_s
        with self._cond:
            while msg.req_id not in self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"P holds no blocks for request {msg.req_id!r} (freed or never held)"
                self._cond.wait(left)
            held = self._held_ids.get(msg.req_id)
            foreign = [b for b in msg.block_ids if held is not None and b not in held]
        if foreign:
            return (f"block ids {foreign} are not blocks of request {msg.req_id!r} (P holds "
                    f"{sorted(held)})")
        return ""


class KVPuller(Puller):
    """D's end of transport ``tcp`` (:class:`.link.Puller`): P's answer carries one frame per
    layer, viewed without a copy and scattered into D's blocks.

    Parameters
    ----------
    cache, timeout_s, corrupt
        As :class:`.link.Puller`.
    backend : str
        kvflow backend for ``scatter_blocks``.
    """

    def __init__(self, cache: PagedKVCache, *, timeout_s: float = 30.0, backend: str = "auto",
                 corrupt: bool = False) -> None:
        super().__init__(cache, timeout_s=timeout_s, corrupt=corrupt)
        self.backend = backend
        # compile the scatter now, not in the first request's TTFT
        scatter_blocks(staging_buffer(cache.spec, 1, device=cache.device),
                       PagedKVCache(cache.spec, 2, device=cache.device), [1], backend=backend)

    def _pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> int:
        spec, n = self.cache.spec, len(remote_ids)
        reply, frames = self._ask_pull(addr, Pull(req_id, remote_ids, spec.to_dict()))
        corrupt = (lambda src: torch.randn(src.shape).to(spec.dtype)) if self.corrupt else None
        scatter_frames(frames, self.cache, torch.tensor(local_ids, dtype=torch.int64),
                       range(spec.num_layers), req_id=req_id, error=PullError,
                       count_msg=FRAME_COUNT, size_msg=FRAME_SIZE, num_frames=reply.num_layers,
                       num_blocks=n, backend=self.backend, src_fn=corrupt)
        return n * spec.bytes_per_block
