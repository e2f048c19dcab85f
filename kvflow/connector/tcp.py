"""``tcp`` (any hosts): P gathers a request's blocks into a staging buffer and sends it as
``[KVData header, one zero-copy frame per layer]`` (:mod:`.transport.frames`; layerwise parts:
``KVLayer``, :mod:`.framed`), kept alive until D's ack; D scatters each frame into its blocks.
Zero blocks is a transfer too (empty frames); a P of another spec sends its whole table and D
scatters re-blocked (:mod:`.reblocked`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvflow.cache import staging_buffer
from kvflow.kernels import gather_blocks, payload_bytes
from kvflow.kernels.digest import fold
from kvflow.connector.messages import KVData, KVLayer, encode

from .base import TransferError, TransferStats, as_ids, check_send_allowed
from .framed import FramedReceiver, FramedSender
from .reblocked import tables
from .transport.frames import (check_frames, layer_bytes, layer_frames, scatter_frames,
                               warm_staging)
from .verify import check, expect, new_digest


# the receiving side's messages (tests assert them)
DATA_COUNT = ("KVData for {req_id}: expected {expected} layer frames, header says {header}, "
              "got {got}")
DATA_SIZE = "KVData for {req_id}: layer {layer} frame has {nbytes} bytes, expected {expected}"
PART_COUNT = "KVLayer for {req_id}: layers [{start}, {stop}) need {expected} frames, got {got}"
PART_SIZE = "KVLayer for {req_id}: layer {layer} frame has {nbytes} bytes, expected {expected}"


class TcpSender(FramedSender):
    """P's half: gather, then send per-layer zero-copy frames."""

    name = "tcp"
    holds_blocks = False  # the staging buffer holds the data; P's blocks can be freed at once

    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Compile the gather kernel on a scratch cache, then the layerwise set-up."""
        warm_staging(self.spec, self.device, self.backend)
        super().warmup(engine, chunk_size)

    def _gather(self, cache, ids: torch.Tensor, layers: range | None = None,
                digest: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """``(staging on the host, gather ms)`` of ``layers`` (None: all) of blocks ``ids``."""
        t0 = time.perf_counter()
        staging = gather_blocks(cache, ids, staging_buffer(cache.spec, ids.numel(), layers,
                                                           device=cache.device),
                                layers, backend=self.backend, digest=digest)
        if staging.device.type != "cpu":
            staging = staging.cpu()
        return staging, (time.perf_counter() - t0) * 1e3

    def send(self, link, req_id, cache, src_ids, *, first_token, num_prompt_tokens,
             corrupt=False):
        check_send_allowed("TcpSender.send")
        t_start = time.time()
        ids = as_ids(src_ids)
        digest = new_digest(ids.numel(), cache.device) if self.verify else None
        staging, gather_ms = self._gather(cache, ids, digest=digest)
        if corrupt and ids.numel():  # test fault: after the digest, as on the wire
            from kvflow.serve.instance.faults import flip_byte
            flip_byte(staging[-1, -1, -1])
        header = KVData(req_id=req_id, num_blocks=ids.numel(), num_frames=staging.shape[0],
                        first_token=first_token, num_prompt_tokens=num_prompt_tokens,
                        t_start=t_start, gather_ms=gather_ms,
                        block_digests=[] if digest is None else digest.tolist())
        link.send_multipart([encode(header)] + layer_frames(staging), copy=False)
        return staging  # ZMQ reads this memory after send returns: keep it until the ack

    def send_part(self, link, cache, src_ids, layers, **fields):
        """Gather ``layers`` of ``src_ids`` and send a :class:`KVLayer` header + one zero-copy
        frame per layer; keep the staging buffer."""
        check_send_allowed("TcpSender.send_part")
        ids = as_ids(src_ids)
        staging, gather_ms = self._gather(cache, ids, layers)
        header = KVLayer(layer_start=layers.start, layer_stop=layers.stop, num_blocks=ids.numel(),
                         **fields)
        link.send_multipart([encode(header)] + layer_frames(staging), copy=False)
        return staging, gather_ms


class TcpReceiver(FramedReceiver):
    """D's half: check the frames against the header and the spec (``peers``: paired P -> its
    KVCacheSpec), scatter each layer."""

    name = "tcp"
    host_local = False  # P may live on another host

    def attach(self, peer) -> None:
        self.peers[peer.id], self.peer_id = peer.spec, peer.id

    def warmup(self) -> None:
        warm_staging(self.spec, self.device, self.backend, scatter=True)

    def receive(self, header: Any, frames: list[Any], cache, dst_ids, peer_id=None) -> TransferStats:
        spec = cache.spec
        if isinstance(header, KVLayer):
            self._unverified(header)
            return self.parts.receive(header, frames, cache, dst_ids, self._scatter_part)
        if not isinstance(header, KVData):
            raise TransferError(f"tcp expects a KVData or KVLayer header, got "
                                f"{type(header).__name__}")
        src_spec = self.peers.get(self.peer_id if peer_id is None else peer_id, spec)
        if src_spec != spec:
            self._unverified(header, reblocked=True)
            return self._scatter_reblocked(header, frames, cache, dst_ids, src_spec)
        n = header.num_blocks
        if n != len(dst_ids):
            raise TransferError(f"KVData for {header.req_id} carries {n} blocks; D allocated "
                                f"{len(dst_ids)} for the prompt")
        checks = dict(req_id=header.req_id, error=TransferError, count_msg=DATA_COUNT,
                      size_msg=DATA_SIZE, num_frames=header.num_frames)
        sent = digest = total_digest = None
        if self.verify:  # the frames are checked before P's digests, as without --kv-verify
            check_frames(frames, range(spec.num_layers), layer_bytes(spec, n), **checks)
            sent = expect(header, n)
            digest = new_digest(n, cache.device)
            total_digest = torch.zeros(n, dtype=torch.int64, device=cache.device)

        def add_digest() -> None:  # a range's digest is the sum of its layers' (mod 2**32: fold)
            total_digest.add_(digest.to(torch.int64))

        t0 = time.perf_counter()
        total = scatter_frames(frames, cache, as_ids(dst_ids), range(spec.num_layers),
                               backend=self.backend, digest=digest, max_ctas=self.receive_max_ctas,
                               on_layer=None if digest is None else add_digest, **checks)
        if sent is not None:
            check(header.req_id, sent, fold(total_digest))
        ms = (time.perf_counter() - t0) * 1e3
        return TransferStats(blocks=n, payload_bytes=total, copy_ms=ms)

    def _scatter_reblocked(self, header, frames, cache, dst_ids, src_spec) -> TransferStats:
        """A :class:`KVData` from a P of another spec (frames of P's whole table in P's spec):
        each layer scattered with ``src_spec`` and ``num_tokens`` (:mod:`.reblocked`)."""
        n, T = header.num_blocks, header.num_prompt_tokens
        src, dst = tables(range(n), src_spec, dst_ids, cache.spec, T, header.req_id)
        t0 = time.perf_counter()
        scatter_frames(frames, cache, dst, range(src_spec.num_layers), req_id=header.req_id,
                       error=TransferError, count_msg=DATA_COUNT, size_msg=DATA_SIZE,
                       num_frames=header.num_frames, spec=src_spec, num_blocks=n,
                       backend=self.backend, src_spec=src_spec, num_tokens=T,
                       head_start=self.head_start, max_ctas=self.receive_max_ctas)
        return TransferStats(blocks=len(dst_ids), copy_ms=(time.perf_counter() - t0) * 1e3,
                             payload_bytes=payload_bytes(cache.spec, len(dst_ids)))

    def _scatter_part(self, header, frames, cache, dst_ids, layers) -> int:
        return scatter_frames(frames, cache, as_ids(dst_ids), layers, req_id=header.req_id,
                              error=TransferError, count_msg=PART_COUNT, size_msg=PART_SIZE,
                              backend=self.backend, max_ctas=self.receive_max_ctas)
