"""Request and response shapes of the OpenAI-compatible completions API.

``POST /v1/completions`` takes :class:`CompletionRequest` (OpenAI's fields that kvflow honours;
unknown fields are refused so a typo is not silently ignored) and answers with
:func:`completion_response` (non-streaming) or server-sent events of :func:`completion_chunk`
followed by ``data: [DONE]``. Every response carries a ``kvflow`` object: ``prefill_instance``,
``decode_instance``, ``transfer`` ("ipc", "tcp" or "none" when colocated), ``blocks`` and
``payload_bytes`` moved (blocks x ``KVCacheSpec.bytes_per_block``), ``transfer_ms`` (from P
starting the transfer to the blocks being in D's cache, wall clock).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions``.

    Attributes
    ----------
    prompt : str or list[int]
        Text (tokenized by the model's tokenizer) or token ids; not empty.
    max_tokens : int
        New tokens to generate, >= 1 (OpenAI's default 16).
    temperature : float
        0 = greedy; > 0 samples (seeded by ``seed``).
    stream : bool
        Server-sent events, one per token.
    seed : int
        Sampling seed (temperature > 0).
    ignore_eos : bool
        Keep generating past the end-of-sequence token (vLLM's extension).
    """

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Union[str, list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    stream: bool = False
    seed: int = Field(0, ge=0, lt=2**62)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("prompt token ids must be >= 0")
        return v


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def completion_response(req_id: str, model: str, text: str, token_ids: list[int],
                        finish_reason: str, prompt_tokens: int, kvflow: dict) -> dict:
    """A non-streaming ``text_completion`` object (plus ``token_ids`` and ``kvflow``)."""
    return {"id": req_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason, "token_ids": token_ids}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                      "total_tokens": prompt_tokens + len(token_ids)},
            "kvflow": kvflow}


def completion_chunk(req_id: str, model: str, text: str, token_ids: list[int],
                     finish_reason: Literal["stop", "length"] | None, kvflow: dict | None = None) -> dict:
    """One streamed chunk; the last one has ``finish_reason`` and ``kvflow``."""
    chunk = {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason, "token_ids": token_ids}]}
    if kvflow is not None:
        chunk["kvflow"] = kvflow
    return chunk
