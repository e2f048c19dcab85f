"""One NIXL agent per instance: register memory once, meet peers from their
:class:`~kvflow.connector.messages.NixlAgentInfo` metadata (no etcd, no metadata server), prepare
descriptor lists (:func:`~.nixl_plan.block_descs`) once per peer, post WRITEs (or READs: the vLLM
connector's pull) and wait for them with a bound. Progress: :mod:`.nixl_progress`.
"""

from __future__ import annotations

import importlib
import secrets
import threading
import time
from typing import Any

import numpy as np

from . import TransferError
from .nixl_progress import ProgressDriver

NIXL_MODULES = ("nixl._api", "nixl_cu12", "nixl_cu13")  # NIXL's Python API, tried in order


def import_nixl() -> Any:
    """NIXL's Python API module; ImportError (naming the pip package) when none imports."""
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
    raise ImportError("the nixl connector needs NIXL: pip install 'kvflow[nixl]' (or "
                      "nixl-cu12 / nixl-cu13 1.5.1); " + "; ".join(errors))


def tcp_tls() -> str:
    """The ``UCX_TLS`` value that keeps UCX on TCP: ``"tcp"``, or ``"tcp,cuda_copy"`` where
    torch sees a CUDA GPU (NIXL's UCX backend refuses ``tcp`` alone there)."""
    import torch
    return "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"


def nixl_available() -> bool:
    """NIXL imports here (tests of the nixl connector skip otherwise)."""
    try:
        import_nixl()
    except ImportError:
        return False
    return True


def mem_type(tensor: Any) -> tuple[str, int]:
    """NIXL's memory type and device id of ``tensor``: ``("DRAM", 0)`` on the host,
    ``("VRAM", ordinal)`` on a CUDA GPU; TransferError on another device type."""
    dev = tensor.device
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        return "VRAM", dev.index if dev.index is not None else 0
    raise TransferError(f"NIXL moves host (cpu) or CUDA memory; got a tensor on {dev}")


class Agent:
    """This instance's NIXL agent and what it knows of its peers.

    ``role`` is part of the agent's name, beside a random part; ``telemetry`` captures
    per-transfer telemetry (tests). ``progress_thread``: NIXL's busy progress thread (default;
    without it a READ or WRITE target must call :meth:`progress`: docs/nixl.md, "Progress
    without a busy thread"). ``driven``: kvflow's
    :class:`~kvflow.connector.transport.nixl_progress.ProgressDriver` instead, fast while a
    posted transfer is not waited for or a key is held (:meth:`hold`); ValueError with
    ``progress_thread``.
    """

    def __init__(self, role: str, *, telemetry: bool = False,
                 progress_thread: bool = True, driven: bool = False) -> None:
        if driven and progress_thread:
            raise ValueError("Agent(driven=True) replaces NIXL's progress thread: pass "
                             "progress_thread=False")
        nixl = import_nixl()
        self.name = f"nixl-{role}-{secrets.token_hex(6)}"  # unique per instance, no segment
        conf = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                      capture_telemetry=telemetry)
        self.agent = nixl.nixl_agent(self.name, conf)
        self._lock = threading.RLock()  # NIXL's agent (sync mode NONE) is not thread-safe
        if "UCX" not in self.agent.backends:
            raise TransferError(f"NIXL has no UCX backend here (plugins: "
                                f"{self.agent.get_plugin_list()})")
        self.regs: list[Any] = []
        self.peers: dict[str, str] = {}  # peer instance id -> its agent's name
        self.notifs: dict[str, list[bytes]] = {}  # agent name -> notifications not taken yet
        self.descs_posted = 0  # descriptors posted in WRITEs/READs (issue 28's descs column)
        self.post_ms = 0.0  # ms spent in NIXL's make_prepped_xfer + transfer calls
        self.driver = ProgressDriver(self.progress, self.name) if driven else None

    def _quietly(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` under the lock, ignoring its error (a gone peer, an uncancellable
        transfer: NIXL frees it with the agent)."""
        try:
            with self._lock:
                fn(*args)
        except Exception:
            pass

    def hold(self, key: Any) -> None:
        """Driven: progress fast until :meth:`release` of ``key``; else nothing."""
        if self.driver is not None:
            self.driver.hold(key)

    def release(self, key: Any) -> None:
        """Undo one :meth:`hold` of ``key``."""
        if self.driver is not None:
            self.driver.release(key)

    def register(self, tensor: Any, descs: np.ndarray | None = None, mem: str = "DRAM") -> Any:
        """Register a contiguous host or CUDA tensor once; with ``descs``, return their
        prepared list on it (:meth:`prep`), else None."""
        with self._lock:
            self.regs.append(self.agent.register_memory(tensor))
        return None if descs is None else self.prep("", descs, mem)

    def metadata(self) -> bytes:
        """This agent's metadata (after every :meth:`register`)."""
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, peer_id: str, metadata: bytes) -> str:
        """Load peer ``peer_id``'s agent metadata (replacing an earlier one); returns its agent
        name. TransferError when NIXL refuses the metadata."""
        self.remove_peer(peer_id)
        try:
            with self._lock:
                name = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL could not load the agent metadata of {peer_id} "
                                f"({len(metadata)} bytes): {type(exc).__name__}: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else name
        self.peers[peer_id] = name
        return name

    def remove_peer(self, peer_id: str) -> None:
        """Forget peer ``peer_id``'s agent: NIXL disconnects from it."""
        name = self.peers.pop(peer_id, None)
        with self._lock:
            self.notifs.pop(name, None)
        if name is not None:
            self._quietly(self.agent.remove_remote_agent, name)

    def prep(self, agent: str, descs: np.ndarray, mem: str = "DRAM") -> Any:
        """A prepared descriptor list (``prep_xfer_dlist``) of ``descs`` on ``agent``'s memory
        ('' : this agent's own) of NIXL memory type ``mem`` (``DRAM`` or ``VRAM``)."""
        with self._lock:
            return self.agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", descs, mem)

    def write(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
              what: str) -> Any:
        """Post one WRITE of prepared descriptors ``local_idx`` into ``remote_idx``; returns its
        handle (:meth:`wait`). TransferError, naming ``what``, when NIXL refuses or fails it."""
        return self._post("WRITE", local, local_idx, remote, remote_idx, what)

    def read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             what: str) -> Any:
        """As :meth:`write`, reading the peer's ``remote_idx`` into ``local_idx`` (wait with
        ``wait(..., op="READ")``)."""
        return self._post("READ", local, local_idx, remote, remote_idx, what)

    def _post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any,
              remote_idx: np.ndarray, what: str) -> Any:
        try:
            with self._lock:
                t0 = time.perf_counter()
                handle = self.agent.make_prepped_xfer(op, local, local_idx.astype(np.int32),
                                                      remote, remote_idx.astype(np.int32))
                state = self.agent.transfer(handle)
                self.post_ms += (time.perf_counter() - t0) * 1e3
                self.descs_posted += len(local_idx)
        except Exception as exc:
            raise TransferError(f"NIXL {op} of {what} failed: {type(exc).__name__}: "
                                f"{exc}") from None
        if state == "ERR":
            with self._lock:
                handle.release()
            raise TransferError(f"NIXL {op} of {what} failed at post (state ERR)")
        self.hold(id(handle))  # driven: progress it until it is waited for or dropped
        return handle

    def wait(self, handles: list[Any], timeout_s: float, what: str, op: str = "WRITE") -> None:
        """Block until every handle's transfer is done, at most ``timeout_s`` seconds, then
        release them (``op``: ``"WRITE"`` or ``"READ"``, for messages). TransferError when a
        transfer ends in ERR or raises, or the time runs out (every handle released)."""
        deadline = time.monotonic() + timeout_s
        try:
            for h in handles:
                while True:
                    try:
                        with self._lock:
                            state = self.agent.check_xfer_state(h)
                    except Exception as exc:
                        raise TransferError(f"NIXL {op} of {what} failed: "
                                            f"{type(exc).__name__}: {exc}") from None
                    if state == "DONE":
                        break
                    if state == "ERR":
                        raise TransferError(f"NIXL {op} of {what} failed (state ERR)")
                    if time.monotonic() > deadline:
                        raise TransferError(f"NIXL {op} of {what} not done within "
                                            f"{timeout_s:g} s")
                    time.sleep(0 if time.monotonic() + 0.01 > deadline else 20e-6)
        finally:
            self.drop(handles)

    def drop(self, handles: list[Any]) -> None:
        """Release transfer handles (waited for or not)."""
        for h in handles:
            self.release(id(h))
            self._quietly(h.release)

    def telemetry(self, handle: Any) -> Any:
        """NIXL's telemetry of a transfer (``descCount``, ``totalBytes``; needs telemetry)."""
        with self._lock:
            return self.agent.get_xfer_telemetry(handle)

    def notify(self, peer_id: str, message: bytes) -> None:
        """Send ``message`` to peer ``peer_id``'s agent (best effort: a gone peer is ignored)."""
        name = self.peers.get(peer_id)
        if name is not None:
            self._quietly(self.agent.send_notif, name, message)

    def progress(self) -> None:
        """Let UCX progress once, keeping new notifications for :meth:`take`."""
        with self._lock:
            for name, msgs in self.agent.get_new_notifs().items():
                self.notifs.setdefault(name.decode() if isinstance(name, bytes) else name,
                                       []).extend(msgs)

    def take(self, peer_id: str, prefix: bytes) -> bytes | None:
        """The oldest notification from ``peer_id`` starting with ``prefix`` (removed), or None."""
        self.progress()
        with self._lock:
            msgs = self.notifs.get(self.peers.get(peer_id, ""), [])
            for i, m in enumerate(msgs):
                if m.startswith(prefix):
                    return msgs.pop(i)
        return None

    def close(self) -> None:
        """Stop the driver, forget every peer and deregister the memory."""
        if self.driver is not None:
            self.driver.close()
        for peer_id in list(self.peers):
            self.remove_peer(peer_id)
        for reg in self.regs:
            self._quietly(self.agent.deregister_memory, reg)
        self.regs.clear()
