"""D's reaction to a transfer's arrival (its receiver's :class:`~kvflow.connector.Arrival`):
RECEIVING, the end of a failed request, or once complete the ``kvflow`` block and decoding."""

from __future__ import annotations

import logging

from kvflow.blocks import DecodeState

from . import faults
from .sequences import Seq

log = logging.getLogger("kvflow.serve.decode")


class Arrivals:
    """D's handlers for arriving KV (a mixin of :class:`~.decode.DecodeInstance`)."""

    def on_data(self, msg, frames, ident) -> None:
        """Every data-plane message from P."""
        seq = self.seqs.get(getattr(msg, "req_id", ""))
        dst_ids, delay, fault = None, 0.0, ""
        if seq is not None and seq.req.state in (DecodeState.ALLOCATED, DecodeState.RECEIVING):
            prompt = seq.req.prompt_token_ids
            # logical blocks 0..num_cached_blocks-1 are D's prefix-cache hit; P sends the rest
            dst_ids = seq.req.block_table[seq.num_cached_blocks:self.spec.num_blocks_for(len(prompt))]
            delay = faults.delay_s("receive", prompt)
            if faults.fails("receive", prompt):
                fault = "injected fault: KVFLOW_FAULT_RECEIVE_FAIL"
        self._react(self.receiver.on_message(msg, frames, ident.decode() if ident else None,
                                             dst_ids, delay_s=delay, fault=fault))

    def _send_data(self, msg, peer: str | None) -> None:
        """The receiver's replies to P ``peer`` (acks, the loop's lease renewals)."""
        self.send(self.data, msg, ident=peer.encode() if peer is not None else None)

    def _react(self, arrival) -> None:
        if arrival.status == "ignored":
            return
        seq = self.seqs[arrival.req_id]
        req = seq.req
        if req.state is DecodeState.ALLOCATED:
            req.transition(DecodeState.RECEIVING)
        if arrival.status == "failed":
            log.error("%s: transfer of %s failed", self.instance_id, arrival.req_id,
                      exc_info=arrival.exc)
            # blocks P may still write stay lent; reusable ones are freed (never decoded from)
            self._end(arrival.req_id, DecodeState.FAILED, _failure(arrival.exc, seq),
                      lend=not arrival.reusable)
            return
        if arrival.status != "done":  # a layerwise part, or held by a test fault
            return
        n = self.spec.num_blocks_for(len(req.prompt_token_ids))
        stats = arrival.stats
        seq.kvflow = {"clock": {"kv_done": arrival.t_done},
                      "prefill_instance": arrival.peer or self.peer_id,
                      "decode_instance": self.instance_id, **self.receiver.describe(),
                      "blocks": stats.blocks, "payload_bytes": stats.payload_bytes,
                      "transfer_ms": arrival.transfer_ms,
                      "copy_ms": round(stats.copy_ms, 3),
                      "gather_ms": arrival.gather_ms,
                      "block_table": list(req.block_table),
                      "cached_blocks": seq.num_cached_blocks,
                      "layerwise": stats.layerwise}
        faults.add_kv_digest(seq.kvflow, self.cache, req)
        seq.kvflow.update(arrival.pushed)
        if self.prefix is not None:  # the prompt's full blocks now hold their KV
            self.prefix.insert(req.prompt_token_ids, req.block_table[:n])
        self.loop.take_first(seq, arrival.first_token)  # P sent it to the router already


def _failure(exc: BaseException | None, seq: Seq) -> str:
    """The error of a failed transfer; a ``--kv-verify`` mismatch names the logical block."""
    from kvflow.connector import KVVerifyError
    if isinstance(exc, KVVerifyError):
        logical = seq.num_cached_blocks + exc.index
        return (f"kv verify failed: logical block {logical} (D block "
                f"{seq.req.block_table[logical]}) of {exc.req_id} arrived with digest "
                f"{exc.got & 0xFFFFFFFF:#010x}, P sent {exc.sent & 0xFFFFFFFF:#010x}; the "
                f"request's blocks are freed, not decoded from")
    return f"KV transfer failed: {exc}"
