"""Request and response shapes of the OpenAI-compatible completions API.

``POST /v1/completions`` takes :class:`CompletionRequest` (OpenAI's fields that kvflow honours,
plus OpenAI's other fields when their value is what kvflow does anyway, e.g. ``top_p`` null or
1; unknown fields and wrong types are refused, never coerced, so a typo is not silently
ignored) and answers with
:func:`completion_response` (non-streaming) or server-sent events of :func:`completion_chunk`
followed by ``data: [DONE]``. Every response carries a ``kvflow`` object: ``prefill_instance``,
``decode_instance``, ``kv_connector`` ("ipc-pull", "ipc-push", "tcp" or "none" when
colocated), ``layerwise`` (the KV moved layer by layer during the prefill), ``blocks`` and
``payload_bytes`` moved (blocks x ``KVCacheSpec.bytes_per_block``), ``transfer_ms`` (from P
starting the transfer to the blocks being in D's cache, wall clock) and ``cached_blocks``
(docs/tutorials/quickstart.md, section 4).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def clipped(text: str, limit: int = 80) -> str:
    """``text`` for an error message: ASCII only (a lone surrogate is escaped, so the error
    body can always be encoded), at most ``limit`` characters."""
    text = text.encode("ascii", "backslashreplace").decode()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as JSON for an error message (:func:`clipped`)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value) if not isinstance(value, (list, dict)) else f"<a nested {type(value).__name__}>"
    return clipped(text, limit)


#: OpenAI completion fields kvflow does not implement: field -> (values accepted besides null,
#: why another value is refused).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "top_p": ((1,), "kvflow samples from the full distribution; use top_p=1"),
    "stop": (("", [], [""]), "kvflow stops only at the end-of-sequence token or max_tokens; omit stop"),
    "logprobs": ((), "kvflow does not return log probabilities; omit logprobs"),
    "echo": ((False,), "kvflow does not echo the prompt; use echo=false"),
    "presence_penalty": ((0,), "kvflow applies no penalties; use presence_penalty=0"),
    "frequency_penalty": ((0,), "kvflow applies no penalties; use frequency_penalty=0"),
    "best_of": ((1,), "kvflow generates one completion per request; use best_of=1"),
    "suffix": ((), "kvflow does not insert text; omit suffix"),
    "logit_bias": (({},), "kvflow applies no logit bias; omit logit_bias"),
}
UNSUPPORTED_FIELDS = tuple(UNSUPPORTED)


class StreamOptions(BaseModel):
    """``stream_options`` of a streaming request: ``include_usage`` adds a last chunk with
    ``usage`` and no choices before ``data: [DONE]`` (as OpenAI and vLLM); with it,
    ``continuous_usage_stats`` (vLLM's) puts the running ``usage`` in every chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: usage in every chunk too


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions``.

    Attributes
    ----------
    prompt : str or list[int]
        Text (tokenized by the model's tokenizer) or token ids; not empty.
    max_tokens : int
        New tokens to generate, >= 1 (OpenAI's default 16).
    temperature : float
        0 = greedy (kvflow's default, so that outputs compare token for token across transfer
        modes; OpenAI's and vLLM's default is 1); > 0 samples, finite, <= 100.
    stream : bool
        Server-sent events, one per token.
    seed : int or None
        Sampling seed (temperature > 0), any int64; None (default) draws a fresh seed per
        request, as vLLM.
    ignore_eos : bool
        Keep generating past the end-of-sequence token (vLLM's extension).
    stream_options : StreamOptions or None
        Only with ``stream`` true (as OpenAI and vLLM): ``{"include_usage": true}`` adds a
        usage chunk at the end of the stream.

    null means the default for every field, as in OpenAI's API.

    OpenAI's ``top_p``, ``stop``, ``logprobs``, ``echo``, ``presence_penalty``,
    ``frequency_penalty``, ``best_of``, ``suffix``, ``logit_bias`` and ``user`` are accepted
    when null or set to what kvflow does anyway (:data:`UNSUPPORTED`); another value is HTTP
    400 naming the field. Types are strict: ``"3"``, ``true`` or ``2.0``
    is not an integer, ``"yes"`` not a boolean (an integer is a valid float).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    prompt: Union[str, list[int]]
    max_tokens: int = Field(16, ge=1, lt=2**31)
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    stream: bool = False
    seed: Optional[int] = Field(None, ge=-2**63, lt=2**63)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None
    # OpenAI fields kvflow does not implement: accepted only at their no-op values.
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    stream_options: Optional[StreamOptions] = None

    @field_validator("max_tokens", "temperature", "stream", "ignore_eos", "n", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v)):
            return v
        raise ValueError("prompt must be a string or a list of token ids (integers), got "
                         + shown(v))

    @field_validator(*[name for name in UNSUPPORTED_FIELDS], mode="before")  # the value as sent
    @classmethod
    def _no_op_only(cls, v: Any, info: ValidationInfo) -> Any:
        allowed, why = UNSUPPORTED[info.field_name]
        if v is None or any(v == a and type(v) is not bool or v is a for a in allowed):
            return v
        raise ValueError(f"{info.field_name}={shown(v)} is not supported: {why}")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        bad = [t for t in v if t < 0] if isinstance(v, list) else []
        if bad:
            raise ValueError(f"prompt holds token id {shown(bad[0])}; token ids must be >= 0")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):  # stream is declared (checked) first
            raise ValueError(f"stream_options is only allowed with stream=true, got stream="
                             f"{shown(info.data.get('stream', False))}")
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
            "usage": usage(prompt_tokens, len(token_ids)), "kvflow": kvflow}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object (token counts)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(req_id: str, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last streamed chunk of ``stream_options.include_usage``: no choices, ``usage``."""
    return {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(req_id: str, model: str, text: str, token_ids: list[int],
                     finish_reason: Literal["stop", "length"] | None, kvflow: dict | None = None) -> dict:
    """One streamed chunk; the last one has ``finish_reason`` and ``kvflow``."""
    chunk = {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason, "token_ids": token_ids}]}
    if kvflow is not None:
        chunk["kvflow"] = kvflow
    return chunk
