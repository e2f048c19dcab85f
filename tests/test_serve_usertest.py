"""Bugs found by a new-user test of `python -m kvflow.serve`: a non-streaming client that
disconnects aborts its request (B1), a child that dies before registering stops the server
(B2), strict request types (B3), OpenAI's other completion fields (B4). One server for the
module (P + D over ipc, kvflow-tiny, max_model_len 2048)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from .serve_server import Server, free_port


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-model-len", "2048", "--memory-budget-mb", "64")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_non_streaming_disconnect_aborts(server):
    """B1: curl -m 1 on a long non-streaming request frees P's and D's blocks at once."""
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2000,
                                            "ignore_eos": True})
    total = server.total_blocks()
    got = server.wait_settled(total, timeout=4.0, idle=True)   # 2000 tokens take ~25 s on 2 cores
    assert got == {role: (n, 0) for role, n in total.items()}, got


def test_child_dying_before_registering_stops_the_server():
    """B2: a child that exits before registering (bad --backend) makes the server exit non-zero
    promptly, naming the child, its exit code and its error; no child is left running."""
    cmd = [sys.executable, "-m", "kvflow.serve", "--port", str(free_port()), "--backend", "nonsense",
           "--memory-budget-mb", "32", "--max-num-batched-tokens", "64"]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"server still running after 45 s:\n{exc.stdout}\n{exc.stderr}")
    took = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert took < 30, (took, text)
    assert "exited with code 1 before registering" in text, text
    assert "backend='nonsense' is unknown" in text.split("before registering")[-1], text


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": [True, False]}, "prompt", "string or a list of token ids"),
    ({"prompt": {"text": "hi"}}, "prompt", "string or a list of token ids"),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens", "integer"),
    ({"prompt": "hi", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "hi", "temperature": True}, "temperature", "number"),
    ({"prompt": "hi", "seed": "1"}, "seed", "integer"),
    ({"prompt": "x" * 2100, "max_tokens": 1}, "prompt", "exceeds max_model_len=2048"),
    ({"prompt": "hi", "top_p": 0.9}, "top_p", "top_p=0.9 is not supported: kvflow samples from "
                                              "the full distribution; use top_p=1"),
    ({"prompt": "hi", "stop": ["\n"]}, "stop", "not supported"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs", "not supported"),
    ({"prompt": "hi", "echo": True}, "echo", "not supported"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "hi", "frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "hi", "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": "hi", "logit_bias": {"50": 10}}, "logit_bias", "not supported"),
    ({"prompt": "hi", "top_k": 5}, "top_k", "Extra inputs"),
])
def test_wrong_types_and_unsupported_values_are_400(server, body, field, words):
    """B3 (strict types, prompt errors) and B4 (OpenAI fields at values kvflow cannot honour)."""
    r = server.complete(**body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field) and words in err["message"], err


def test_openai_fields_at_no_op_values_and_valid_types_work(server):
    """B4: what the openai client sends (nulls, defaults) is accepted; ints are valid floats."""
    nulls = {k: None for k in ("top_p", "stop", "logprobs", "echo", "presence_penalty",
                               "frequency_penalty", "best_of", "suffix", "logit_bias",
                               "stream_options", "user")}
    defaults = {"top_p": 1, "stop": [], "echo": False, "presence_penalty": 0,
                "frequency_penalty": 0.0, "best_of": 1, "logit_bias": {}, "user": "me",
                "stream_options": {"include_usage": True}, "n": 1, "model": "kvflow-tiny"}
    for extra in (nulls, defaults):
        r = server.complete(prompt="hi", max_tokens=2, temperature=0, **extra)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) <= 2
    r = server.complete(prompt=[256, 65, 66], max_tokens=2, temperature=1, seed=3, stream=False,
                        ignore_eos=True)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text


def test_unknown_model_is_404_naming_the_served_one(server):
    """As vLLM: a request for a model the server does not serve is refused before any work."""
    r = server.complete(prompt="hi", max_tokens=2, model="nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `nope` does not exist; this server serves "
                                             "`kvflow-tiny`.", "type": "invalid_request_error",
                                  "param": "model", "code": None}}


@pytest.mark.parametrize("argv, want", [
    (["--num-blocks", "0"], "--num-blocks must be positive, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be positive, got -5"),
    (["--port", "70000"], "--port must be a port in 1..65535, got 70000"),
    (["--max-model-len", "5000"], "--max-model-len 5000 exceeds the model's max_position_embeddings=4096"),
])
def test_cli_errors_say_what_is_wrong(argv, want, capsys):
    """Cosmetic: the port hint only for --port; --max-model-len over the model's limit is an
    error rather than silently clamped."""
    from kvflow.serve.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert want in err and ("port" in want or "port" not in err.splitlines()[-1]), err
