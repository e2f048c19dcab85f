"""The requests live on a decoding instance (D or colocated): admission into the instance's own
blocks (after a prefix-cache hit), then continuous batching until a stop reason."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvflow.serve.protocol import Allocate, Allocated, Rejected, Tokens
from kvflow.blocks import AdmissionError, NoFreeBlocksError, PrefixCache, Request, admission_check

from . import faults
from .sampling import sample_token, stop_reason
from ..timings import stamp

log = logging.getLogger("kvflow.serve.sequences")


@dataclasses.dataclass
class Seq:
    """A request live on this instance, with what decoding needs beyond :class:`Request`."""
    req: Request
    seed: int
    ignore_eos: bool
    kvflow: dict[str, Any] = dataclasses.field(default_factory=dict)
    t_alloc: float = dataclasses.field(default_factory=time.monotonic)
    num_cached_blocks: int = 0      # logical blocks 0..k-1 came from the prefix cache
    reported: bool = False          # this instance sent the router its kvflow block


class DecodesWithLoop:
    """The event-loop methods of an instance that decodes through ``self.loop`` (D, colocated)."""

    def free_blocks(self) -> int:
        return self.loop.free_blocks()

    def has_work(self) -> bool:
        return self.loop.has_work()

    def num_running(self) -> int:
        return len(self.loop.seqs)

    def work(self) -> None:
        self.loop.step()


class DecodeLoop:
    """Live requests, their blocks and the batched decode step of instance ``inst``; ``states``:
    the role's request states (:class:`~kvflow.blocks.DecodeState` or ``ColocatedState``)."""

    def __init__(self, inst: Any, states: Any, prefix: PrefixCache | None = None) -> None:
        self.inst, self.states, self.prefix = inst, states, prefix
        self.seqs: dict[str, Seq] = {}

    def free_blocks(self) -> int:
        """Blocks a new request can get: free ones plus evictable prefix-cache blocks."""
        return self.inst.allocator.num_free + (self.prefix.num_evictable if self.prefix else 0)

    def duplicate(self, req_id: str) -> Rejected:
        """The refusal of an Allocate whose id is live here."""
        return Rejected(req_id=req_id, kind="error", error=(
            f"request id {req_id} is already live on {self.inst.role} instance "
            f"{self.inst.instance_id}; a second Allocate with it is refused"))

    def allocate(self, msg: Allocate) -> None:
        """Admit ``msg`` and answer :class:`Allocated` (D's block table), or
        :class:`Rejected` (``capacity``: never fits; ``busy``: not now; ``error``: live id)."""
        inst = self.inst
        if msg.req_id in self.seqs:
            inst.send_ctrl(self.duplicate(msg.req_id))
            return
        try:
            need = admission_check(max(len(msg.token_ids), 1), msg.max_tokens,
                                   max_model_len=inst.max_model_len, num_blocks=inst.num_blocks,
                                   block_size=inst.spec.block_size)
            cached, blocks = self._take_blocks(msg.token_ids, need)
        except (AdmissionError, ValueError) as exc:
            inst.send_ctrl(Rejected(req_id=msg.req_id, kind="capacity", error=str(exc),
                                    param=getattr(exc, "param", "prompt")))
            return
        except NoFreeBlocksError as exc:
            inst.send_ctrl(Rejected(req_id=msg.req_id, kind="busy", error=str(exc)))
            return
        req = Request(request_id=msg.req_id, prompt_token_ids=list(msg.token_ids),
                      max_tokens=msg.max_tokens, temperature=msg.temperature, role=inst.role)
        req.set_block_table(blocks)  # this instance's own table: replaces anything P used
        self.seqs[msg.req_id] = Seq(req, msg.seed, msg.ignore_eos, num_cached_blocks=cached)
        inst.send_ctrl(Allocated(req_id=msg.req_id, block_ids=blocks, num_cached_blocks=cached))

    def _take_blocks(self, token_ids: list[int], need: int) -> tuple[int, list[int]]:
        """(k, table): the prefix-cache hit (k blocks) then ``need - k`` new ones, evicting if
        short; NoFreeBlocksError (nothing kept) when even eviction cannot make room."""
        alloc = self.inst.allocator
        cached = self.prefix.match(token_ids, max_blocks=need) if self.prefix else []
        short = need - len(cached) - alloc.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        try:
            return len(cached), cached + alloc.allocate(need - len(cached))
        except NoFreeBlocksError:
            alloc.free(cached)
            raise

    def emit(self, seq: Seq, token: int) -> None:
        """Append ``token`` to ``seq`` and send it (the ``kvflow`` block on the first message),
        ending the request on a stop reason."""
        inst, req = self.inst, seq.req
        req.append_token(token)
        reason = self._stop(seq, token)
        index = len(req.output_token_ids) - 1
        kvflow = {} if seq.reported else seq.kvflow
        if index == 1:
            stamp(kvflow, "second_token_emitted")
        seq.reported = True
        inst.send_ctrl(Tokens(req_id=req.request_id, token_ids=[token], finished=bool(reason),
                              finish_reason=reason, kvflow=kvflow, index=index))
        if reason:
            self.end(req.request_id, self.states.DONE, "", notify=False)

    def take_first(self, seq: Seq, token: int) -> None:
        """D: the KV is in; append P's first token without sending it and decode, or, when it
        ends the request, tell the router D is done (an empty finished ``Tokens``, index 1)."""
        req = seq.req
        req.append_token(token)
        req.transition(self.states.DECODING)
        reason = self._stop(seq, token)
        if reason:
            seq.reported = True
            self.inst.send_ctrl(Tokens(req_id=req.request_id, token_ids=[], finished=True,
                                       finish_reason=reason, kvflow=seq.kvflow, index=1))
            self.end(req.request_id, self.states.DONE, "", notify=False)

    def _stop(self, seq: Seq, token: int) -> str:
        inst, req = self.inst, seq.req
        return stop_reason(token, len(req.output_token_ids), req.max_tokens, req.num_tokens,
                           inst.max_model_len, inst.tokenizer.eos_token_id, seq.ignore_eos)

    def end(self, req_id: str, state: Any, error: str, *, notify: bool = True,
            free: bool = True) -> Seq | None:
        """End a live request: free its blocks (unless ``free`` is False), move it to ``state``,
        and with ``notify`` send the router its error."""
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return None
        if free:
            self.inst.allocator.free(seq.req.block_table)
        if not seq.req.finished:
            seq.req.transition(state, error=error or None)
        if notify:
            self.inst.send_ctrl(Tokens(req_id=req_id, token_ids=[], finished=True,
                                       finish_reason="error", error=error))
        return seq

    def running(self) -> list[Seq]:
        return [s for s in self.seqs.values() if s.req.state is self.states.DECODING]

    def has_work(self) -> bool:
        return any(s.req.state is self.states.DECODING for s in self.seqs.values())

    def step(self) -> None:
        """One decode step of every running request; a failed step ends them all."""
        batch = self.running()
        items = [(s.req.output_token_ids[-1], s.req.num_tokens - 1, s.req.block_table) for s in batch]
        delay = max((faults.delay_s("step", s.req.prompt_token_ids) for s in batch), default=0.0)
        if delay:  # test fault: a slow decode step (the loop is blocked meanwhile)
            time.sleep(delay)
        try:
            logits = self.inst.engine.decode(items)
        except Exception as exc:
            log.exception("%s: decode step failed", self.inst.instance_id)
            for s in batch:
                self.end(s.req.request_id, self.states.FAILED, f"decode failed: {exc}")
            return
        for i, s in enumerate(batch):
            req = s.req
            self.emit(s, sample_token(logits[i], req.temperature, s.seed, len(req.output_token_ids)))
