"""A small OpenAI ``/v1/completions`` proxy in front of one vLLM producer (P) and one vLLM
consumer (D) that run :class:`~kvflow.integrations.vllm.KvflowConnector` (or vLLM's own
NixlConnector, whose transfer params it passes on just the same: bench/vllm/pd.py).

``python -m kvflow.integrations.vllm.proxy --prefill http://127.0.0.1:8101 --decode
http://127.0.0.1:8102 --port 8100``

Per request: POST to P with ``max_tokens=1``, ``stream=False`` and
``kv_transfer_params={"do_remote_decode": true}``; P's response carries the transfer params
(where its blocks are); POST the client's request unchanged to D with those params and stream or
return D's answer. A client that disconnects mid-stream closes the D stream (vLLM aborts the
request there); P's held blocks are freed when D pulls or releases them, or when P's lease ends.
Errors of P or D are returned with their status code. FastAPI + httpx; binds 127.0.0.1 by default.
"""

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


def make_app(prefill: str, decode: str, timeout_s: float = 300.0) -> FastAPI:
    """The proxy app for a P at ``prefill`` and a D at ``decode`` (base URLs)."""
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
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"{url}: {exc}"}, status_code=503)
            if r.status_code != 200:
                return JSONResponse({"error": f"{url}: {r.status_code}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        p = await client.post(f"{prefill}/v1/completions", json=prefill_body(body))
        if p.status_code != 200:
            return Response(p.content, status_code=p.status_code, media_type="application/json")
        params = p.json().get("kv_transfer_params")
        d_body = dict(body, kv_transfer_params=params)
        if not body.get("stream"):
            d = await client.post(f"{decode}/v1/completions", json=d_body)
            return Response(d.content, status_code=d.status_code, media_type="application/json")
        req = client.build_request("POST", f"{decode}/v1/completions", json=d_body)
        d = await client.send(req, stream=True)
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            return Response(content, status_code=d.status_code, media_type="application/json")

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
