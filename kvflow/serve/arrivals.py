"""D's side of a transfer's arrival: the connector's messages (``KVReady``, ``KVData``,
``KVLayer`` parts, ``KVPushed``) for a request D allocated, put into D's blocks by the
connector's receiver, checked against P's lease first when the receiver reads P's memory, then
acknowledged (when the connector acks); the first token (P's, already streamed by the router)
is appended and decoding starts (``kv_done`` stamped, :mod:`kvflow.serve.timings`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvflow.protocol import KVAck, KVPushed
from kvflow.blocks import DecodeState

from . import faults
from .sequences import Seq

log = logging.getLogger("kvflow.serve.decode")


@dataclasses.dataclass
class InFlight:
    """An arrived transfer held back by a test fault (``KVFLOW_FAULT_RECEIVE_DELAY_S``)."""
    msg: Any
    frames: list
    ident: bytes | None
    due: float


class Arrivals:
    """Handlers of :class:`~kvflow.serve.decode.DecodeInstance` for arriving KV (a mixin: it
    uses D's ``receiver``, ``seqs``, ``inflight``, ``lent``, ``loop``, ``data`` socket and
    ``_end``)."""

    def on_kvready(self, msg, frames, ident) -> None:
        self._arrive(msg, frames, ident)

    def on_kvdata(self, msg, frames, ident) -> None:
        self._arrive(msg, frames, ident)

    def on_kvpushed(self, msg: KVPushed, frames, ident) -> None:
        if msg.req_id in self.lent:  # ended here meanwhile: P is done with the blocks now
            self.lent.give_back([msg.req_id])
            return
        self._arrive(msg, frames, ident)

    def on_kvlayer(self, msg, frames, ident) -> None:
        # layerwise parts come from P's sender thread; D acks to P's control link (reply_to)
        self._arrive(msg, frames, msg.reply_to.encode())

    def _ack(self, req_id: str, ident: bytes | None, error: str = "") -> None:
        """Ack a transfer to P (when the connector acks: P holds something until then)."""
        if self.receiver.acks:
            self.send(self.data, KVAck(req_id=req_id, ok=not error, error=error), ident=ident)

    def _arrive(self, msg, frames, ident) -> None:
        seq = self.seqs.get(msg.req_id)
        if seq is None or seq.req.state not in (DecodeState.ALLOCATED, DecodeState.RECEIVING) \
                or msg.req_id in self.inflight:  # late, aborted or unknown: ignored
            self._ack(msg.req_id, ident, "unknown or aborted request")
            return
        if seq.req.state is DecodeState.ALLOCATED:
            seq.req.transition(DecodeState.RECEIVING)
        delay = faults.delay_s("receive", seq.req.prompt_token_ids)
        if delay:  # test fault: the transfer stays in flight; abort or kill D meanwhile
            self.inflight[msg.req_id] = InFlight(
                msg, [bytes(getattr(f, "buffer", f)) for f in frames], ident,
                time.monotonic() + delay)
            return
        self._receive(msg, frames, ident)

    def _lease_ok(self, msg, seq: Seq) -> bool:
        """P's lease on the sent blocks still holds (20% margin), for connectors that read
        P's memory."""
        if not self.receiver.reads_peer_memory or not getattr(msg, "t_start", 0.0):
            return True
        start = max(msg.t_start, seq.t_renewed if seq.t_renewed >= msg.t_start else 0.0)
        return time.time() - start < 0.8 * self.kv_lease_s

    def _receive(self, msg, frames, ident) -> None:
        seq = self.seqs[msg.req_id]
        req = seq.req
        n = self.spec.num_blocks_for(len(req.prompt_token_ids))
        try:
            if not self._lease_ok(msg, seq):
                raise TimeoutError(f"P's lease of {self.kv_lease_s:g} s on the sent blocks "
                                   f"expired before D could read them")
            if faults.fails("receive", req.prompt_token_ids):
                raise RuntimeError("injected fault: KVFLOW_FAULT_RECEIVE_FAIL")
            # logical blocks 0..num_cached_blocks-1 are D's prefix-cache hit; P sends the rest
            stats = self.receiver.receive(msg, frames, self.cache,
                                          req.block_table[seq.num_cached_blocks:n],
                                          ident.decode() if ident else None)
        except Exception as exc:
            log.exception("%s: transfer of %s failed", self.instance_id, msg.req_id)
            self._ack(msg.req_id, ident, str(exc))
            # with an acking connector P may still be writing nothing; without one (ipc-push)
            # this message was P's last word: the blocks are free now (never decoded from,
            # never in the prefix cache)
            self._end(msg.req_id, DecodeState.FAILED, _failure(exc, seq),
                      lend=self.receiver.acks)
            return
        if stats is None:  # a layerwise part: more layers to come
            return
        t_done, now = time.monotonic(), time.time()
        self._ack(msg.req_id, ident)
        seq.kvflow = {"clock": {"kv_done": t_done},
                      "prefill_instance": ident.decode() if ident else self.peer_id,
                      "decode_instance": self.instance_id, **self.receiver.describe(),
                      "blocks": stats.blocks, "payload_bytes": stats.payload_bytes,
                      "transfer_ms": round((now - msg.t_start) * 1e3 if msg.t_start else 0.0, 3),
                      "copy_ms": round(stats.copy_ms, 3),
                      "gather_ms": round(getattr(msg, "gather_ms", 0.0), 3),
                      "block_table": list(req.block_table),
                      "cached_blocks": seq.num_cached_blocks,
                      "layerwise": stats.layerwise}
        digest = faults.kv_digest(self.cache, req.block_table, len(req.prompt_token_ids))
        if digest is not None:
            seq.kvflow["kv_digest"] = digest
        if isinstance(msg, KVPushed):  # the part P waited for after the prefill, + the message
            seq.kvflow["exposed_ms"] = round(msg.exposed_ms + max(0.0, now - msg.t_done) * 1e3, 3)
            seq.kvflow["prefill_ms"] = round(msg.prefill_ms, 3)
        if self.prefix is not None:  # the prompt's full blocks now hold their KV
            self.prefix.insert(req.prompt_token_ids, req.block_table[:n])
        self.loop.take_first(seq, msg.first_token)  # P sent it to the router already


def _failure(exc: Exception, seq: Seq) -> str:
    """The error of a failed transfer; a ``--kv-verify`` mismatch names the logical block."""
    from kvflow.connector import KVVerifyError
    if isinstance(exc, KVVerifyError):
        logical = seq.num_cached_blocks + exc.index
        return (f"kv verify failed: logical block {logical} (D block "
                f"{seq.req.block_table[logical]}) of {exc.req_id} arrived with digest "
                f"{exc.got & 0xFFFFFFFF:#010x}, P sent {exc.sent & 0xFFFFFFFF:#010x}; the "
                f"request's blocks are freed, not decoded from")
    return f"KV transfer failed: {exc}"
