"""What an instance keeps for a request after its own part ends, until the peer is done with it
(P: :mod:`.held`; D: :mod:`.lent`, :mod:`.arrival`; docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class Kept:
    """What one request keeps, for which peer: P's sent blocks until D's ack or the lease's end
    (``KVSender.finish`` returns it), D's blocks lent to a P that may still write them, or a data
    message D holds back under a test fault. ``blocks``: the ids kept (P: those D still reads, []
    when D reads a copy; D: those the P may write); ``keep``: memory ZMQ still reads (P's staging
    buffer) or a held message's ``(msg, frames, fault)``; ``peer``: "" or None until known;
    ``since``: ``time.monotonic()`` when kept or last renewed (not compared); ``due``: a
    ``time.monotonic()`` deadline (0.0: none) for a held message, or for blocks lent to a P that D
    cannot judge; ``warned``: an overdue warning was logged; ``exited``: ``peer``'s process exited.
    """
    blocks: list[int]
    keep: Any = None
    peer: str | None = ""
    since: float = dataclasses.field(default_factory=time.monotonic, compare=False)
    due: float = 0.0
    warned: bool = False
    exited: bool = False
