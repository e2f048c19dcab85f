"""What every serving instance (prefill P, decode D, colocated) shares: start-up, the ZMQ
event loop, registration and heartbeats.

Start-up order (:meth:`Instance.startup`) is the profile-run rule of DESIGN.md made concrete:

1. take the memory budget (:mod:`kvflow.serve.budget`: on CUDA a fraction of the GPU's free
   memory, measured before the weights load); load the model; build its
   :class:`~kvflow.layout.KVCacheSpec`;
2. size ``num_blocks`` with :func:`kvflow.engine.determine_num_blocks` (a profile run with
   ``is_dummy_or_profile_run`` set) unless ``--num-blocks`` was given; **no socket exists yet**,
   so nothing can be signalled or sent;
3. allocate the cache (P with ``ipc``: in shared memory), warm the copy kernels;
4. only then open the ZMQ sockets and :class:`~kvflow.protocol.Register` with the router;
   the CLI then waits for its :class:`~kvflow.protocol.Registered`
   (:meth:`Instance.wait_registered`, bounded by ``--register-timeout-s``). A failure at any
   step is one line (:class:`~kvflow.serve.startup.StartupError`).

The loop (:meth:`Instance.serve_forever`) polls its sockets, hands each decoded message to
``on_<type>`` handlers, does one unit of work (:meth:`Instance.work`: a prefill on P, a decode
step on D) and sends a heartbeat (free blocks) every ``heartbeat_s``. Malformed frames are
logged and dropped (:func:`kvflow.protocol.decode_or_log`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import time
from typing import Any

import torch
import zmq

from kvflow.layerwise.scheduler import DEFAULT_LAYERWISE_MIN_TOKENS
from kvflow.cache import PagedKVCache
from kvflow.context import sends_allowed
from kvflow.layout import KVCacheSpec
from kvflow.protocol import Heartbeat, Register, Registered, decode_or_log, encode

from .config import ServeConfig
from .fingerprint import check_fingerprint, model_fingerprint
from .liveness import host_id
from .startup import StartupError

log = logging.getLogger("kvflow.serve")


#: ``--layerwise-min-tokens`` default with ipc push: P's per-layer copies are GPU-ordered
#: (an event and a launch per layer, no host round trip), so every prompt goes layer by layer.
PUSH_LAYERWISE_MIN_TOKENS = 0


def uses_push(cfg: ServeConfig) -> bool:
    """True when P writes into D's cache (ipc, ``ipc_direction`` push, or auto on CUDA).

    Raises
    ------
    ValueError
        For an ``ipc_direction`` other than auto, push or pull.
    """
    if cfg.ipc_direction not in ("auto", "push", "pull"):
        raise ValueError(f"ipc_direction must be 'auto', 'push' or 'pull', got {cfg.ipc_direction!r}")
    if cfg.transfer != "ipc" or cfg.role not in ("prefill", "decode"):
        return False
    return cfg.ipc_direction == "push" or (cfg.ipc_direction == "auto"
                                          and str(cfg.device).startswith("cuda"))


def layerwise_min_tokens(cfg: ServeConfig) -> int:
    """The prompt length from which P goes layer by layer: the flag if given, else
    :data:`PUSH_LAYERWISE_MIN_TOKENS` with push and ``DEFAULT_LAYERWISE_MIN_TOKENS`` otherwise."""
    if cfg.layerwise_min_tokens is not None:
        return cfg.layerwise_min_tokens
    return PUSH_LAYERWISE_MIN_TOKENS if uses_push(cfg) else DEFAULT_LAYERWISE_MIN_TOKENS


def sample_token(logits: torch.Tensor, temperature: float, seed: int, index: int) -> int:
    """Sample generated token number ``index`` of a request: greedy at temperature 0, else a
    draw from a generator seeded by ``(seed, index)``, so P (the first token) and D (the rest)
    draw exactly what one colocated instance would."""
    from kvflow.engine import sample
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=logits.device).manual_seed((seed * 1_000_003 + index) % 2**63)
    return sample(logits, temperature, gen)


def stop_reason(token: int, num_generated: int, max_tokens: int, num_tokens: int,
                max_model_len: int, eos: int | None, ignore_eos: bool) -> str:
    """Why generation stops after ``token`` ("stop", "length"), or "" to go on.
    ``num_tokens`` counts prompt + generated tokens."""
    if not ignore_eos and eos is not None and token == eos:
        return "stop"
    if num_generated >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return ""


def check_pairing(mine: KVCacheSpec, my_id: str, peer: dict[str, Any], peer_id: str) -> str:
    """'' when the peer's KV cache spec equals ours, else an error naming every differing field
    with both values, e.g. ``block_size: 16 (p-1-ab) vs 32 (d-2-cd)``."""
    try:
        theirs = KVCacheSpec.from_dict(peer)
    except (TypeError, ValueError) as exc:
        return f"pairing refused: {peer_id} sent an invalid KV cache spec {peer!r}: {exc}"
    diffs = [f"{f.name}: {getattr(mine, f.name)} ({my_id}) vs {getattr(theirs, f.name)} ({peer_id})"
             for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
    return "KV cache spec mismatch, pairing refused: " + "; ".join(diffs) if diffs else ""


def check_peer(inst: "Instance", msg: Any) -> str:
    """'' when the peer of ``msg`` (:class:`~kvflow.protocol.Pair`) may pair with ``inst``: equal
    KV cache spec (:func:`check_pairing`), then equal model fingerprint
    (:func:`~kvflow.serve.fingerprint.check_fingerprint`); else the refusal."""
    return (check_pairing(inst.spec, inst.instance_id, msg.peer_spec, msg.peer_id)
            or check_fingerprint(inst.fingerprint, inst.instance_id, msg.peer_fingerprint,
                                 msg.peer_id))


class Instance:
    """Base of P, D and colocated instances (subclasses add handlers and :meth:`work`)."""

    role = ""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.instance_id = f"{self.role[0]}-{os.getpid()}-{secrets.token_hex(3)}"
        self.stopping = False
        self.ctx: zmq.Context | None = None
        self.ctrl: zmq.Socket | None = None
        self.sockets: dict[Any, str] = {}
        self._last_hb = 0.0
        self.messages_sent = 0
        self.registered = False
        self.fatal = ""  # set when the router refused this instance: print it and exit 1

    # ---- start-up -------------------------------------------------------------------
    def startup(self) -> None:
        """Load, size (profile run), allocate, warm up; then open sockets and register."""
        from kvflow.engine import Engine
        from kvflow.layout import as_torch_dtype
        from kvflow.model import load_model
        from kvflow.sched import BlockAllocator

        from .budget import memory_budget
        cfg = self.cfg
        # the GPU's free memory is measured before this instance's weights take any of it
        budget = None if cfg.num_blocks else memory_budget(cfg.device, cfg.memory_budget_mb,
                                                           cfg.gpu_memory_utilization)
        try:
            self.model, self.tokenizer = load_model(cfg.model, dtype=as_torch_dtype(cfg.dtype),
                                                    device=cfg.device)
        except (ValueError, OSError) as exc:  # checkpoint errors: named files and tensors
            raise StartupError(f"--model {cfg.model!r}: {exc}") from None
        except Exception as exc:  # e.g. a corrupt safetensors file, out of memory
            raise StartupError(f"--model {cfg.model!r}: {type(exc).__name__}: {exc}") from None
        self.spec = self.model.kv_spec(cfg.block_size)
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or min(limit, 2048), limit)
        t0 = time.perf_counter()
        self.fingerprint = model_fingerprint(self.model, self.max_model_len)
        log.info("%s model fingerprint: weights %s (%.0f ms)", self.instance_id,
                 self.fingerprint["weights"], (time.perf_counter() - t0) * 1e3)
        self.num_blocks = cfg.num_blocks or self.profile(budget)
        self.cache = self.make_cache(self.num_blocks)
        self.engine = Engine(self.model, self.cache)
        self.allocator = BlockAllocator(self.num_blocks)
        self.warmup()
        self.open_channels()
        self.register()
        log.info("%s ready: %d blocks of %d tokens (%d bytes each), max_model_len %d",
                 self.instance_id, self.num_blocks, self.spec.block_size,
                 self.spec.bytes_per_block, self.max_model_len)

    def register(self) -> None:
        """Send the router this instance's :class:`Register` (at start-up, and again when the
        router asks: :class:`Reregister`)."""
        self.send_ctrl(Register(instance_id=self.instance_id, role=self.role,
                                spec=self.spec.to_dict(), num_blocks=self.num_blocks,
                                free_blocks=self.free_blocks(),
                                max_model_len=self.max_model_len, transfer=self.transfer_name(),
                                pid=os.getpid(), host_id=host_id(), fingerprint=self.fingerprint,
                                model=self.cfg.model, tokenizer=self.tokenizer.digest,
                                **self.register_extra()))

    def wait_registered(self, timeout_s: float, note_every_s: float = 3.0) -> None:
        """Wait until the router answers :class:`Register` (after :meth:`startup`), handling
        what arrives meanwhile; say so at warning level after 1 s, then every
        ``note_every_s``.

        Raises
        ------
        StartupError
            The router refused this instance (its reason), or did not answer within
            ``timeout_s`` (``--register-timeout-s``).
        """
        t0 = time.monotonic()
        next_note = t0 + min(1.0, note_every_s)
        while not self.registered and not self.fatal:
            now = time.monotonic()
            if now >= t0 + timeout_s:
                raise StartupError(
                    f"no answer from the router at {self.cfg.router_addr} within "
                    f"--register-timeout-s {timeout_s:g}; start the router first "
                    f"(python -m kvflow.serve --role router), fix --router-url, or wait "
                    f"longer with a larger --register-timeout-s")
            if now >= next_note:
                log.warning("%s: waiting for the router at %s (%.0f s; giving up after "
                            "--register-timeout-s %g)", self.instance_id, self.cfg.router_addr,
                            now - t0, timeout_s)
                next_note += note_every_s
            if self.ctrl.poll(int(1000 * min(0.1, max(0.0, t0 + timeout_s - now))) + 1):
                self.drain(self.ctrl)
        if self.fatal:
            raise StartupError(self.fatal)

    def on_registered(self, msg: Registered, frames, ident) -> None:
        if msg.ok:
            self.registered = True
            return
        # printed (one line) by whoever started the instance; serve_forever stops
        self.fatal = (f"the router at {self.cfg.router_addr} refused this {self.role} instance: "
                      f"{msg.error}")
        self.stopping = True

    def on_reregister(self, msg, frames, ident) -> None:
        log.warning("%s: the router lost this instance (%s); registering again", self.instance_id,
                    msg.reason or "no reason given")
        self.register()

    def profile(self, budget=None) -> int:
        """``num_blocks`` from a profile run at ``max_num_batched_tokens`` (nothing sent) in
        ``budget`` (:class:`~kvflow.serve.budget.MemoryBudget`; default from the config).

        Raises
        ------
        StartupError
            The budget leaves no room for one block (naming the flag and the value that fits).
        """
        from kvflow.engine import MemoryBudgetError, determine_num_blocks

        from .budget import memory_budget, too_small_message
        assert self.ctrl is None, "profile run must happen before any channel exists"
        if budget is None:
            budget = memory_budget(self.cfg.device, self.cfg.memory_budget_mb,
                                   self.cfg.gpu_memory_utilization)
        try:
            n = determine_num_blocks(self.model, self.spec, memory_budget_bytes=budget.bytes,
                                     max_num_batched_tokens=min(self.cfg.max_num_batched_tokens,
                                                                self.max_model_len),
                                     device=self.cfg.device)
        except MemoryBudgetError as exc:
            raise StartupError(too_small_message(budget, exc, self.cfg.model)) from None
        log.info("%s profile run: %d blocks fit in %s", self.instance_id, n, budget.describe())
        return n

    def make_cache(self, num_blocks: int) -> PagedKVCache:
        return PagedKVCache(self.spec, num_blocks, device=self.cfg.device)

    def warmup(self) -> None:
        """Compile the block-movement kernels on a scratch cache (no channel, nothing sent)."""

    def transfer_name(self) -> str:
        return "ipc-push" if uses_push(self.cfg) else self.cfg.transfer

    def register_extra(self) -> dict[str, str]:
        return {}

    def open_channels(self) -> None:
        """Create the ZMQ sockets (after the profile run)."""
        self.ctx = zmq.Context()
        # every socket of this context waits at most 1 s for unsent messages when it closes, so
        # ending the context (close, or its garbage collection after a failed start) never hangs
        self.ctx.setsockopt(zmq.LINGER, 1000)
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, self.instance_id.encode())
        self.ctrl.setsockopt(zmq.LINGER, 500)
        self.ctrl.connect(self.cfg.router_addr)
        self.sockets[self.ctrl] = "router"

    # ---- sending --------------------------------------------------------------------
    def send_ctrl(self, msg: Any) -> None:
        """Send a control message to the router."""
        self.send(self.ctrl, msg)

    def send(self, sock: zmq.Socket, msg: Any, *, ident: bytes | None = None) -> None:
        if not sends_allowed():
            raise RuntimeError("send during a dummy/profile run: nothing may be sent while "
                               "is_dummy_or_profile_run is set")
        frame = encode(msg)
        sock.send_multipart([ident, frame] if ident is not None else [frame])
        self.messages_sent += 1

    # ---- loop -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return False

    def work(self) -> None:
        """One unit of work (a prefill, a decode step)."""

    def free_blocks(self) -> int:
        return self.allocator.num_free

    def report_blocks(self) -> None:
        """Send a :class:`Heartbeat` (free blocks, running requests) now."""
        self._last_hb = time.monotonic()
        self.send_ctrl(Heartbeat(instance_id=self.instance_id, free_blocks=self.free_blocks(),
                                 num_running=self.num_running()))

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_hb >= self.cfg.heartbeat_s:
            self.report_blocks()
            if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                log.error("%s: parent %d is gone; exiting", self.instance_id, self.cfg.parent_pid)
                self.stopping = True

    def num_running(self) -> int:
        return 0

    def drain(self, sock: zmq.Socket) -> None:
        """Dispatch every message waiting on ``sock`` without blocking."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.dispatch(sock, frames)

    def dispatch(self, sock: zmq.Socket, frames: list[Any]) -> None:
        ident = None
        if sock.type == zmq.ROUTER:
            ident, frames = frames[0].bytes, frames[1:]
        if not frames:
            return
        msg = decode_or_log(frames[0], self.sockets[sock])
        if msg is None:
            return
        handler = getattr(self, f"on_{type(msg).__name__.lower()}", None)
        if handler is None:
            log.error("%s: unexpected %s from %s; dropped", self.instance_id,
                      type(msg).__name__, self.sockets[sock])
            return
        try:
            handler(msg, frames[1:], ident)
        except Exception:  # one bad request must not take the instance down
            log.exception("%s: handling %s failed", self.instance_id, type(msg).__name__)

    def serve_forever(self) -> None:
        poller, polled = zmq.Poller(), set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping:
                if polled != set(self.sockets):  # a socket was opened (pairing) or closed
                    poller, polled = zmq.Poller(), set(self.sockets)
                    for sock in polled:
                        poller.register(sock, zmq.POLLIN)
                timeout = 0 if self.has_work() else int(self.cfg.heartbeat_s * 250)
                for sock, _ in poller.poll(timeout):
                    self.drain(sock)
                if self.has_work():
                    self.work()
                self.heartbeat()
        finally:
            self.close()

    def close(self) -> None:
        for sock in list(self.sockets):
            sock.close(0)
        self.sockets.clear()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
