"""The colocated instance: prefill and decode in one instance and one cache, no transfer.

It runs D's decode loop (:class:`~kvflow.serve.decode.DecodeInstance`) but does the prefill
itself (``Prefill``): the reference that disaggregated output must match token for token.
"""

from __future__ import annotations

import logging

from kvflow.protocol import Prefill, Rejected
from kvflow.sched import ColocatedState

from . import faults
from .decode import DecodeInstance
from .instance import Instance, sample_token

log = logging.getLogger("kvflow.serve.colocated")


class ColocatedInstance(DecodeInstance):
    """Prefill and decode in one instance and one cache (no transfer)."""

    role = "colocated"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.states = ColocatedState

    def warmup(self) -> None:
        pass

    def open_channels(self) -> None:
        Instance.open_channels(self)

    def register_extra(self) -> dict[str, str]:
        return {}

    def transfer_name(self) -> str:
        return "none"

    def on_prefill(self, msg: Prefill, frames, ident) -> None:
        seq = self.seqs.get(msg.req_id)
        if seq is None or seq.req.state is not ColocatedState.WAITING:
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=f"prefill of unknown request {msg.req_id}"))
            return
        req = seq.req
        req.transition(ColocatedState.PREFILLING)
        try:
            logits = self.engine.prefill(req.prompt_token_ids, req.block_table,
                                         chunk_size=self.cfg.max_num_batched_tokens)
        except Exception as exc:
            log.exception("%s: prefill of %s failed", self.instance_id, msg.req_id)
            self._end(msg.req_id, ColocatedState.FAILED, f"prefill failed: {exc}")
            return
        seq.kvflow = {"prefill_instance": self.instance_id, "decode_instance": self.instance_id,
                      "transfer": "none", "blocks": 0, "payload_bytes": 0, "transfer_ms": 0.0,
                      "block_table": list(req.block_table)}
        digest = faults.kv_digest(self.cache, req.block_table, len(req.prompt_token_ids))
        if digest is not None:
            seq.kvflow["kv_digest"] = digest
        req.transition(ColocatedState.DECODING)
        self._emit(seq, sample_token(logits, req.temperature, seq.seed, 0))

    def heartbeat(self, force: bool = False) -> None:
        Instance.heartbeat(self, force)
