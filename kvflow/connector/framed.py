"""P's half of the connectors whose KV (or a pointer to it) goes to D as messages on the link:
``ipc-pull`` (a :class:`~kvflow.protocol.KVReady` naming P's blocks, D copies them) and ``tcp``
(a :class:`~kvflow.protocol.KVData` carrying them).

A prompt shorter than ``layerwise_min_tokens`` moves after its prefill in one message
(:meth:`FramedSender.send`). A longer one moves layer by layer: the engine's per-chunk hook
registers the chunk with :class:`~kvflow.connector.layerwise.LayerwiseSender`, whose per-layer
hook signals each layer; its worker thread sends the due parts
(:meth:`FramedSender.send_part`) on a send-only socket per D. The signal segment, the thread
and those sockets exist only when some prompt can go layerwise (``layerwise_min_tokens <=
max_model_len``); the segment and thread are created at warm-up, the sockets at pairing.
"""

from __future__ import annotations

import abc
from typing import Any

from .base import Handoff, KVSender, Peer, PrefillJob, TransferError
from .reblocked import differs


class FramedSender(KVSender):
    """Base of :class:`~kvflow.connector.ipc_pull.IpcPullSender` and
    :class:`~kvflow.connector.tcp.TcpSender`."""

    #: P's blocks are read by D after :meth:`send` returns (free them on D's ack).
    holds_blocks: bool = True
    #: A layer unsignalled this long fails the request (seconds).
    signal_timeout_s: float = 30.0
    #: ``--kv-verify``: send a digest of every block (:mod:`.verify`); set by the instance.
    verify: bool = False

    def __init__(self, spec, device: Any = "cpu", **kw: Any) -> None:
        super().__init__(spec, device, **kw)
        self.layerwise = None  # LayerwiseSender, when some prompt can go layerwise
        self.peer_specs: dict = {}  # attached D -> its KVCacheSpec

    # ---- the kind's messages -----------------------------------------------------------
    @abc.abstractmethod
    def send(self, link: Any, req_id: str, cache: Any, src_ids: list[int], *, first_token: int,
             num_prompt_tokens: int, corrupt: bool = False) -> Any:
        """Send the request's KV (or a pointer to it) over ``link`` (a zmq socket). Returns
        an object P must keep alive until D's ack (a staging buffer ZMQ sends zero-copy), or
        None. With :attr:`verify` the message carries the blocks' digests; ``corrupt`` (a
        test fault, ``KVFLOW_FAULT_KV_CORRUPT``) then flips a byte of the last sent block
        after its digest was taken.

        Raises
        ------
        RuntimeError
            Inside a dummy/profile run.
        """

    @abc.abstractmethod
    def send_part(self, link: Any, cache: Any, src_ids: list[int], layers: range,
                  **fields: Any) -> tuple[Any, float]:
        """Send one layerwise part: layers ``layers`` of P's blocks ``src_ids`` as a
        :class:`~kvflow.protocol.KVLayer` (``fields`` fill the header: ``req_id``,
        ``reply_to``, ``block_offset``...). Returns ``(keep, gather_ms)``.

        Raises
        ------
        RuntimeError
            Inside a dummy/profile run.
        """

    # ---- set-up ------------------------------------------------------------------------
    def warmup(self, engine: Any, chunk_size: int) -> None:
        """Create the layerwise signal segment and sender (only when some prompt can go
        layerwise) and run a chunked dummy prefill through it (nothing registered, signalled
        or sent)."""
        if not self.layerwise_enabled:
            return
        from .layerwise import LayerwiseSender
        self.layerwise = LayerwiseSender(self, self.cache, self.instance_id,
                                         signal_timeout_s=self.signal_timeout_s)
        self.dummy_run(engine, chunk_size)

    def dummy_run(self, engine: Any, chunk_size: int, num_tokens: int = 32) -> None:
        """A chunked prefill of ``num_tokens`` dummy tokens through the layerwise path inside
        ``forward_context(is_dummy_or_profile_run=True)``: nothing is registered, signalled or
        sent (the warm-up; also callable after real traffic)."""
        from kvflow.context import forward_context
        n = min(num_tokens, self.max_model_len, self.cache.num_blocks * self.spec.block_size)
        blocks = list(range(self.spec.num_blocks_for(n)))
        with forward_context(is_dummy_or_profile_run=True):
            self.layerwise.run(engine, PrefillJob("dummy", [0] * n, blocks, "",
                                                  chunk_size=max(1, min(chunk_size, n // 2))))

    def _attach(self, peer: Peer, ctx: Any) -> None:
        self.peer_specs[peer.id] = peer.spec
        if self.layerwise is not None:
            self.layerwise.open(ctx, peer.data_addr, peer.id)

    def detach(self, peer_id: str) -> None:
        super().detach(peer_id)
        self.peer_specs.pop(peer_id, None)
        if self.layerwise is not None:
            self.layerwise.close_peer(peer_id)

    # ---- per request -------------------------------------------------------------------
    def prefill(self, engine: Any, job: PrefillJob) -> Handoff:
        """Prefill, then one message with the first token; or, from ``layerwise_min_tokens``,
        every layer sent as it completes (P's blocks held until D's ack; a part that fails
        later comes out of :meth:`pop_errors`)."""
        self.link_to(job.decode_id)  # before any compute
        if (self.layerwise is not None and self.goes_layerwise(len(job.token_ids))
                and not self.reblocks(job.decode_id)):
            if self.verify:  # refused at start (kvflow.serve.checks): never unchecked
                raise TransferError(f"kv verify: {job.req_id} would move layer by layer, "
                                    f"which --kv-verify does not check")
            logits = self.layerwise.run(engine, job)
            self.layerwise.finish(job.req_id, job.sample(logits))
            return Handoff(holds_blocks=True)
        logits = engine.prefill(job.token_ids, job.blocks, chunk_size=job.chunk_size)
        return self.send_prefilled(job, job.sample(logits))

    def reblocks(self, decode_id: str) -> bool:
        """D ``decode_id``'s cache spec differs from P's: its KV moves after the prefill, P's
        whole table in one message (:mod:`.reblocked`)."""
        return differs(self.peer_specs.get(decode_id, self.spec), self.spec)

    def send_prefilled(self, job: PrefillJob, first_token: int) -> Handoff:
        """One message (:meth:`send`) for the prompt's blocks past D's prefix hit (all of P's
        blocks when D's spec differs: D skips its hit by token, :mod:`.reblocked`)."""
        # D holds logical blocks 0..num_cached_blocks-1 (prefix hit): send only the rest
        skip = 0 if self.reblocks(job.decode_id) else min(job.num_cached_blocks, len(job.blocks))
        corrupt = False
        if self.verify:
            if self.reblocks(job.decode_id):
                raise TransferError(f"kv verify: D {job.decode_id}'s KV cache spec differs "
                                    f"from P's; --kv-verify does not check re-blocked moves")
            from kvflow.serve import faults
            corrupt = faults.fails("corrupt", job.token_ids)
        keep = self.send(self.link_to(job.decode_id), job.req_id, self.cache, job.blocks[skip:],
                         first_token=first_token, num_prompt_tokens=len(job.token_ids),
                         corrupt=corrupt)
        self.messages_sent += 1
        return Handoff(self.holds_blocks, keep)

    def release(self, req_id: str) -> None:
        """Drop the request's pending layer signals and staging buffers."""
        if self.layerwise is not None:
            self.layerwise.abort(req_id)

    def pop_errors(self) -> list[tuple[str, BaseException]]:
        return self.layerwise.pop_errors() if self.layerwise is not None else []

    def close(self) -> None:
        if self.layerwise is not None:
            self.layerwise.close()  # before the ZMQ context ends: it owns sockets
        super().close()
