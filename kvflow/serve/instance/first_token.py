"""P's first token, sent to the router the moment it is sampled (before the KV transfer
finishes); ``finished`` follows D's stop rule."""

from __future__ import annotations

import time
from typing import Any, Callable

from kvflow.serve.protocol import Prefill, Tokens

from .sampling import sample_token, stop_reason


def first_token_sampler(inst: Any, msg: Prefill, t_received: float,
                        t_started: float) -> Callable[[Any], int]:
    """``sample(logits) -> int`` for ``msg``'s prefill on P ``inst``: sample the first token, send
    it with P's ``time.monotonic()`` stamps; ``msg.max_tokens`` 0: P does not judge the stop."""
    def sample(logits: Any) -> int:
        token = sample_token(logits, msg.temperature, msg.seed, 0)
        t = time.monotonic()
        reason = "" if not msg.max_tokens else stop_reason(
            token, 1, msg.max_tokens, len(msg.token_ids) + 1, inst.max_model_len,
            inst.tokenizer.eos_token_id, msg.ignore_eos)
        inst.send_ctrl(Tokens(req_id=msg.req_id, token_ids=[token], finished=bool(reason),
                              finish_reason=reason, index=0, kvflow={
                                  "prefill_instance": inst.instance_id,
                                  "clock": {"prefill_received": t_received,
                                            "prefill_started": t_started,
                                            "first_token_sampled": t}}))
        return token
    return sample
