"""The ``nixl`` rows of ``python -m kvflow.bench transfer``: the connector's two data modes as
bench kinds (``nixl`` = direct, ``nixl-staged``) and their same-run ceiling, one bulk NIXL WRITE
of the payload bytes (one descriptor, two agents of this process, the transport UCX picks:
set ``UCX_TLS=tcp`` for the loopback network path, as the connector's rows then use it too).
"""

from __future__ import annotations

from typing import Any

from .timing import time_calls

#: bench kind -> (connector, kv_connector_config)
KINDS = {"nixl": ("nixl", {"mode": "direct"}),
         "nixl-staged": ("nixl", {"mode": "staged", "staging_slots": 1})}  # one P: one slot


def connector_of(kind: str) -> tuple[str, dict[str, Any] | None]:
    """The connector and config a bench kind runs (``tcp`` is itself, no config)."""
    return KINDS.get(kind, (kind, None))


def write_ceiling(nbytes: int, *, warmup: int, reps: int) -> list[float]:
    """Seconds per bulk NIXL WRITE of ``nbytes`` contiguous bytes from one agent's registered
    buffer into another's (posted, then ``check_xfer_state`` until DONE).

    Raises
    ------
    ImportError
        NIXL is not installed.
    """
    import torch

    from kvflow.connector.nixl_agent import Agent, block_descs
    a, b = Agent("bench-src"), Agent("bench-dst")
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    a.register(src)
    b.register(dst)
    try:
        name = a.add_peer("dst", b.metadata())
        local = a.prep("", block_descs(src.data_ptr(), 1, 1, nbytes))
        remote = a.prep(name, block_descs(dst.data_ptr(), 1, 1, nbytes))
        import numpy as np
        idx = np.zeros(1, dtype=np.int32)

        def once() -> None:
            a.wait([a.write(local, idx, remote, idx, "the ceiling")], 60.0, "the ceiling")
        return time_calls([once], warmup=warmup, reps=reps)
    finally:
        a.close()
        b.close()
