"""A stop of ``python -m kvflow.serve`` with requests running ends each of them before the
teardown (docs/reliability.md, "Stop"): a non-streaming one gets HTTP 503 in OpenAI's error
shape, a stream the router's error event then ``data: [DONE]``, a new request 503, and the
Aborts of the running ones are sent before the control socket closes (no "cannot send Abort").
Waits are bounded generously and the outcome is asserted, not the speed: 2 shared cores."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvflow.model import ByteTokenizer
from kvflow.serve.router.app import create_app
from kvflow.serve.router.metrics import Metrics
from kvflow.serve.router.router import Router
from tests.serve.test_router_outcomes import ScriptedController
from tests.serve.test_serve_stop import _stop_and_check
from tests.serve_server import Server

pytestmark = pytest.mark.timeout(420)

STOPPED = {"error": {"message": "the server is stopping", "type": "server_error", "param": None,
                     "code": None}}
LONG = {"prompt": "tell me a long story", "max_tokens": 3900, "ignore_eos": True}  # minutes on CPU


def _post(url: str, out: dict) -> None:
    """A long non-streaming completion; ``out`` gets its status and body (or the exception)."""
    try:
        r = httpx.post(url + "/v1/completions", json=LONG, timeout=120)
        out.update(status=r.status_code, body=r.text)
    except Exception as exc:
        out.update(status=None, body=f"{type(exc).__name__}: {exc}")


def _stream(url: str, first: threading.Event, lines: list[str]) -> None:
    """A long streamed completion; ``first`` is set at its first event; ``lines`` gets every
    ``data:`` line until the server ends the stream."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=dict(LONG, stream=True),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first.set()
    except Exception as exc:
        lines.append(f"ended: {type(exc).__name__}: {exc}")
    finally:
        first.set()


def _running(srv: Server) -> int:
    """Requests decoding on D, from its last heartbeat."""
    return srv.instance("decode")["num_running"]


def test_a_stop_ends_running_requests_with_503_and_sends_their_aborts_first():
    srv = Server("--max-model-len", "4096")
    try:
        srv.wait_healthy()
        posted, lines, first = {}, [], threading.Event()
        clients = [threading.Thread(target=_post, args=(srv.url, posted)),
                   threading.Thread(target=_stream, args=(srv.url, first, lines))]
        for t in clients:
            t.start()
        assert first.wait(60), srv.output()
        deadline = time.monotonic() + 30
        while _running(srv) < 2 and time.monotonic() < deadline:  # both are decoding
            time.sleep(0.1)
        assert _running(srv) == 2 and not posted, (srv.health(), posted)
        _stop_and_check(srv, within_s=60)
        for t in clients:
            t.join(30)
            assert not t.is_alive()
        out = srv.output()
        assert posted["status"] == 503, (posted, out)
        assert json.loads(posted["body"]) == STOPPED, posted
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][len("data: "):]) == STOPPED, lines[-3:]
        assert all(json.loads(ln[len("data: "):])["object"] == "text_completion"
                   for ln in lines[:-2]), lines[:3]
        assert "cannot send" not in out and "non-socket" not in out, out
        assert "timeout graceful shutdown exceeded" not in out, out
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_a_request_after_the_stop_began_is_refused_with_503():
    router = Router(ScriptedController("busy"), ByteTokenizer(), "kvflow-tiny", Metrics())
    with TestClient(create_app(router)) as c:
        router.stop()
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": stream})
            assert (r.status_code, r.json()) == (503, STOPPED)
    assert router.ended
    assert router.ctl.sent == []  # no instance heard of them
