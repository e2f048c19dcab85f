"""The router's HTTP app (FastAPI): ``/health``, ``/v1/models``, ``/metrics``, ``POST
/v1/completions`` (JSON or server-sent events), OpenAI's error shape, the API key, and the abort
of a request whose client disconnected (HTTP 499)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.serve.protocol import Tokens

from .api import (CompletionRequest, clipped, completion_chunk, completion_response, error_body,
                  usage, usage_chunk)
from .errors import RequestError, validation_message
from .router import Router


def create_app(router: Router) -> FastAPI:
    """The FastAPI app of ``router`` (its controller must be started by the caller)."""
    app = FastAPI(title="kvflow router")
    ctl, metrics = router.ctl, router.metrics
    # pure ASGI: Starlette's BaseHTTPMiddleware would hide a client's disconnect
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
            events = router.run(body, token_ids, t0)
            first = await _next_unless_gone(events, request)  # errors keep their status
        except RequestError as exc:
            return JSONResponse(error_body(exc.message, exc.param,
                                           "invalid_request_error" if exc.status < 500 else "server_error"),
                                status_code=exc.status)
        ttft = time.monotonic() - t0
        metrics.ttft.observe(ttft)

        def report(last: Tokens) -> dict:  # the response's kvflow object
            metrics.observe_transfer(last.kvflow)
            kv = dict(last.kvflow)
            kv.pop("block_table", None)
            kv["ttft_ms"] = round(ttft * 1e3, 3)
            return kv

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
                                       len(token_ids), report(msg))
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
                                             report(msg) if msg.finished else None)
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


class _APIKeyMiddleware:
    """HTTP 401 for ``/v1/*`` without the router's API key; HTTP 400 for a Content-Encoding."""

    def __init__(self, app: Any, router: Router) -> None:
        self.app, self.router = app, router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            headers = {k.lower(): v.decode("latin-1")  # the first of a name wins
                       for k, v in reversed(list(scope.get("headers", ())))}
            if not self.router.authorized(headers.get(b"authorization")):
                resp = JSONResponse(error_body("missing or wrong API key: send the header "
                                               "'Authorization: Bearer <key>'", "authorization",
                                               "authentication_error"), status_code=401)
                await resp(scope, receive, send)
                return
            coding = headers.get(b"content-encoding", "identity")
            if coding.strip().lower() not in ("identity", ""):
                why = f"Content-Encoding: {clipped(coding)} is not supported; send the JSON as is"
                await JSONResponse(error_body(f"body: {why}", "body"), status_code=400)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _next_unless_gone(events: AsyncIterator[Tokens], request: Request) -> Tokens:
    """The next message of ``events``; if the HTTP client disconnects first, close ``events``
    (which aborts the request on P and D) and raise RequestError 499."""
    task = asyncio.ensure_future(events.__anext__())
    while True:
        try:
            done, _ = await asyncio.wait({task}, timeout=0.1)
        except asyncio.CancelledError:  # the server is stopping: end the pending read first,
            await _cancel(task)  # so the caller's events.aclose() meets no running generator
            raise
        # check the client at least every 0.1 s, even while tokens keep coming
        now = time.monotonic()
        if done and now - getattr(request.state, "kvflow_checked", 0.0) < 0.1:
            return task.result()
        request.state.kvflow_checked = now
        if not await request.is_disconnected():
            if done:
                return task.result()
            continue
        await _cancel(task)
        await events.aclose()
        raise RequestError(499, "client disconnected")


async def _cancel(task: asyncio.Future) -> None:
    """Cancel a pending read of a request's events and wait until it has ended."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, RequestError, StopAsyncIteration):
        await task
