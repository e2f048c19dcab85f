"""An OpenAI ``/v1/completions`` proxy in front of one vLLM P and one vLLM D:
``python -m kvflow.integrations.vllm.proxy --prefill URL --decode URL --port 8100``. P gets the
prompt with ``max_tokens=1`` and a remote decode, D the client's request plus P's
``kv_transfer_params``; errors come back with their status code. docs/tutorials/vllm.md."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets: the client's request, one token, no stream, a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "min_tokens" in out:
        out["min_tokens"] = min(out["min_tokens"], 1)
    return out


def _json(content: bytes, status: int) -> Response:
    return Response(content, status_code=status, media_type="application/json")


def make_app(prefill: str, decode: str, timeout_s: float = 300.0) -> FastAPI:
    """The proxy app for a P at ``prefill`` and a D at ``decode`` (base URLs); ``timeout_s``
    bounds each call to P or D (seconds)."""
    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="kvflow vLLM proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill, decode):
            try:
                r = await client.get(f"{url}/health")
                if r.status_code != 200:
                    return JSONResponse({"error": f"{url}: {r.status_code}"}, status_code=503)
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"{url}: {exc}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        p = await client.post(f"{prefill}/v1/completions", json=prefill_body(body))
        if p.status_code != 200:
            return _json(p.content, p.status_code)
        d_body = dict(body, kv_transfer_params=p.json().get("kv_transfer_params"))
        if not body.get("stream"):
            d = await client.post(f"{decode}/v1/completions", json=d_body)
            return _json(d.content, d.status_code)
        d = await client.send(client.build_request("POST", f"{decode}/v1/completions",
                                                   json=d_body), stream=True)
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            return _json(content, d.status_code)

        async def relay():
            try:
                async for chunk in d.aiter_raw():
                    yield chunk
            finally:
                await d.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="OpenAI proxy in front of a vLLM P and D "
                                             "running KvflowConnector")
    ap.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8101")
    ap.add_argument("--decode", required=True, help="D's base URL, e.g. http://127.0.0.1:8102")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    a = ap.parse_args(argv)
    import uvicorn
    uvicorn.run(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host, port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
