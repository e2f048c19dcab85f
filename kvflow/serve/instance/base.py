"""What every serving instance shares: start-up in the profile-run order (docs/design.md,
"Nothing is signalled or sent during a profile run") and registration with the router."""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from kvflow.serve.protocol import Register, Registered
from kvflow.segments import host_id

from ..launch.config import ServeConfig
from .fingerprint import model_fingerprint
from .loop import EventLoop
from ..launch.startup import StartupError

log = logging.getLogger("kvflow.serve")


class Instance(EventLoop):
    """Base of P, D and colocated instances (subclasses add :meth:`setup`, handlers, work)."""

    role = ""

    def __init__(self, cfg: ServeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.instance_id = f"{self.role[0]}-{os.getpid()}-{secrets.token_hex(3)}"
        self.registered = False
        self._reregistered_at = 0.0  # monotonic time of the last Register asked for again
        self.fatal = ""  # set when the router refused this instance: print it and exit 1

    def startup(self) -> None:
        """Load, size (profile run), allocate, warm up; then open sockets and register. Raises
        :class:`StartupError` on model, memory budget or segment failures."""
        from kvflow.layout import as_torch_dtype
        from kvflow.model import load_model
        from ..launch.budget import memory_budget
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
        self.spec = role_spec(self.model, cfg, self.role)
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or min(limit, 2048), limit)
        t0 = time.perf_counter()
        self.fingerprint = model_fingerprint(self.model, self.max_model_len)
        log.info("%s model fingerprint: weights %s (%.0f ms)", self.instance_id,
                 self.fingerprint["weights"], (time.perf_counter() - t0) * 1e3)
        self.num_blocks = cfg.num_blocks or self.profile(budget)
        self.setup()
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
                                max_model_len=self.max_model_len, kv_connector=self.connector_name(),
                                pid=os.getpid(), host_id=host_id(), fingerprint=self.fingerprint,
                                model=self.cfg.model, tokenizer=self.tokenizer.digest,
                                **self.register_extra()))

    def wait_registered(self, timeout_s: float, note_every_s: float = 3.0) -> None:
        """Wait for the router's answer to :class:`Register`, handling what arrives meanwhile (warns
        every ``note_every_s``); :class:`StartupError`: refused, or no answer within ``timeout_s``.
        """
        t0 = time.monotonic()
        next_note = t0 + min(1.0, note_every_s)
        while not self.registered and not self.fatal:
            now = time.monotonic()
            if now >= t0 + timeout_s:
                raise StartupError(
                    f"no answer from the router at {self.cfg.router_url} within "
                    f"--register-timeout-s {timeout_s:g}; start the router first "
                    f"(python -m kvflow.serve --role router), fix --router-url, or wait "
                    f"longer with a larger --register-timeout-s")
            if now >= next_note:
                log.warning("%s: waiting for the router at %s (%.0f s; giving up after "
                            "--register-timeout-s %g)", self.instance_id, self.cfg.router_url,
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
        self.fatal = (f"the router at {self.cfg.router_url} refused this {self.role} instance: "
                      f"{msg.error}")
        self.stopping = True

    def on_reregister(self, msg, frames, ident) -> None:
        """Register again, once: asks queued behind the first wait up to 5 s for its answer."""
        now = time.monotonic()
        if not self.registered and now - self._reregistered_at < 5.0:
            return
        log.warning("%s: the router lost this instance (%s); registering again", self.instance_id,
                    msg.reason or "no reason given")
        self.registered, self._reregistered_at = False, now
        self.register()

    def profile(self, budget) -> int:
        """``num_blocks`` from a profile run (nothing sent) in ``budget`` (a ``MemoryBudget``);
        :class:`StartupError` when it leaves no room for one block."""
        from kvflow.engine import MemoryBudgetError, determine_num_blocks
        from ..launch.budget import too_small_message
        assert self.ctrl is None, "profile run must happen before any channel exists"
        try:
            n = determine_num_blocks(self.model, self.spec, memory_budget_bytes=budget.bytes,
                                     max_num_batched_tokens=min(self.cfg.max_num_batched_tokens,
                                                                self.max_model_len),
                                     device=self.cfg.device)
        except MemoryBudgetError as exc:
            raise StartupError(too_small_message(budget, exc, self.cfg.model)) from None
        log.info("%s profile run: %d blocks fit in %s", self.instance_id, n, budget.describe())
        return n

    def setup(self) -> None:
        """Allocate the cache, build the engine and allocator, warm up (no socket yet)."""
        raise NotImplementedError

    def make_connector(self, make: Any, **kw: Any) -> Any:
        """P's sender or D's receiver (``make``: :func:`kvflow.connector.make_sender` or
        ``make_receiver``) bound to ``--host``, with ``--kv-verify``; then its cache, the engine and
        the allocator. :class:`StartupError`: unknown connector or option, or unverifiable kind."""
        from kvflow.blocks import BlockAllocator
        from kvflow.connector import bind_to_host, kinds
        from kvflow.engine import Engine
        cfg = self.cfg
        try:
            conn = make(cfg.kv_connector, self.spec, cfg.device, backend=cfg.backend,
                        config=cfg.kv_connector_config, max_model_len=self.max_model_len, **kw)
            bind_to_host(conn.name, cfg.host)  # before its transport listens
        except ValueError as exc:  # unknown connector or option: one line
            raise StartupError(str(exc)) from None
        if cfg.kv_verify:  # checked with the flags too (kvflow.serve.launch.checks)
            if not hasattr(conn, "verify"):
                verified = " and ".join(kinds.with_capability("kv_verify"))
                raise StartupError(f"--kv-verify checks the {verified} connectors, not {conn.name}")
            conn.verify = True
        self.cache = conn.make_cache(self.num_blocks)
        self.engine = Engine(self.model, self.cache)
        self.allocator = BlockAllocator(self.num_blocks)
        return conn

    def connector_name(self) -> str:
        """The connector kind named in :class:`Register` (the router pairs equal ones)."""
        return "none"

    def register_extra(self) -> dict[str, str]:
        return {}

    def free_blocks(self) -> int:
        return self.allocator.num_free


def role_spec(model: Any, cfg: Any, role: str) -> Any:
    """The KV cache spec of ``role``: from ``--block-size``, ``--kv-layout``, ``--kv-dtype``, for D
    with the ``--decode-*`` flags where given."""
    from kvflow.layout import as_torch_dtype
    bs, layout, dtype = cfg.block_size, cfg.kv_layout, cfg.kv_dtype
    if role == "decode":
        bs = cfg.decode_block_size or bs
        layout = cfg.decode_kv_layout or layout
        dtype = cfg.decode_kv_dtype or dtype
    return model.kv_spec(bs, dtype=None if dtype is None else as_torch_dtype(dtype), layout=layout)
