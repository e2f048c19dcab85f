"""``--kv-verify``: P's digests of the blocks it sends (``block_digests`` of ``KVData`` /
``KVReady``), D's check of what its scatter or copy wrote (fail closed: a mismatch raises
:class:`KVVerifyError`). See docs/reliability.md, "KV integrity: `--kv-verify`".
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
    """P's digests of the ``n`` blocks ``header`` sends (TransferError: another number)."""
    sent = list(header.block_digests)
    if len(sent) != n:
        raise TransferError(f"kv verify: {type(header).__name__} for {header.req_id} carries "
                            f"{len(sent)} block digests for {n} blocks (is P started with "
                            f"--kv-verify?)")
    return sent


def check(req_id: str, sent: list[int], got: torch.Tensor) -> None:
    """Compare P's digests ``sent`` with D's ``got`` (int32 ``[n]``); KVVerifyError at the
    first block whose digests differ."""
    mine = got.tolist()
    for i, (a, b) in enumerate(zip(sent, mine)):
        if a != b:
            raise KVVerifyError(req_id, i, a, b)


def new_digest(n: int, device: Any) -> torch.Tensor:
    """An int32 ``[n]`` digest output on ``device`` (the ops fill it)."""
    return torch.empty(n, dtype=torch.int32, device=device)
