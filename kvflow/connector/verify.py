"""``--kv-verify``: P's digests of the blocks it sends, D's check after its copy (fail closed).

P puts one digest per sent block (:func:`kvflow.kernels.block_digest`'s definition) in the
data-plane message (``block_digests`` of :class:`~kvflow.connector.messages.KVData` /
:class:`~kvflow.connector.messages.KVReady`): ``tcp`` from its gather's own launch; ``ipc-pull``, where
P copies nothing (D copies out of P's exported cache), from one read-only digest launch over
its blocks after the prefill (:func:`kvflow.kernels.digest.digest_blocks`). D's scatter (tcp)
or copy (ipc-pull) computes the digest of what it wrote in the same launch, and :func:`check`
compares: a mismatch raises :class:`KVVerifyError`, and D ends the request (HTTP 502) and
frees its blocks without decoding from them or putting them in its prefix cache
(:mod:`kvflow.serve.arrivals`).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import TransferError


class KVVerifyError(TransferError):
    """Sent block ``index`` (0: the first block P sent, after D's prefix hit) arrived with
    digest ``got`` where P sent ``sent``."""

    def __init__(self, req_id: str, index: int, sent: int, got: int) -> None:
        super().__init__(f"kv verify: sent block {index} of {req_id} arrived with digest "
                         f"{hex32(got)}, P sent {hex32(sent)}")
        self.req_id, self.index, self.sent, self.got = req_id, index, sent, got


def hex32(value: int) -> str:
    """A digest (an int32) as its 32 bits in hex: ``0x0000abcd``."""
    return f"{value & 0xFFFFFFFF:#010x}"


def expect(header: Any, n: int) -> list[int]:
    """P's digests of the ``n`` blocks ``header`` sends.

    Raises
    ------
    TransferError
        P sent another number of digests (none: P runs without ``--kv-verify``).
    """
    sent = list(header.block_digests)
    if len(sent) != n:
        raise TransferError(f"kv verify: {type(header).__name__} for {header.req_id} carries "
                            f"{len(sent)} block digests for {n} blocks (is P started with "
                            f"--kv-verify?)")
    return sent


def check(req_id: str, sent: list[int], got: torch.Tensor) -> None:
    """Compare P's digests ``sent`` with D's ``got`` (int32 ``[n]``).

    Raises
    ------
    KVVerifyError
        At the first block whose digests differ.
    """
    mine = got.tolist()
    for i, (a, b) in enumerate(zip(sent, mine)):
        if a != b:
            raise KVVerifyError(req_id, i, a, b)


def new_digest(n: int, device: Any) -> torch.Tensor:
    """An int32 ``[n]`` digest output on ``device`` (the ops fill it)."""
    return torch.empty(n, dtype=torch.int32, device=device)
