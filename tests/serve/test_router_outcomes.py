"""The router's request outcomes in /metrics, in process with a scripted controller: a
request a decode instance refuses for capacity is HTTP 400 naming the prompt (when it alone
cannot fit) or max_tokens, and counted nowhere (like every other 4xx); one it refuses with an
error counts as "error"; every outcome series exists from the start at 0."""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

from kvflow.model import ByteTokenizer
from kvflow.serve.protocol import Allocate, Rejected
from kvflow.blocks.request import AdmissionError, admission_check
from kvflow.serve.router.metrics import Metrics
from kvflow.serve.router.app import create_app
from kvflow.serve.router.router import Router


class ScriptedController:
    """What Router.run needs of a Controller: one P/D pair whose D answers every Allocate
    with ``Rejected(kind)``."""

    def __init__(self, kind: str) -> None:
        self.kind, self.requests, self.sent = kind, {}, []
        inst = lambda i: types.SimpleNamespace(id=i, reg=types.SimpleNamespace(  # noqa: E731
            max_model_len=512, num_blocks=8, spec={"block_size": 16}))
        self.p, self.d = inst("p-1"), inst("d-1")
        self.instances = {"p-1": self.p, "d-1": self.d}

    def pick(self):
        return self.p, self.d

    async def send(self, inst, msg) -> None:
        self.sent.append(type(msg).__name__)
        if isinstance(msg, Allocate):
            param = ""
            if self.kind == "capacity":  # the field D's admission check blames
                try:
                    admission_check(len(msg.token_ids), msg.max_tokens, max_model_len=10**6,
                                    num_blocks=8, block_size=16)
                except AdmissionError as exc:
                    param = exc.param
            self.requests[msg.req_id].queue.put_nowait(Rejected(
                req_id=msg.req_id, kind=self.kind, error=f"refused: {self.kind}", param=param))

    def ready(self) -> bool:
        return True

    def health(self) -> dict:
        return {"status": "ok", "instances": []}


def _outcomes(text: str) -> dict[str, float]:
    return {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines()
            if ln.startswith("kvflow_requests_total{")}


@pytest.mark.parametrize("kind, prompt, status, param, counted", [
    ("capacity", "x" * 125, 400, "max_tokens", {}),      # 8 blocks with <bos>: the prompt fits
    ("capacity", "y" * 200, 400, "prompt", {}),           # 13 blocks > D's 8
    ("error", "hi", 500, None, {"error": 1.0})])
def test_refusals_by_d_and_their_outcome(kind, prompt, status, param, counted):
    ctl = ScriptedController(kind)
    metrics = Metrics()
    with TestClient(create_app(Router(ctl, ByteTokenizer(), "kvflow-tiny", metrics))) as c:
        assert _outcomes(c.get("/metrics").text) == {"ok": 0.0, "error": 0.0, "aborted": 0.0}
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == status and r.json()["error"]["message"] == f"refused: {kind}"
        assert r.json()["error"]["param"] == param
        assert _outcomes(c.get("/metrics").text) == dict({"ok": 0.0, "error": 0.0, "aborted": 0.0},
                                                         **counted)
    assert ctl.sent[0] == "Allocate" and "Prefill" not in ctl.sent  # P never heard of it
