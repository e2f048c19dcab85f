"""The colocated instance: prefill and decode in one instance and one cache, no connector: the
reference that disaggregated output must match token for token."""

from __future__ import annotations

import logging
import time

from kvflow.serve.protocol import Abort, Allocate, Prefill, Rejected
from kvflow.blocks import ColocatedState

from . import faults
from .base import Instance
from .sampling import sample_token
from .sequences import DecodeLoop, DecodesWithLoop
from ..timings import stamp

log = logging.getLogger("kvflow.serve.colocated")


class ColocatedInstance(DecodesWithLoop, Instance):
    """Prefill and decode in one instance and one cache (no transfer)."""

    role = "colocated"

    def setup(self) -> None:
        from kvflow.cache import PagedKVCache
        from kvflow.engine import Engine
        from kvflow.blocks import BlockAllocator
        self.cache = PagedKVCache(self.spec, self.num_blocks, device=self.cfg.device)
        self.engine = Engine(self.model, self.cache)
        self.allocator = BlockAllocator(self.num_blocks)
        self.loop = DecodeLoop(self, ColocatedState)
        self.seqs = self.loop.seqs

    def on_allocate(self, msg: Allocate, frames, ident) -> None:
        self.loop.allocate(msg)

    def on_abort(self, msg: Abort, frames, ident) -> None:
        self.loop.end(msg.req_id, ColocatedState.ABORTED, msg.reason or "aborted", notify=False)
        self.report_blocks()  # the router sees the freed blocks now

    def on_prefill(self, msg: Prefill, frames, ident) -> None:
        seq = self.seqs.get(msg.req_id)
        if seq is None or seq.req.state is not ColocatedState.WAITING:
            self.send_ctrl(Rejected(req_id=msg.req_id, kind="error",
                                    error=f"prefill of unknown request {msg.req_id}"))
            return
        req, t_start = seq.req, time.monotonic()  # prefilled at once: received = started
        req.transition(ColocatedState.PREFILLING)
        try:
            logits = self.engine.prefill(req.prompt_token_ids, req.block_table,
                                         chunk_size=self.cfg.max_num_batched_tokens)
        except Exception as exc:
            log.exception("%s: prefill of %s failed", self.instance_id, msg.req_id)
            self.loop.end(msg.req_id, ColocatedState.FAILED, f"prefill failed: {exc}")
            return
        seq.kvflow = {"prefill_instance": self.instance_id, "decode_instance": self.instance_id,
                      "kv_connector": "none", "layerwise": False, "blocks": 0,
                      "payload_bytes": 0, "transfer_ms": 0.0, "block_table": list(req.block_table),
                      "clock": {"prefill_received": t_start, "prefill_started": t_start}}
        faults.add_kv_digest(seq.kvflow, self.cache, req)
        req.transition(ColocatedState.DECODING)
        token = sample_token(logits, req.temperature, seq.seed, 0)
        stamp(seq.kvflow, "first_token_sampled")
        self.loop.emit(seq, token)
