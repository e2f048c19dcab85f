"""P's first token, sent to the router the moment it is sampled.

P samples a request's first token at the end of its prefill with the function
:func:`first_token_sampler` makes, which also sends that token to the router
(:class:`~kvflow.protocol.Tokens`, ``index`` 0) before the connector finishes the KV transfer
(:meth:`KVSender.finish <kvflow.connector.base.KVSender.finish>`; push: waits for its copies;
pull and tcp: send the KV message), as FastDeploy, vLLM and SGLang return the prefill's token.
The router streams it at once; D appends it when the KV is in and streams from the second token
on. ``finished`` follows the same stop rule D
applies (:func:`~kvflow.serve.instance.sampling.stop_reason`), so with ``max_tokens`` 1 the request
ends on P's token while D still receives (and then frees) the KV.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvflow.serve.protocol import Prefill, Tokens

from .sampling import sample_token, stop_reason


def first_token_sampler(inst: Any, msg: Prefill, t_received: float,
                        t_started: float) -> Callable[[Any], int]:
    """``sample(logits) -> int`` for the prefill of ``msg``: sample the first token, send it to
    the router with P's stamps (``prefill_received``, ``prefill_started``,
    ``first_token_sampled``: ``time.monotonic()`` s, :mod:`kvflow.serve.timings`).

    Parameters
    ----------
    inst : PrefillInstance
        Gives ``send_ctrl``, ``instance_id``, ``max_model_len`` and ``tokenizer``.
    msg : Prefill
        The request (``max_tokens`` 0: P does not judge the stop; D does).
    t_received, t_started : float
        When P got the Prefill and began its prefill (``time.monotonic()`` s).
    """
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
