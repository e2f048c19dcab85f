"""One NIXL agent per instance, as the ``nixl`` connector uses it: register memory once, meet
peers from their :class:`~kvflow.protocol.NixlAgentInfo`, prepare descriptor lists once per
peer, post WRITEs (or READs: the vLLM connector's pull), and wait for them with a bound.

NIXL (``pip install nixl-cu12`` or ``nixl-cu13``, imported as ``nixl``, ``nixl_cu12`` or
``nixl_cu13``) runs without a GPU: its UCX backend moves host memory over TCP, RDMA or, between
two processes of one host, shared memory (UCX picks it unless ``UCX_TLS=tcp``). An agent is
addressed by its metadata (``get_agent_metadata()``: backends, UCX worker address, registered
memory), which kvflow carries in ``Register`` / ``Pair``: no etcd, no metadata server, no
listener thread. Progress (:mod:`.nixl_progress`): NIXL's busy progress thread, none (the
caller's own calls progress UCX), or kvflow's driver, idle while nothing moves.

Descriptors (:func:`block_descs`): one per (cache tensor, block), ``block_bytes`` each, in
tensor-major order, so descriptor ``t * num_blocks + b`` is block ``b`` of tensor ``t``. A
transfer names descriptors by index (``make_prepped_xfer``); NIXL merges descriptors adjacent
in both lists, so a run of consecutive block ids on both sides moves as one descriptor
(:func:`~kvflow.connector.transport.nixl_plan.coalesce` counts them).
"""

from __future__ import annotations

import importlib
import itertools
import secrets
import threading
import time
from typing import Any

import numpy as np

from . import TransferError
from .nixl_progress import ProgressDriver

#: Modules that provide NIXL's Python API, tried in order.
NIXL_MODULES = ("nixl._api", "nixl_cu12", "nixl_cu13")


def import_nixl() -> Any:
    """NIXL's Python API module (with ``nixl_agent`` and ``nixl_agent_config``).

    Raises
    ------
    ImportError
        None of :data:`NIXL_MODULES` imports, naming the pip package to install.
    """
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
    """The ``UCX_TLS`` value that keeps UCX on its TCP transport (the network path, also
    between two processes of one host): ``"tcp"``, or ``"tcp,cuda_copy"`` where torch sees a
    CUDA GPU. On a host with NVIDIA GPUs NIXL's UCX backend refuses a ``UCX_TLS`` without CUDA
    memory support (``Invalid UCX_TLS=tcp for NIXL UCX backend: NVIDIA GPU(s) are present ...
    Add cuda_copy``, nixl-cu13 1.5.1 on an H200), even for host memory."""
    import torch
    return "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"


def nixl_available() -> bool:
    """NIXL imports here (tests of the nixl connector skip otherwise)."""
    try:
        import_nixl()
    except ImportError:
        return False
    return True


def block_descs(base: int, num_tensors: int, num_blocks: int, block_bytes: int,
                device_id: int = 0) -> np.ndarray:
    """Descriptors ``(address, bytes, device_id)`` of every block of every tensor of a cache
    laid out as :class:`~kvflow.cache.PagedKVCache` from ``base``: row ``t * num_blocks + b``
    is block ``b`` of tensor ``t`` (``num_tensors * num_blocks`` rows, uint64; ``device_id``:
    0 for host memory, the CUDA ordinal for GPU memory)."""
    offs = np.arange(num_tensors * num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    out = np.zeros((offs.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + offs
    out[:, 1] = block_bytes
    out[:, 2] = device_id
    return out


def mem_type(tensor: Any) -> tuple[str, int]:
    """NIXL's memory type and device id of ``tensor``: ``("DRAM", 0)`` on the host,
    ``("VRAM", ordinal)`` on a CUDA GPU.

    Raises
    ------
    TransferError
        Another device type (NIXL's UCX backend moves host and CUDA memory).
    """
    dev = tensor.device
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        return "VRAM", dev.index if dev.index is not None else 0
    raise TransferError(f"NIXL moves host (cpu) or CUDA memory; got a tensor on {dev}")


class Agent:
    """This instance's NIXL agent and what it knows of its peers.

    Parameters
    ----------
    role : str
        Part of the agent's name (``prefill``, ``decode``, ``bench``...), which also carries a
        random part (unique per instance).
    telemetry : bool
        Capture per-transfer telemetry (descriptor counts; tests).
    progress_thread : bool
        NIXL's progress thread (default). Without it nothing progresses UCX between this
        agent's own calls (:meth:`wait`, :meth:`progress`): an initiator that waits for its
        transfers needs none, a READ or WRITE target must call :meth:`progress` while it is
        read or written. The thread polls even when idle (about 0.25 CPU-seconds per second
        each for an idle served P and D, docs/nixl.md).
    driven : bool
        kvflow's :class:`~kvflow.connector.transport.nixl_progress.ProgressDriver` instead (needs
        ``progress_thread=False``): fast while a WRITE posted here is not waited for or a key
        is held (:meth:`hold`), every 10 ms otherwise.

    Raises
    ------
    ValueError
        ``driven`` with ``progress_thread``.
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
        self._seq = itertools.count()
        self.driver = ProgressDriver(self.progress, self.name) if driven else None

    def hold(self, key: Any) -> None:
        """Driven: progress fast until :meth:`release` of ``key`` (a transfer into this agent's
        memory is expected); else nothing."""
        if self.driver is not None:
            self.driver.hold(key)

    def release(self, key: Any) -> None:
        """Undo one :meth:`hold` of ``key``."""
        if self.driver is not None:
            self.driver.release(key)

    # ---- memory and peers ------------------------------------------------------------------
    def register(self, tensor: Any) -> None:
        """Register a contiguous host or CUDA tensor (the whole cache, or a staging buffer)
        once (NIXL takes its memory type from the tensor: :func:`mem_type`)."""
        with self._lock:
            self.regs.append(self.agent.register_memory(tensor))

    def metadata(self) -> bytes:
        """This agent's metadata (after every :meth:`register`)."""
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, peer_id: str, metadata: bytes) -> str:
        """Load peer ``peer_id``'s agent metadata (replacing an earlier one of that peer);
        returns its agent name.

        Raises
        ------
        TransferError
            NIXL refuses the metadata.
        """
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
        """Forget peer ``peer_id``'s agent (it died or paired anew): NIXL disconnects from it."""
        name = self.peers.pop(peer_id, None)
        with self._lock:
            self.notifs.pop(name, None)
        if name is not None:
            try:
                with self._lock:
                    self.agent.remove_remote_agent(name)
            except Exception:  # already gone inside NIXL
                pass

    def prep(self, agent: str, descs: np.ndarray, mem: str = "DRAM") -> Any:
        """A prepared descriptor list (``prep_xfer_dlist``) of ``descs`` on ``agent``'s memory
        ('' : this agent's own) of NIXL memory type ``mem`` (``DRAM`` or ``VRAM``)."""
        with self._lock:
            return self.agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", descs, mem)

    # ---- transfers ---------------------------------------------------------------------
    def write(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
              what: str) -> Any:
        """Post one WRITE of prepared descriptors ``local_idx`` into ``remote_idx``; returns
        its handle (wait with :meth:`wait`).

        Raises
        ------
        TransferError
            NIXL refuses or fails it (e.g. the peer disconnected), naming ``what``.
        """
        return self._post("WRITE", local, local_idx, remote, remote_idx, what)

    def read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             what: str) -> Any:
        """Post one READ of the peer's prepared descriptors ``remote_idx`` into this agent's
        ``local_idx`` (one-sided: the peer's CPU takes no part); returns its handle (wait with
        ``wait(..., op="READ")``).

        Raises
        ------
        TransferError
            NIXL refuses or fails it (e.g. the peer disconnected), naming ``what``.
        """
        return self._post("READ", local, local_idx, remote, remote_idx, what)

    def _post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any,
              remote_idx: np.ndarray, what: str) -> Any:
        try:
            with self._lock:
                handle = self.agent.make_prepped_xfer(op, local, local_idx.astype(np.int32),
                                                      remote, remote_idx.astype(np.int32))
                state = self.agent.transfer(handle)
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
        """Block until every handle's transfer is done (``check_xfer_state``), then release
        them; at most ``timeout_s`` seconds (``op``: ``"WRITE"`` or ``"READ"``, for messages).

        Raises
        ------
        TransferError
            A transfer ended in ERR or raised, or the time ran out (every handle released).
        """
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
            try:
                with self._lock:
                    h.release()
            except Exception:  # a transfer NIXL cannot cancel: it frees it with the agent
                pass

    def telemetry(self, handle: Any) -> Any:
        """NIXL's telemetry of a transfer (``descCount``, ``totalBytes``; needs telemetry)."""
        with self._lock:
            return self.agent.get_xfer_telemetry(handle)

    # ---- notifications -----------------------------------------------------------------
    def notify(self, peer_id: str, message: bytes) -> None:
        """Send ``message`` to peer ``peer_id``'s agent (best effort: a gone peer is ignored)."""
        name = self.peers.get(peer_id)
        if name is not None:
            try:
                with self._lock:
                    self.agent.send_notif(name, message)
            except Exception:
                pass

    def progress(self) -> None:
        """Let UCX progress once (and keep any new notifications for :meth:`take`): what an
        agent without a progress thread calls while a peer READs its memory."""
        with self._lock:
            for name, msgs in self.agent.get_new_notifs().items():
                self.notifs.setdefault(name.decode() if isinstance(name, bytes) else name,
                                       []).extend(msgs)

    def take(self, peer_id: str, prefix: bytes) -> bytes | None:
        """The oldest notification from peer ``peer_id`` that starts with ``prefix`` (removed),
        or None."""
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
            try:
                with self._lock:
                    self.agent.deregister_memory(reg)
            except Exception:
                pass
        self.regs.clear()
