"""Requests, their lifecycle per role, and admission.

A :class:`Request` lives on the instance that owns its blocks for the whole request: D, or a
colocated instance. P keeps no ``Request``; it holds a prefill's blocks only until D acks or
the lease ends (``kvflow/serve/instance/prefill.py``).

Lifecycles (terminal states end a request; every path into one must free its blocks):

- decode instance (D): ``ALLOCATED -> RECEIVING -> DECODING -> DONE``; any live state may go to
  ``ABORTED``, ``FAILED`` or ``TIMED_OUT``.
- colocated (one instance does both): ``WAITING -> PREFILLING -> DECODING -> DONE`` (+ the same
  ends as D).

D allocates its own blocks and **replaces** the block table that came from P
(:meth:`Request.set_block_table`); P's block ids mean nothing in D's cache.
"""

from __future__ import annotations

import dataclasses
import enum
import time


class DecodeState(enum.Enum):
    ALLOCATED = "allocated"
    RECEIVING = "receiving"
    DECODING = "decoding"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class ColocatedState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


_D, _C = DecodeState, ColocatedState
_ENDS = {"ABORTED", "FAILED", "TIMED_OUT"}


def _table(enum_cls, chain):
    moves = {}
    for a, b in zip(chain, chain[1:]):
        moves[enum_cls[a]] = {enum_cls[b]}
    for a in chain[:-1]:
        moves[enum_cls[a]] |= {s for s in enum_cls if s.name in _ENDS}
    return moves


# Legal moves: state -> set of next states. Terminal states have no entry.
TRANSITIONS = {
    DecodeState: _table(_D, ["ALLOCATED", "RECEIVING", "DECODING", "DONE"]),
    ColocatedState: _table(_C, ["WAITING", "PREFILLING", "DECODING", "DONE"]),
}
INITIAL = {"decode": _D.ALLOCATED, "colocated": _C.WAITING}


class IllegalTransitionError(ValueError):
    """A state change that the role's lifecycle does not allow."""


class AdmissionError(ValueError):
    """A request that can never fit: refused before any block is allocated or moved.
    ``param`` is the request field to blame: "prompt" when the prompt alone cannot fit,
    else "max_tokens"."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def is_terminal(state: enum.Enum) -> bool:
    """True for DONE, ABORTED, FAILED, TIMED_OUT."""
    return state not in TRANSITIONS[type(state)]


@dataclasses.dataclass(kw_only=True)
class Request:
    """One completion request as one instance sees it.

    Attributes
    ----------
    request_id : str
    prompt_token_ids : list[int]
    max_tokens : int
        New tokens to generate (>= 1).
    temperature : float
        0 = greedy.
    role : {"decode", "colocated"}
    block_table : list[int]
        Physical block ids in *this* instance's cache, logical block order.
    output_token_ids : list[int]
    state : DecodeState or ColocatedState
        Starts at the role's first state (:data:`INITIAL`).
    arrival_time, first_token_time, last_token_time, finish_time : float or None
        ``time.monotonic()`` seconds; TTFT and TPOT derive from them.
    error : str or None
        Why the request ended ABORTED / FAILED / TIMED_OUT.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    role: str = "colocated"
    block_table: list[int] = dataclasses.field(default_factory=list)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    state: enum.Enum | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.role not in INITIAL:
            raise ValueError(f"role must be one of {sorted(INITIAL)}, got {self.role!r}")
        if self.state is None:
            self.state = INITIAL[self.role]
        elif type(self.state) is not type(INITIAL[self.role]):
            raise ValueError(f"state={self.state} does not belong to role {self.role!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.block_table = list(self.block_table)

    # ---- lifecycle --------------------------------------------------------------------
    def transition(self, new: enum.Enum, *, error: str | None = None) -> None:
        """Move to ``new``; stamps ``finish_time`` on a terminal state.

        Raises
        ------
        IllegalTransitionError
            If the role's lifecycle has no move from the current state to ``new`` (both named).
        """
        allowed = TRANSITIONS[type(self.state)].get(self.state, set())
        if new not in allowed:
            raise IllegalTransitionError(
                f"request {self.request_id}: illegal {self.role} transition "
                f"{self.state.name} -> {getattr(new, 'name', new)}; allowed: "
                f"{sorted(s.name for s in allowed) or 'none (terminal)'}")
        self.state = new
        if error is not None:
            self.error = error
        if is_terminal(new):
            self.finish_time = time.monotonic()

    @property
    def finished(self) -> bool:
        return is_terminal(self.state)

    def set_block_table(self, block_ids: list[int]) -> None:
        """**Replace** the block table with this instance's own ``block_ids`` (a copy); never
        extends a table that came from another instance."""
        self.block_table = list(block_ids)

    # ---- tokens and timing ------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a generated token and its time (the first one sets ``first_token_time``)."""
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(token_id)

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds from arrival), None before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (seconds): (last - first) / (n - 1)."""
        n = len(self.output_token_ids)
        if n < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def admission_check(prompt_len: int, max_tokens: int, *, max_model_len: int, num_blocks: int,
                    block_size: int) -> int:
    """Refuse a request that can never fit; return the blocks it needs.

    The request needs ``ceil((prompt_len + max_tokens) / block_size)`` blocks for its whole
    life (the last generated token's KV is never written, but reserving it keeps the
    arithmetic simple and matches what a colocated instance holds).

    Raises
    ------
    AdmissionError
        ``prompt_len + max_tokens > max_model_len``, or more blocks than the cache has
        (``num_blocks``); the message gives the numbers.
    ValueError
        A size that is not a positive int, named.
    """
    for name, v in (("prompt_len", prompt_len), ("max_tokens", max_tokens),
                    ("max_model_len", max_model_len), ("num_blocks", num_blocks),
                    ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise AdmissionError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds max_model_len={max_model_len}",
                             "prompt" if prompt_len >= max_model_len else "max_tokens")
    need = blocks_needed(total, block_size)
    if need > num_blocks:
        raise AdmissionError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs "
                             f"{need} blocks of {block_size} tokens; the cache has {num_blocks}",
                             "prompt" if blocks_needed(prompt_len, block_size) > num_blocks
                             else "max_tokens")
    return need
