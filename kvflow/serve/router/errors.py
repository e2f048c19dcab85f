"""The router's refusals, worded: :class:`RequestError` (HTTP status, message, parameter),
:func:`validation_message` (a body pydantic refused) and :func:`registration_refusal`."""

from __future__ import annotations

from kvflow.serve.protocol import PROTOCOL_VERSION, Register

from .api import clipped, shown


class RequestError(Exception):
    """Ends a request with an HTTP status and message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def validation_message(errs: list[dict], content_type: str | None) -> tuple[str, str]:
    """(message, param) for the first pydantic error of ``errs``: the field, what is wrong and
    the value sent (``max_tokens: Input should be greater than or equal to 1, got -1``)."""
    err = errs[0] if errs else {}
    loc = [str(x)[:80] for x in err.get("loc", ()) if x != "body"]
    kind, detail = err.get("type"), str(err.get("msg", "invalid body"))
    if kind == "json_invalid":  # loc is a character offset into the body
        at = f" at character {loc[0]}" if loc else ""
        return f"body: not valid JSON{at}: {err.get('ctx', {}).get('error', detail)}", "body"
    if not loc and (isinstance(err.get("input"), (bytes, bytearray)) or "json" not in (content_type or "")):
        got = f"Content-Type: {clipped(content_type)}" if content_type else "no Content-Type"
        return f"body: send a JSON object with Content-Type: application/json (got {got})", "body"
    if not loc and kind == "missing":
        return "body: the request has no body; send a JSON object", "body"
    where, param = ".".join(loc) or "body", loc[0] if loc else "body"
    if kind == "string_unicode":  # a lone surrogate where pydantic wants text (e.g. a key)
        return f"{where}: a key or text is not valid Unicode, got {shown(err.get('input'))}", param
    if detail.startswith("Value error, "):  # our validators' messages name the field and value
        detail = detail[len("Value error, "):]
        return (detail if detail.startswith(param) else f"{param}: {detail}"), param
    if "input" in err and kind != "missing":
        detail += f", got {shown(err['input'])}"
    return f"{where}: {detail}", param


def registration_refusal(msg: Register, ident: bytes, *, mode: str, model: str,
                         tokenizer: str) -> str:
    """Why the instance of ``msg`` (from ZMQ identity ``ident``) cannot register with this router
    ('' when it can): protocol version, a malformed Register, tokenizer, or role."""
    if msg.version != PROTOCOL_VERSION:
        return (f"it speaks protocol version {msg.version}, the router {PROTOCOL_VERSION}; "
                f"run the same kvflow version on both")
    if msg.role not in ("prefill", "decode", "colocated") or msg.instance_id != ident.decode():
        return f"malformed Register (instance_id {msg.instance_id!r}, role {msg.role!r})"
    if tokenizer and msg.tokenizer and msg.tokenizer != tokenizer:
        return (f"its --model {msg.model} has another tokenizer ({msg.tokenizer}) than the "
                f"router's --model {model} ({tokenizer}): prompts and tokens would be "
                f"read with the wrong vocabulary; start the router with --model {msg.model}")
    fits = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    if msg.role not in fits:
        return (f"--role {msg.role} does not fit a router in --mode {mode}; start the "
                f"instance with --role {' or --role '.join(fits)}, or the router with "
                f"--mode {'disagg' if mode == 'colocated' else 'colocated'}")
    return ""
