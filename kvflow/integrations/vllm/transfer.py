"""P's :class:`KVServer` (every transport), D's :class:`KVPuller` (``tcp``) and
:func:`open_puller` (D's end of any transport). P serves only a request it holds, only its
blocks, only to a D of its spec. docs/tutorials/vllm.md, "What happens to one request"."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import zmq

from kvflow.cache import PagedKVCache, staging_buffer
from kvflow.connector.transport.frames import layer_frames, scatter_frames, warm_staging
from kvflow.kernels import gather_blocks
from kvflow.layout import KVCacheSpec
from kvflow.wire import ProtocolError

from .config import check_transport
from .ipc_push import IpcPuller, StagingMaps
from .link import Puller, PullError
from .messages import NixlHello, NixlInfo, Pull, PullReply, Release, decode, encode

log = logging.getLogger("kvflow.integrations.vllm")

FRAME_COUNT = "request {req_id}: {got} layer frames, expected {expected}"
FRAME_SIZE = "request {req_id}: layer {layer} frame holds {nbytes} bytes, expected {expected}"


class KVServer:
    """P's end: a ROUTER socket bound at ``addr`` over P's ``cache``, served by one thread, for
    ``transport`` ``tcp`` (always served), ``nixl`` (``cache`` registered with :attr:`agent`) or
    ``ipc-push`` (copies into D's staging cache); ``hold_wait_s``: a pull's wait for its request to
    be held, ``delay_s``: test hook, sleep before answering (s). ValueError: unknown ``transport``;
    ``nixl``: as :func:`.nixl_pull.export`."""

    def __init__(self, cache: PagedKVCache, addr: str, *, transport: str = "tcp",
                 backend: str = "auto", hold_wait_s: float = 5.0, delay_s: float = 0.0) -> None:
        self.transport = check_transport(transport)
        self.cache, self.addr, self.backend = cache, addr, backend
        self.hold_wait_s, self.delay_s = hold_wait_s, delay_s
        self.staging = StagingMaps(cache.spec, cache.device) if transport == "ipc-push" else None
        self.agent, self.nixl = None, None
        if transport == "nixl":
            from .nixl_pull import export
            self.agent, self.nixl = export(cache)
        # compile the gather now, not in the first tcp pull's TTFT (P serves tcp pulls always)
        warm_staging(cache.spec, cache.device, backend)
        self._held: dict[str, tuple[float, frozenset[int] | None]] = {}  # deadline, P's blocks
        self._reading: set[str] = set()        # nixl: requests some D may be READing now
        self._done: set[str] = set()           # pulled, released or expired: P may free
        self._cond = threading.Condition()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvflow-kv-server", daemon=True)
        self._thread.start()

    def hold(self, req_id: str, lease_s: float, block_ids: list[int] | None = None) -> None:
        """Serve pulls of ``req_id``'s ``block_ids`` (None: any) for ``lease_s`` seconds."""
        with self._cond:
            self._held[req_id] = (time.monotonic() + lease_s,
                                  None if block_ids is None else frozenset(block_ids))
            self._cond.notify_all()

    def take_done(self) -> set[str]:
        """Requests whose blocks P may free (pulled, released, or lease expired)."""
        now = time.monotonic()
        with self._cond:
            for req_id, (deadline, _) in list(self._held.items()):
                if deadline <= now:
                    log.warning("request %s: no pull within its lease; freeing P's blocks", req_id)
                    self._finish(req_id)
            done, self._done = self._done, set()
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        if self.staging is not None:
            self.staging.clear()
        if self.agent is not None:
            self.agent.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._reading:
                self.agent.progress()  # a D READs P's memory: UCX needs P's side to progress
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
            if self._held.pop(req_id, None) is not None:
                self._done.add(req_id)

    def _answer(self, ident: Any, msg: Pull) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        error, frames = self._check(msg), []
        if not error and msg.nixl:  # D READs the blocks; held until its Release (or the lease)
            with self._cond:
                self._reading.add(msg.req_id)
        elif not error and msg.staging:  # into D's staging; held until its Release (or lease)
            self.staging.copy_in(self.cache, msg, self.backend)
        elif not error:
            buf = staging_buffer(self.cache.spec, len(msg.block_ids), device=self.cache.device)
            gather_blocks(self.cache, torch.tensor(msg.block_ids, dtype=torch.int64), buf,
                          backend=self.backend)
            frames = layer_frames(buf.cpu())  # frames are host memory
        reply = PullReply(msg.req_id, not error, len(frames), error,
                          self.nixl.agent if msg.nixl and not error else "")
        self._sock.send_multipart([ident, encode(reply), *frames], copy=False)
        if frames:
            self._finish(msg.req_id)

    def _hello(self, msg: NixlHello) -> NixlInfo:
        error = self._other_transport("nixl") if self.nixl is None else self._spec_error(msg.spec)
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
        return "P and D caches differ: " + "; ".join(f"{d} (P vs D)" for d in diff) if diff else ""

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
        if msg.staging and (error := self._other_transport("ipc-push") if self.staging is None
                            else self.staging.refusal(msg)):
            return error
        deadline = time.monotonic() + self.hold_wait_s
        with self._cond:
            while msg.req_id not in self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"P holds no blocks for request {msg.req_id!r} (freed or never held)"
                self._cond.wait(left)
            held = self._held[msg.req_id][1]
        foreign = [b for b in msg.block_ids if held is not None and b not in held]
        if foreign:
            return (f"block ids {foreign} are not blocks of request {msg.req_id!r} (P holds "
                    f"{sorted(held)})")
        return ""


class KVPuller(Puller):
    """D's end of transport ``tcp``: P's answer carries one frame per layer, each checked and
    scattered into D's blocks (the arguments: as :class:`.link.Puller`)."""

    def __init__(self, cache: PagedKVCache, *, timeout_s: float = 30.0, backend: str = "auto",
                 corrupt: bool = False) -> None:
        super().__init__(cache, timeout_s=timeout_s, corrupt=corrupt)
        self.backend = backend
        # compile the scatter now, not in the first request's TTFT
        warm_staging(cache.spec, cache.device, backend, scatter=True)

    def _pull(self, addr: str, req_id: str, remote_ids: list[int], local_ids: list[int]) -> None:
        spec = self.cache.spec
        reply, frames = self._ask_pull(addr, Pull(req_id, remote_ids, spec.to_dict()))
        scatter_frames(frames, self.cache, torch.tensor(local_ids, dtype=torch.int64),
                       range(spec.num_layers), req_id=req_id, error=PullError,
                       count_msg=FRAME_COUNT, size_msg=FRAME_SIZE, num_frames=reply.num_layers,
                       backend=self.backend)


def open_puller(transport: str, cache: PagedKVCache, *, timeout_s: float = 30.0,
                backend: str = "auto", corrupt: bool = False,
                staging_blocks: int | None = None) -> Puller:
    """D's end of ``transport`` over D's ``cache`` (``staging_blocks``: ipc-push's; the rest as
    :class:`.link.Puller`); ValueError for an unknown ``transport`` or bad ``staging_blocks``."""
    if check_transport(transport) == "nixl":
        from .nixl_pull import NixlPuller
        return NixlPuller(cache, timeout_s=timeout_s, corrupt=corrupt)
    if transport == "ipc-push":
        return IpcPuller(cache, staging_blocks=staging_blocks, timeout_s=timeout_s,
                         backend=backend, corrupt=corrupt)
    return KVPuller(cache, timeout_s=timeout_s, backend=backend, corrupt=corrupt)
