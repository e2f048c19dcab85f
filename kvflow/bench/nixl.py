"""The ``nixl`` rows of ``python -m kvflow.bench transfer``: the connector's two data modes as
bench kinds (``nixl`` = direct, ``nixl-staged``) and their same-run ceiling, a bulk NIXL WRITE
of the payload bytes between two agents (the transport UCX picks: set ``UCX_TLS=tcp`` for the
loopback network path, as the connector's rows then use it too).

One descriptor of the whole payload is not NIXL's fastest WRITE: UCX moves several descriptors
of a transfer at once, so a WRITE of 128 KiB pieces beat one 512 MiB piece 1.6-1.9x over TCP
loopback here. The ceiling is therefore the fastest of :data:`CHUNK_BYTES` (the same bytes,
contiguous on both sides, cut into descriptors of that size), and its row names the winner.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .timing import median, time_calls

#: bench kind -> (connector, kv_connector_config)
KINDS = {"nixl": ("nixl", {"mode": "direct"}),
         "nixl-staged": ("nixl", {"mode": "staged", "staging_slots": 1}),  # one P: one slot
         # D's scatter on every SM (receive_max_ctas above any grid) instead of the default cap
         "nixl-staged-uncapped": ("nixl", {"mode": "staged", "staging_slots": 1,
                                           "receive_max_ctas": 1 << 20})}
#: Descriptor sizes (bytes) the bulk WRITE ceiling tries; 0 is the whole payload as one.
CHUNK_BYTES = (0, 64 << 20, 8 << 20, 1 << 20, 128 << 10)


def connector_of(kind: str) -> tuple[str, dict[str, Any] | None]:
    """The connector and config a bench kind runs (``tcp`` is itself, no config)."""
    return KINDS.get(kind, (kind, None))


def chunk_descs(base: int, nbytes: int, chunk: int, device_id: int = 0) -> np.ndarray:
    """Descriptors ``(address, bytes, device_id)`` covering ``[base, base + nbytes)`` in pieces
    of ``chunk`` bytes (the last one shorter; ``chunk`` 0: one piece), uint64 rows."""
    step = chunk or nbytes
    starts = np.arange(0, nbytes, step, dtype=np.uint64)
    out = np.zeros((starts.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + starts
    out[:, 1] = np.minimum(np.uint64(step), np.uint64(nbytes) - starts)
    out[:, 2] = device_id
    return out


def bulk_writer(src: Any, remote_addr: int, remote_md: bytes, remote_mem: tuple[str, int],
                chunk: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(once, close)``: ``once()`` WRITEs every byte of registered tensor ``src`` into the
    peer agent's memory at ``remote_addr`` (``remote_md``: its metadata; ``remote_mem``: its
    NIXL memory type and device id) in descriptors of ``chunk`` bytes, and waits for it."""
    from kvflow.connector.transport.nixl_agent import Agent, mem_type
    a = Agent("bench-src")
    a.register(src)
    name = a.add_peer("dst", remote_md)
    mem, dev = mem_type(src)
    descs = chunk_descs(src.data_ptr(), src.numel() * src.element_size(), chunk, dev)
    local = a.prep("", descs, mem)
    rdescs = chunk_descs(remote_addr, src.numel() * src.element_size(), chunk, remote_mem[1])
    remote = a.prep(name, rdescs, remote_mem[0])
    idx = np.arange(len(descs), dtype=np.int32)

    def once() -> None:
        if src.is_cuda:
            import torch
            torch.cuda.current_stream(src.device).synchronize()
        a.wait([a.write(local, idx, remote, idx, "the ceiling")], 60.0, "the ceiling")
    return once, a.close


def best_of_chunks(src: Any, remote_addr: int, remote_md: bytes, remote_mem: tuple[str, int],
                   *, warmup: int, reps: int) -> tuple[list[float], int]:
    """The fastest bulk WRITE of ``src`` over :data:`CHUNK_BYTES` (median seconds): its times
    and its descriptor size (0: one descriptor)."""
    best: tuple[list[float], int] | None = None
    nbytes = src.numel() * src.element_size()
    for chunk in CHUNK_BYTES:
        if chunk >= nbytes:
            continue
        once, close = bulk_writer(src, remote_addr, remote_md, remote_mem, chunk)
        try:
            ts = time_calls([once], warmup=warmup, reps=reps)
        finally:
            close()
        if best is None or median(ts) < median(best[0]):
            best = (ts, chunk)
    assert best is not None
    return best


def write_ceiling(nbytes: int, *, warmup: int, reps: int,
                  device: str = "cpu") -> tuple[list[float], int]:
    """Seconds per bulk NIXL WRITE of ``nbytes`` contiguous bytes from one agent's registered
    buffer into another's, both in this process on ``device`` (the fastest descriptor size of
    :data:`CHUNK_BYTES`), and that size.

    Raises
    ------
    ImportError
        NIXL is not installed.
    """
    import torch

    from kvflow.connector.transport.nixl_agent import Agent, mem_type
    b = Agent("bench-dst")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    b.register(dst)
    try:
        return best_of_chunks(src, dst.data_ptr(), b.metadata(), mem_type(dst),
                              warmup=warmup, reps=reps)
    finally:
        b.close()


def descs_ceiling(pair: Any, src_ids: list[int], dst_ids: list[int], *, warmup: int,
                  reps: int) -> tuple[list[float], int]:
    """Seconds per WRITE, straight through NIXL, of the descriptor list a ``direct`` request of
    every layer posts (P's prepared lists, the plan's indices of ``src_ids`` / ``dst_ids``),
    with D progressing as for a request; and its number of descriptors. What the connector
    adds over NIXL's per-descriptor cost is its time over this one (issue 28's direct goal)."""
    sender = pair.sender
    writer, peer = sender.copier, next(iter(sender.peers.values()))
    layers = range(0, sender.spec.num_layers)
    local, remote = writer.plan.indices(src_ids, layers), peer.plan.indices(dst_ids, layers)
    agent = sender.agent

    def once() -> None:
        writer._settle()
        agent.wait([agent.write(writer.local, local, peer.remote, remote, "the ceiling")],
                   60.0, "the ceiling")
    pair.hold(True)
    try:
        return time_calls([once], warmup=warmup, reps=reps), len(local)
    finally:
        pair.hold(False)
