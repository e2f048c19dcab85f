"""The router: an OpenAI-compatible HTTP front (FastAPI) over the ZMQ control plane.

One request (disaggregated): tokenize -> check it fits ``max_model_len`` (else HTTP 400, nothing
moved) -> ``Allocate`` to D (D's own block ids back; "busy" is retried until
``admit_timeout_s``, "capacity" is HTTP 400) -> ``Prefill`` to P with D's ids -> tokens from D,
streamed as server-sent events or gathered into one response. Whatever ends the request early
(error, timeout, client disconnect, a dead instance) sends ``Abort`` to P and D so both free
the request's blocks.

Reliability (docs/reliability.md): D out of free blocks answers "busy" and the router retries
every 50 ms for at most ``admit_timeout_s`` (``--admit-timeout-s``), then HTTP 503 — a bounded
wait, never a deadlock; a prompt that can never fit is HTTP 400 before anything moves. A
client that disconnects (also before the first token) aborts its request. With ``--api-key``,
``/v1/*`` needs ``Authorization: Bearer <key>`` (compared with :func:`hmac.compare_digest`),
else HTTP 401; ``/health`` and ``/metrics`` stay open.

Endpoints: ``GET /health`` (200 once P and D are registered and paired, else 503; JSON with
every instance's free blocks), ``GET /v1/models``, ``POST /v1/completions``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.protocol import Abort, Allocate, Allocated, Prefill, Rejected, Tokens

from .api import (CompletionRequest, clipped, completion_chunk, completion_response, error_body,
                  shown, usage, usage_chunk)
from .control import Controller, ReqState
from .metrics import Metrics

log = logging.getLogger("kvflow.serve.router")


class RequestError(Exception):
    """Ends a request with an HTTP status and message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` without loading its weights."""
    from kvflow.model import PRESETS, ByteTokenizer, HFTokenizer
    return ByteTokenizer() if model in PRESETS else HFTokenizer(model)


class Router:
    """Runs requests over a :class:`Controller`."""

    admit_timeout_s = 30.0      # retry "busy" (no free blocks now) this long
    reply_timeout_s = 5.0       # an instance answers a control message within this
    first_token_timeout_s = 120.0
    token_timeout_s = 60.0

    def __init__(self, controller: Controller, tokenizer: Any, model_name: str, metrics: Metrics,
                 *, admit_timeout_s: float | None = None, api_key: str | None = None) -> None:
        self.ctl, self.tokenizer, self.model_name, self.metrics = controller, tokenizer, model_name, metrics
        self.created = int(time.time())  # /v1/models "created": when this router started
        if admit_timeout_s is not None:
            self.admit_timeout_s = admit_timeout_s
        self.api_key = api_key.encode() if api_key else None

    def authorized(self, header: str | None) -> bool:
        """True without an API key, else when ``header`` is ``Bearer <key>`` (constant time)."""
        if self.api_key is None:
            return True
        given = (header or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, b"Bearer " + self.api_key)

    def tokenize(self, body: CompletionRequest) -> list[int]:
        if body.model is not None and body.model != self.model_name:  # vLLM answers 404 too
            raise RequestError(404, f"The model {shown(body.model)} does not exist; this server "
                                    f"serves {shown(self.model_name)}.", "model")
        if isinstance(body.prompt, str):
            try:
                return self.tokenizer.encode(body.prompt)
            except UnicodeError as exc:  # e.g. a lone surrogate "\ud800" in the JSON string
                raise RequestError(400, f"prompt is not valid Unicode text: {exc.reason} at "
                                        f"character {exc.start}", "prompt") from None
        vocab = self.tokenizer.vocab_size
        bad = [t for t in body.prompt if t >= vocab]
        if bad:
            raise RequestError(400, f"prompt holds token id {shown(bad[0])}, not in [0, {vocab})",
                               "prompt")
        return list(body.prompt)

    async def _wait(self, st: ReqState, timeout: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(st.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestError(504, f"timed out after {timeout:.0f} s waiting for {what}") from None

    async def run(self, body: CompletionRequest, token_ids: list[int]) -> AsyncIterator[Tokens]:
        """Yield the :class:`Tokens` messages of one request; raise :class:`RequestError`."""
        pair = self.ctl.pick()
        if pair is None:
            raise RequestError(503, "no prefill/decode pair is ready (see GET /health)")
        p, d = pair
        limit = d.reg.max_model_len
        if len(token_ids) + body.max_tokens > limit:
            # The prompt alone leaving no room for one new token is the prompt's fault.
            raise RequestError(400, f"prompt ({len(token_ids)} tokens) + max_tokens "
                                    f"({body.max_tokens}) = {len(token_ids) + body.max_tokens} "
                                    f"exceeds max_model_len={limit}",
                               "prompt" if len(token_ids) >= limit else "max_tokens")
        req_id = f"cmpl-{uuid.uuid4().hex}"
        seed = body.seed if body.seed is not None else secrets.randbelow(1 << 62)  # as vLLM
        st = ReqState(asyncio.Queue(), decode_id=d.id)
        self.ctl.requests[req_id] = st
        done, outcome = False, "error"  # outcome None: a 4xx, not counted
        try:
            deadline = time.monotonic() + self.admit_timeout_s
            while True:
                await self.ctl.send(d, Allocate(req_id=req_id, token_ids=token_ids,
                                                max_tokens=body.max_tokens,
                                                temperature=body.temperature, seed=seed,
                                                ignore_eos=body.ignore_eos))
                msg = await self._wait(st, self.reply_timeout_s, f"decode instance {d.id} to allocate")
                if isinstance(msg, Allocated):
                    break
                if isinstance(msg, Rejected) and msg.kind == "busy" and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    continue
                raise self._error(msg)
            st.prefill_id, st.stage = p.id, "prefilling"
            await self.ctl.send(p, Prefill(req_id=req_id, token_ids=token_ids,
                                           temperature=body.temperature, seed=seed,
                                           decode_id=d.id, decode_block_ids=msg.block_ids,
                                           num_cached_blocks=msg.num_cached_blocks))
            timeout, what = self.first_token_timeout_s, "the first token"
            while True:
                msg = await self._wait(st, timeout, what)
                if not isinstance(msg, Tokens) or msg.error:
                    raise self._error(msg)
                st.stage, timeout, what = "decoding", self.token_timeout_s, "the next token"
                done = msg.finished
                yield msg
                if done:
                    return
        except (GeneratorExit, asyncio.CancelledError):  # the HTTP side gave up: client gone
            outcome = "aborted"
            raise
        except RequestError as exc:  # a 4xx (D refused the prompt's size) is the client's, not ours
            outcome = "error" if exc.status >= 500 else None
            raise
        finally:
            self.ctl.requests.pop(req_id, None)
            if not done:
                if outcome is not None:
                    self.metrics.requests.labels(outcome).inc()
                ids = {st.prefill_id, st.decode_id} - {""}
                dead = sorted(i for i in ids if i not in self.ctl.instances)
                for inst_id in ids - set(dead):
                    asyncio.ensure_future(self.ctl.send(self.ctl.instances[inst_id], Abort(
                        req_id=req_id, reason="router ended the request",
                        peer_dead=dead[0] if dead else "", prefill_sent=bool(st.prefill_id),
                        prefill_id=st.prefill_id,
                        peer_exited=bool(dead) and dead[0] in getattr(self.ctl, "exited", ()))))
            else:
                self.metrics.requests.labels("ok").inc()

    @staticmethod
    def _error(msg: Any) -> RequestError:
        if isinstance(msg, Rejected):
            return RequestError(400 if msg.kind == "capacity" else 503 if msg.kind == "busy" else 500,
                                msg.error, (msg.param or "prompt") if msg.kind == "capacity" else None)
        if isinstance(msg, Tokens):
            return RequestError(502, msg.error)
        return RequestError(500, f"unexpected reply {type(msg).__name__}")


def create_app(router: Router) -> FastAPI:
    """The FastAPI app of ``router`` (its controller must be started by the caller)."""
    app = FastAPI(title="kvflow router")
    ctl, metrics = router.ctl, router.metrics

    # A pure ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware
    # hides the client's http.disconnect from request.is_disconnected(), so a non-streaming
    # client that went away would keep its request running (and its blocks held).
    app.add_middleware(_APIKeyMiddleware, router=router)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # OpenAI's error shape: a body that is not UTF-8 names the body; 404/405 the route
        if exc.status_code == 400:  # FastAPI could not read the body; the cause says why
            coding = request.headers.get("content-encoding", "identity")
            if coding != "identity":
                why = f"Content-Encoding: {clipped(coding)} is not supported; send the JSON as is"
            else:
                why = f"cannot be read as JSON: {exc.__cause__}" if exc.__cause__ else exc.detail
            return JSONResponse(error_body(f"body: {clipped(str(why), 200)}", "body"), status_code=400)
        return JSONResponse(error_body(f"{exc.detail}: {request.method} {clipped(request.url.path)}"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        msg, param = validation_message(errs, request.headers.get("content-type"))
        return JSONResponse(error_body(msg, param), status_code=400)

    @app.get("/health")
    async def health():
        return JSONResponse(ctl.health(), status_code=200 if ctl.ready() else 503)

    @app.get("/v1/models")
    async def models():
        lens = [i.reg.max_model_len for i in ctl.instances.values()]
        return {"object": "list", "data": [{"id": router.model_name, "object": "model",
                                            "created": router.created, "owned_by": "kvflow",
                                            "max_model_len": min(lens) if lens else None}]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.monotonic()
        try:
            token_ids = router.tokenize(body)
            events = router.run(body, token_ids)
            first = await _next_unless_gone(events, request)  # errors keep their status
        except RequestError as exc:
            return JSONResponse(error_body(exc.message, exc.param,
                                           "invalid_request_error" if exc.status < 500 else "server_error"),
                                status_code=exc.status)
        ttft = time.monotonic() - t0
        metrics.ttft.observe(ttft)
        metrics.observe_transfer(first.kvflow)
        kv = dict(first.kvflow)
        kv.pop("block_table", None)
        kv["ttft_ms"] = round(ttft * 1e3, 3)

        def finish(ids: list[int]) -> None:
            if len(ids) > 1:
                metrics.tpot.observe((time.monotonic() - t0 - ttft) / (len(ids) - 1))

        if not body.stream:
            ids, msg = list(first.token_ids), first
            try:
                while not msg.finished:
                    msg = await _next_unless_gone(events, request)
                    ids += msg.token_ids
            except RequestError as exc:
                return JSONResponse(error_body(exc.message, exc.param, "server_error"), status_code=exc.status)
            finally:
                await events.aclose()
            finish(ids)
            return completion_response(f"cmpl-{uuid.uuid4().hex[:24]}", router.model_name,
                                       router.tokenizer.decode(ids), ids, msg.finish_reason,
                                       len(token_ids), kv)

        opts = body.stream_options
        with_usage = opts is not None and bool(opts.include_usage)
        every_chunk = with_usage and bool(opts.continuous_usage_stats)  # vLLM's option

        async def sse() -> AsyncIterator[str]:
            ids, sent, msg, rid = [], "", first, f"cmpl-{uuid.uuid4().hex[:24]}"
            try:
                while True:
                    ids += msg.token_ids
                    text = router.tokenizer.decode(ids)
                    if msg.finished or not text.endswith("\ufffd"):  # hold back a partial character
                        delta, sent = text[len(sent):], text
                    else:
                        delta = ""
                    chunk = completion_chunk(rid, router.model_name, delta, msg.token_ids,
                                             msg.finish_reason or None if msg.finished else None,
                                             kv if msg.finished else None)
                    if every_chunk:
                        chunk["usage"] = usage(len(token_ids), len(ids))
                    yield "data: " + json.dumps(chunk) + "\n\n"
                    if msg.finished:
                        break
                    msg = await events.__anext__()
                finish(ids)
                if with_usage:
                    yield "data: " + json.dumps(usage_chunk(rid, router.model_name, len(token_ids),
                                                            len(ids))) + "\n\n"
            except RequestError as exc:
                yield "data: " + json.dumps(error_body(exc.message, exc.param, "server_error")) + "\n\n"
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def validation_message(errs: list[dict], content_type: str | None) -> tuple[str, str]:
    """(message, param) for the pydantic errors ``errs`` of a request body (the first one is
    reported): the field, what is wrong and the value sent (``max_tokens: Input should be
    greater than or equal to 1, got -1``, values cut to 80 characters); a body that is not
    JSON says where, or which Content-Type came instead."""
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


class _APIKeyMiddleware:
    """HTTP 401 for ``/v1/*`` without the router's API key (``Router.authorized``)."""

    def __init__(self, app: Any, router: Router) -> None:
        self.app, self.router = app, router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                           if k.lower() == b"authorization"), None)
            if not self.router.authorized(header):
                resp = JSONResponse(error_body("missing or wrong API key: send the header "
                                               "'Authorization: Bearer <key>'", "authorization",
                                               "authentication_error"), status_code=401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _next_unless_gone(events: AsyncIterator[Tokens], request: Request) -> Tokens:
    """The next message of ``events``; if the HTTP client disconnects first, close ``events``
    (which aborts the request on P and D) and raise RequestError 499."""
    task = asyncio.ensure_future(events.__anext__())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        # Check the client at least every 0.1 s even while tokens keep coming (a fast decode
        # would otherwise never leave time to notice a non-streaming client that went away).
        now = time.monotonic()
        if done and now - getattr(request.state, "kvflow_checked", 0.0) < 0.1:
            return task.result()
        request.state.kvflow_checked = now
        if not await request.is_disconnected():
            if done:
                return task.result()
            continue
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, RequestError, StopAsyncIteration):
            pass
        await events.aclose()
        raise RequestError(499, "client disconnected")
