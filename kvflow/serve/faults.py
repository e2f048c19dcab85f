"""Fault injection for the reliability tests; every fault is off unless its environment
variable is set, and costs one dictionary lookup when off.

=================================  ===========================================================
variable                           effect
=================================  ===========================================================
``KVFLOW_FAULT_PREFILL_DELAY_S``   P sleeps this long before a prefill (P is "prefilling")
``KVFLOW_FAULT_RECEIVE_DELAY_S``   D keeps an arrived transfer in flight (RECEIVING) this long
                                   before copying it (a slow transfer: abort or kill D now)
``KVFLOW_FAULT_MATCH``             comma-separated token ids: faults apply only to requests
                                   whose prompt contains this run of ids (unset: to every one)
=================================  ===========================================================
"""

from __future__ import annotations

import os
from typing import Sequence

_VARS = {"prefill": "KVFLOW_FAULT_PREFILL_DELAY_S", "receive": "KVFLOW_FAULT_RECEIVE_DELAY_S"}


def _contains(ids: Sequence[int], run: list[int]) -> bool:
    n = len(run)
    return any(list(ids[i:i + n]) == run for i in range(len(ids) - n + 1))


def delay_s(kind: str, token_ids: Sequence[int]) -> float:
    """Seconds of injected delay for fault ``kind`` ("prefill" or "receive") of a request with
    prompt ``token_ids``; 0.0 when the fault is off or the prompt does not match."""
    value = os.environ.get(_VARS[kind], "")
    if not value:
        return 0.0
    match = os.environ.get("KVFLOW_FAULT_MATCH", "")
    if match and not _contains(token_ids, [int(x) for x in match.split(",")]):
        return 0.0
    return float(value)
