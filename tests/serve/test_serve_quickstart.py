"""docs/tutorials/quickstart.md works as written: its server command starts a server (on a free
port instead of 8000), and its curl commands and openai-client snippet get the answers the
page describes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess


from tests.serve_server import Server

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tutorials", "quickstart.md")


def blocks(lang: str) -> list[str]:
    text = open(DOC, encoding="utf-8").read()
    return [b.strip() for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]


def test_quickstart_commands(monkeypatch):
    bash = blocks("bash")
    assert bash[0] == "python -m kvflow.serve --port 8000"
    srv = Server()  # the doc command on a free port (plus small-cache flags)
    try:
        srv.wait_healthy()
        port = str(srv.port)

        def run(cmd: str) -> str:
            cmd = cmd.replace("8000", port)
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60,
                                  check=True).stdout

        health, complete, stream, metrics = (run(c) for c in bash[1:5])
        assert json.loads(health)["status"] == "ok"
        body = json.loads(complete)
        assert body["usage"] == {"prompt_tokens": 25, "completion_tokens": 8, "total_tokens": 33}
        kv = body["kvflow"]
        assert kv["kv_connector"] == "ipc-pull" and kv["blocks"] == 2 and kv["payload_bytes"] == 2 * 32768
        events = [ln for ln in stream.splitlines() if ln]
        assert len(events) == 5 and events[-1] == "data: [DONE]"
        assert "kvflow_ttft_seconds_count" in metrics and "kvflow_free_blocks{" in metrics

        (snippet,) = blocks("python")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(snippet.replace("8000", port), {})
        printed = out.getvalue().splitlines()
        kv = eval(printed[-1], {})  # the printed kvflow dict
        assert kv["blocks"] == 2 and kv["decode_instance"].startswith("d-")
    finally:
        assert srv.stop() == 0
