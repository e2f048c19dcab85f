"""``ipc`` transfer (one host, CPU): P's paged cache lives in POSIX shared memory; D maps it
read-only once, at pairing, and pulls each request's blocks with
:func:`kvflow.kernels.copy_blocks` straight into the block ids D allocated.

Segments are files under ``/dev/shm`` named, created and cleaned by :mod:`kvflow.segments`
(``kvflow-<role>-<owner>-<random hex>``: unique per instance, ``O_EXCL``, mode 0600, every
page reserved at creation, so a cache larger than the free shared memory is refused at start-up
instead of dying with SIGBUS later); unlinked by the owner on exit (and by the parent server if
the owner is killed); :func:`clean_stale_segments` removes those whose owner is judged dead.

Layerwise (:class:`~kvflow.protocol.KVLayer`): D is told per part (layers + P's block ids) and
pulls just that with ``copy_blocks(..., layers=range)``; P never writes into D's cache.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.kernels import copy_blocks, payload_bytes
from kvflow.layout import KVCacheSpec
from kvflow.protocol import KVLayer, KVReady, encode

from kvflow import segments

from .shm import SHM_DIR, clean_stale_segments, shm_path, unlink_segment  # noqa: F401
from .base import KVReceiver, KVSender, TransferError, TransferStats, as_ids, check_send_allowed
from .parts import LayerParts

log = logging.getLogger("kvflow.transfer.ipc")

class SharedCache:
    """A :class:`PagedKVCache` laid over a shared-memory segment.

    Parameters
    ----------
    spec : KVCacheSpec
    num_blocks : int
    role : str
        Part of the segment name (``prefill``, ``decode``...).

    Attributes
    ----------
    name : str
        Segment name, to hand to the peer.
    cache : PagedKVCache
        The cache (``cache.buffer`` is the mapping).

    Raises
    ------
    ValueError
        ``role`` not lowercase letters.
    kvflow.segments.SegmentSpaceError
        The cache (``num_blocks * spec.bytes_per_block`` bytes) does not fit in the free
        shared memory; the message gives both sizes and the flags that lower the first.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, role: str = "prefill") -> None:
        nbytes = num_blocks * spec.bytes_per_block
        self.name, fd = segments.create(
            role, nbytes, what=f"the {role} instance's KV cache ({num_blocks} blocks x "
                               f"{spec.bytes_per_block} bytes)",
            hint="lower --num-blocks or --memory-budget-mb")
        self.path = shm_path(self.name)
        try:
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.cache = PagedKVCache(spec, num_blocks, buffer=torch.frombuffer(self._mmap, dtype=torch.uint8))
        self._owner = os.getpid()

    def close(self) -> None:
        """Unlink the segment (the mapping stays valid until this process exits)."""
        if self._owner == os.getpid():
            unlink_segment(self.name)


def map_peer_cache(name: str, spec: KVCacheSpec, num_blocks: int, *,
                   writable: bool = False) -> PagedKVCache:
    """Map a peer's segment as a :class:`PagedKVCache`: read-only (D pulls from P's cache), or
    ``writable`` (P pushes into D's cache, :mod:`kvflow.transfer.push`).

    Raises
    ------
    TransferError
        If the segment is missing or smaller than ``num_blocks * spec.bytes_per_block``.
    """
    path = shm_path(name)
    need = num_blocks * spec.bytes_per_block
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise TransferError(f"shared-memory segment {name!r} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        if size < need:
            raise TransferError(f"segment {name!r} holds {size} bytes; the peer cache of "
                                f"{num_blocks} blocks needs {need}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, need, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only mapping: we only read through it
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    cache = PagedKVCache(spec, num_blocks, buffer=buf)
    cache.backend_state["mmap"] = mm
    return cache


class IpcSender(KVSender):
    """P side: the cache is in shared memory; send D the ids to pull (a few bytes)."""

    name = "ipc"
    holds_blocks = True

    def __init__(self, shared: SharedCache) -> None:
        self.shared = shared

    def export(self) -> dict[str, str]:
        return {"shm_name": self.shared.name}

    def send(self, link, req_id, cache, src_ids, *, first_token, num_prompt_tokens):
        check_send_allowed("IpcSender.send")
        link.send(encode(KVReady(req_id=req_id, src_block_ids=list(src_ids),
                                 first_token=first_token, num_prompt_tokens=num_prompt_tokens,
                                 t_start=time.time())))
        return None

    def send_part(self, link, cache, src_ids, layers, **fields):
        """A :class:`KVLayer` naming P's ``src_ids`` and ``layers``: D pulls them (no payload)."""
        check_send_allowed("IpcSender.send_part")
        link.send(encode(KVLayer(layer_start=layers.start, layer_stop=layers.stop,
                                 num_blocks=len(src_ids), src_block_ids=list(src_ids), **fields)))
        return None, 0.0

    def close(self) -> None:
        self.shared.close()


class IpcReceiver(KVReceiver):
    """D side: map each paired P's cache at pairing, then ``copy_blocks`` P's ids -> D's ids.

    D may be paired with several P's: one mapping per P (``peers``), and every transfer reads
    the cache of the P that sent it (``peer_id``), never another one's.
    """

    copy_kwargs: dict = {}  # extra copy_blocks arguments (the CUDA receiver sets direction)

    name = "ipc"

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.peers: dict[str, PagedKVCache] = {}
        self.peer_id = ""  # the last one paired
        self.parts = LayerParts()

    @property
    def peer(self) -> PagedKVCache | None:
        """The last paired P's mapped cache (None before pairing)."""
        return self.peers.get(self.peer_id)

    def attach(self, peer_id, peer_spec, peer_num_blocks, shm_name=""):
        self.peers[peer_id] = map_peer_cache(shm_name, peer_spec, peer_num_blocks)
        self.peer_id = peer_id

    def detach(self, peer_id: str) -> None:
        """Drop P ``peer_id``'s mapping (it died or was replaced)."""
        self.peers.pop(peer_id, None)

    def peer_for(self, peer_id: str | None) -> PagedKVCache:
        """The mapped cache of P ``peer_id`` (None: the only / last paired one).

        Raises
        ------
        TransferError
            Before pairing, or for a P that is not paired with this D.
        """
        if not self.peers:
            raise TransferError("ipc receive before pairing: no prefill cache is mapped")
        cache = self.peers.get(self.peer_id if peer_id is None else peer_id)
        if cache is None:
            raise TransferError(f"ipc transfer from {peer_id!r}, which is not paired with this "
                                f"decode instance (paired: {sorted(self.peers)})")
        return cache

    def receive(self, header: Any, frames, cache, dst_ids, peer_id: str | None = None) -> TransferStats:
        src_cache = self.peer_for(peer_id)
        if isinstance(header, KVLayer):
            return self.parts.receive(header, frames, cache, dst_ids,
                                      lambda *a: self._pull_part(src_cache, *a))
        if not isinstance(header, KVReady):
            raise TransferError(f"ipc expects a KVReady or KVLayer header, got "
                                f"{type(header).__name__}")
        if frames:
            raise TransferError(f"ipc KVReady carries no payload frames, got {len(frames)}")
        src = as_ids(header.src_block_ids)
        if src.numel() != len(dst_ids):
            raise TransferError(f"KVReady for {header.req_id} names {src.numel()} blocks; "
                                f"D allocated {len(dst_ids)} for the prompt")
        t0 = time.perf_counter()
        copy_blocks(src_cache, cache, src, as_ids(dst_ids), backend=self.backend)
        ms = (time.perf_counter() - t0) * 1e3
        n = int((src >= 0).sum())
        return TransferStats(blocks=n, payload_bytes=payload_bytes(cache.spec, n), copy_ms=ms)

    def _pull_part(self, src_cache, header, frames, cache, dst_ids, layers) -> int:
        """copy_blocks of one layerwise part: P's ``src_block_ids`` -> D's ``dst_ids``."""
        if frames:
            raise TransferError(f"ipc KVLayer carries no payload frames, got {len(frames)}")
        if len(header.src_block_ids) != len(dst_ids):
            raise TransferError(f"KVLayer for {header.req_id} names {len(header.src_block_ids)} "
                                f"source blocks for {len(dst_ids)} prompt blocks")
        copy_blocks(src_cache, cache, as_ids(header.src_block_ids), as_ids(dst_ids), layers=layers,
                    backend=self.backend, **self.copy_kwargs)
        return payload_bytes(cache.spec, len(dst_ids), layers)

    def close(self) -> None:
        self.peers.clear()
