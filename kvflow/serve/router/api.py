"""Request and response shapes of the OpenAI-compatible ``POST /v1/completions``, with the
``kvflow`` object (docs/tutorials/quickstart.md, "4. Read the `kvflow` fields")."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def clipped(text: str, limit: int = 80) -> str:
    """``text`` for an error message: ASCII only (escaped), at most ``limit`` characters."""
    text = text.encode("ascii", "backslashreplace").decode()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as JSON for an error message (:func:`clipped`)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value) if not isinstance(value, (list, dict)) else f"<a nested {type(value).__name__}>"
    return clipped(text, limit)


#: OpenAI fields kvflow does not implement: field -> (values accepted besides null, why not others)
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


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices;
    with it, ``continuous_usage_stats`` (vLLM's) puts the running ``usage`` in every chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (docs/tutorials/quickstart.md, "Request fields"): null means
    the default; the fields of :data:`UNSUPPORTED` are taken at their no-op values only; types are
    strict (``"3"``, ``true`` or ``2.0`` is no integer); another value is HTTP 400 naming the field.
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

    @field_validator(*UNSUPPORTED, mode="before")  # the value as sent
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
