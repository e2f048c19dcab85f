"""``ipc-pull`` (one host): D maps P's exported cache at pairing (:mod:`.transport.shm`; on CUDA
:class:`CudaIpcPullReceiver`, docs/gpu_serving.md, "How the GPUs are paired") and pulls the
blocks P names in ``KVReady`` / ``KVLayer`` with :func:`kvflow.kernels.copy_blocks`; the flow is
docs/design.md, "One request, from the router to D's cache", step 4. A P of another spec is
pulled re-blocked (:mod:`.reblocked`); an fp8 P's scales are read from its export.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvflow.cache import PagedKVCache
from kvflow.kernels import copy_blocks, copy_sequence, payload_bytes
from kvflow.kernels.digest import digest_blocks
from kvflow.connector.messages import KVLayer, KVReady, encode

from .base import Peer, TransferError, TransferStats, as_ids, check_send_allowed
from .framed import RECEIVE_MAX_CTAS, FramedReceiver, FramedSender
from .reblocked import tables
from .records import ExportedCache, warm_copy
from .transport.shm import map_peer_cache
from .verify import check, expect, new_digest


class IpcPullSender(ExportedCache, FramedSender):
    """P's half: the cache is exported at start-up; send D the ids to pull."""

    name = "ipc-pull"
    holds_blocks = True
    export_role = "prefill"

    def send(self, link, req_id, cache, src_ids, *, first_token, num_prompt_tokens,
             corrupt=False):
        check_send_allowed("IpcPullSender.send")
        t_start = time.time()
        # D copies out of P's cache: one read-only digest launch of the blocks
        digests = digest_blocks(cache, list(src_ids), backend=self.backend).tolist() \
            if self.verify else []
        if corrupt and src_ids:  # test fault: after the digest, in the memory D reads
            from kvflow.serve.instance.faults import flip_byte
            flip_byte(cache.tensors()[-1][src_ids[-1]])
        link.send(encode(KVReady(req_id=req_id, src_block_ids=list(src_ids),
                                 first_token=first_token, num_prompt_tokens=num_prompt_tokens,
                                 t_start=t_start, block_digests=digests)))
        return None

    def send_part(self, link, cache, src_ids, layers, **fields):
        """A :class:`KVLayer` naming P's ``src_ids`` and ``layers``: D pulls them (no payload)."""
        check_send_allowed("IpcPullSender.send_part")
        link.send(encode(KVLayer(layer_start=layers.start, layer_stop=layers.stop,
                                 num_blocks=len(src_ids), src_block_ids=list(src_ids), **fields)))
        return None, 0.0

    def close(self) -> None:
        super().close()
        self.unexport()


class IpcPullReceiver(FramedReceiver):
    """D's half: map each paired P's cache at pairing (``peers``), then ``copy_blocks`` P's ids
    -> D's ids, reading the cache of the P that sent the transfer (``peer_id``)."""

    name = "ipc-pull"
    reads_peer_memory = True
    copy_kwargs: dict = {}  # extra copy_blocks arguments (the CUDA receiver sets direction)

    @property
    def peer(self) -> PagedKVCache | None:
        """The last paired P's mapped cache (None before pairing)."""
        return self.peers.get(self.peer_id)

    def warmup(self) -> None:
        warm_copy(self.spec, self.device, self.backend)

    def attach(self, peer: Peer) -> None:
        self.peers[peer.id] = map_peer_cache(peer.shm_name, peer.spec, peer.num_blocks)
        self.peer_id = peer.id

    def peer_for(self, peer_id: str | None) -> PagedKVCache:
        """The mapped cache of P ``peer_id`` (None: the last paired one); TransferError before
        pairing, or for a P that is not paired with this D."""
        if not self.peers:
            raise TransferError("ipc receive before pairing: no prefill cache is mapped")
        cache = self.peers.get(self.peer_id if peer_id is None else peer_id)
        if cache is None:
            raise TransferError(f"ipc transfer from {peer_id!r}, which is not paired with this "
                                f"decode instance (paired: {sorted(self.peers)})")
        return cache

    def run_on(self, src_cache: PagedKVCache, cache: PagedKVCache) -> torch.device:
        """The device the plain copies run on."""
        return cache.device

    def sync(self, src_cache: PagedKVCache, cache: PagedKVCache) -> None:
        """Wait for the plain copies (P may reuse its blocks after the ack)."""

    def receive(self, header: Any, frames, cache, dst_ids,
                peer_id: str | None = None) -> TransferStats | None:
        """``KVReady``: one ``copy_blocks`` (re-blocked: :meth:`pull_reblocked`); ``KVLayer``
        parts pulled as they come. Waits for the copies when the request is complete."""
        src_cache = self.peer_for(peer_id)
        if isinstance(header, KVLayer):
            self._unverified(header)
            stats = self.parts.receive(header, frames, cache, dst_ids,
                                       lambda *a: self._pull_part(src_cache, *a))
            if stats is not None:
                self.sync(src_cache, cache)
            return stats
        if not isinstance(header, KVReady):
            raise TransferError(f"ipc expects a KVReady or KVLayer header, got "
                                f"{type(header).__name__}")
        if frames:
            raise TransferError(f"ipc KVReady carries no payload frames, got {len(frames)}")
        if src_cache.spec != cache.spec:
            self._unverified(header, reblocked=True)
            return self.pull_reblocked(src_cache, header, cache, dst_ids)
        src = as_ids(header.src_block_ids)
        if src.numel() != len(dst_ids):
            raise TransferError(f"KVReady for {header.req_id} names {src.numel()} blocks; "
                                f"D allocated {len(dst_ids)} for the prompt")
        sent = expect(header, src.numel()) if self.verify else None
        digest = None if sent is None else new_digest(src.numel(), self.run_on(src_cache, cache))
        t0 = time.perf_counter()
        copy_blocks(src_cache, cache, src, as_ids(dst_ids), backend=self.backend, digest=digest,
                    max_ctas=self.receive_max_ctas, **self.copy_kwargs)
        self.sync(src_cache, cache)
        if sent is not None:
            check(header.req_id, sent, digest)
        ms = (time.perf_counter() - t0) * 1e3
        n = int((src >= 0).sum())
        return TransferStats(blocks=n, payload_bytes=payload_bytes(cache.spec, n), copy_ms=ms)

    def pull_reblocked(self, src_cache, header: KVReady, cache, dst_ids) -> TransferStats:
        """A :class:`KVReady` from a P of another spec: one ``copy_sequence`` of the whole
        prompt (:mod:`.reblocked`) on D's device, waited for on CUDA."""
        src, dst = tables(header.src_block_ids, src_cache.spec, dst_ids, cache.spec,
                          header.num_prompt_tokens, header.req_id)
        t0 = time.perf_counter()
        copy_sequence(src_cache, cache, src, dst, num_tokens=header.num_prompt_tokens,
                      head_start=self.head_start, backend=self.backend,
                      max_ctas=self.receive_max_ctas)
        if cache.device.type == "cuda":  # P may reuse its blocks after the ack
            torch.cuda.synchronize(cache.device)
            torch.cuda.synchronize(src_cache.device)
        return TransferStats(blocks=len(dst_ids), copy_ms=(time.perf_counter() - t0) * 1e3,
                             payload_bytes=payload_bytes(cache.spec, len(dst_ids)))

    def _pull_part(self, src_cache, header, frames, cache, dst_ids, layers) -> int:
        if frames:
            raise TransferError(f"ipc KVLayer carries no payload frames, got {len(frames)}")
        if src_cache.spec != cache.spec:
            raise TransferError(f"KVLayer for {header.req_id} from a P of another KV cache "
                                f"spec: such a P sends after the prefill, never by layer")
        if len(header.src_block_ids) != len(dst_ids):
            raise TransferError(f"KVLayer for {header.req_id} names {len(header.src_block_ids)} "
                                f"source blocks for {len(dst_ids)} prompt blocks")
        copy_blocks(src_cache, cache, as_ids(header.src_block_ids), as_ids(dst_ids), layers=layers,
                    backend=self.backend, max_ctas=self.receive_max_ctas, **self.copy_kwargs)
        return payload_bytes(cache.spec, len(dst_ids), layers)



class CudaIpcPullReceiver(IpcPullReceiver):
    """D's half on CUDA: open P's handle at pairing; copies run on D's GPU (``direction`` "pull") or
    P's ("push", the default; ValueError for another) and are waited for once per request."""

    def __init__(self, spec=None, device: Any = "cuda", *, backend: str = "auto",
                 direction: str = "push", head_start: int | None = None,
                 receive_max_ctas: int = RECEIVE_MAX_CTAS) -> None:
        if direction not in ("pull", "push"):
            raise ValueError(f"direction must be 'pull' or 'push', got {direction!r}")
        super().__init__(spec, device, backend=backend, head_start=head_start,
                         receive_max_ctas=receive_max_ctas)
        self.direction = direction
        self.copy_kwargs = {"direction": direction}

    def attach(self, peer: Peer) -> None:
        from .transport.cuda_ipc import enable_peer_access, import_cache, read_export
        self.detach(peer.id)
        cache = import_cache(read_export(peer.shm_name), peer.spec, peer.num_blocks)
        enable_peer_access(torch.device("cuda", torch.cuda.current_device()), cache.device)
        self.peers[peer.id], self.peer_id = cache, peer.id

    def detach(self, peer_id: str) -> None:
        """Drop P ``peer_id``'s mapping (torch closes the IPC handle)."""
        if self.peers.pop(peer_id, None) is not None and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def run_on(self, src_cache: PagedKVCache, cache: PagedKVCache) -> torch.device:
        return cache.device if self.direction == "pull" else src_cache.device

    def sync(self, src_cache: PagedKVCache, cache: PagedKVCache) -> None:
        torch.cuda.current_stream(self.run_on(src_cache, cache)).synchronize()

    def close(self) -> None:
        self.peers.clear()  # drops the storages: torch closes the IPC mappings
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
