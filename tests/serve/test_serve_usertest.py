"""Bugs found by a new-user test of `python -m kvflow.serve`: a non-streaming client that
disconnects aborts its request (B1), a child that dies before registering stops the server
(B2), strict request types (B3), OpenAI's other completion fields (B4); from a second one, B5: null means the default,
messages give the value sent, stream_options.include_usage, a fresh seed per request, route
and Content-Type errors, client disconnects counted as "aborted". One server for the module
(P + D over ipc, kvflow-tiny, max_model_len 2048)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from kvflow.bench.ports import free_port

from tests.serve_server import Server, pid_alive


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
    """B2: a child that exits before registering (a --backend that cannot run on the CPU) makes
    the server exit 1 promptly with one line naming the child, its exit code and its error; no
    child is left running (issue 14: one line, no traceback)."""
    cmd = [sys.executable, "-m", "kvflow.serve", "--port", str(free_port()), "--backend", "numba_cuda",
           "--memory-budget-mb", "32", "--max-num-batched-tokens", "64"]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"server still running after 45 s:\n{exc.stdout}\n{exc.stderr}")
    took = time.monotonic() - t0
    assert out.returncode == 1 and took < 30, (took, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert re.fullmatch(r"kvflow.serve: error: the (prefill|decode) instance \(pid \d+\) exited with "
                        r"code 1 before registering: --backend numba_cuda: backend='numba_cuda' (is "
                        r"unavailable|runs on \['cuda'\], not on cpu).*; use --backend auto or one available here \(.*torch.*\)\n",
                        out.stderr), out.stderr
    pids = [int(p) for p in re.findall(r"pid (\d+)", out.stdout)]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids), out.stdout


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
    ({"prompt": "hi", "stream_options": {"foo": 1}}, "stream_options", "Extra inputs"),
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
                "n": 1, "model": "kvflow-tiny"}
    for extra in (nulls, defaults):
        r = server.complete(prompt="hi", max_tokens=2, temperature=0, **extra)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) <= 2
    r = server.complete(prompt=[256, 65, 66], max_tokens=2, temperature=1, seed=3, stream=False,
                        ignore_eos=True)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text


def _error(r) -> tuple[int, str, str]:
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    return r.status_code, err["param"], err["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens",
     "max_tokens: Input should be greater than or equal to 1, got -1"),
    ({"prompt": "hi", "max_tokens": "8"}, "max_tokens", 'max_tokens: Input should be a valid integer, got "8"'),
    ({"prompt": "hi", "n": 2}, "n", "n: Input should be less than or equal to 1, got 2"),
    ({"prompt": [1, -2, 3]}, "prompt", "prompt holds token id -2; token ids must be >= 0"),
    ({"prompt": [1, 258]}, "prompt", "prompt holds token id 258, not in [0, 258)"),
    ({"prompt": "hi", "stop": [1]}, "stop", "stop=[1] is not supported: kvflow stops only at the "
                                            "end-of-sequence token or max_tokens; omit stop"),
    ({"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias",
     'logit_bias={"1": 5} is not supported: kvflow applies no logit bias; omit logit_bias'),
    ({"prompt": "hi", "suffix": "s" * 10**5}, "suffix",
     'suffix="' + "s" * 76 + '... is not supported: kvflow does not insert text; omit suffix'),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed with stream=true, got stream=false"),
    ({"prompt": "hi", "max_tokens": 10**100}, "max_tokens",
     f"max_tokens: Input should be less than 2147483648, got {str(10**100)[:77]}..."),
    ({"prompt": [10**100]}, "prompt", f"prompt holds token id {str(10**100)[:77]}..., not in [0, 258)"),
    ({"prompt": "hi", "seed": 2**63}, "seed", f"seed: Input should be less than {2**63}, got {2**63}"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options",
     "stream_options.include_usage: Input should be a valid boolean, got 1"),
    ([1], "body", "body: Input should be a valid dictionary or object to extract fields from, got [1]"),
])
def test_messages_name_the_field_and_the_value_sent(server, body, param, message):
    """B5: every 400 names the field and the value that was sent."""
    assert _error(server.client.post("/v1/completions", json=body)) == (400, param, message)


def test_nan_temperature_and_bodies_that_are_not_json(server):
    """B5: NaN is "not finite" (not "<= 100"); a bad body says where or which Content-Type came."""
    post = server.client.post
    r = post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}',
             headers={"Content-Type": "application/json"})
    assert _error(r) == (400, "temperature", "temperature: Input should be a finite number, got NaN")
    r = post("/v1/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    assert _error(r) == (400, "body", "body: not valid JSON at character 16: Expecting property "
                                      "name enclosed in double quotes")
    r = post("/v1/completions", content=b"", headers={"Content-Type": "application/json"})
    assert _error(r) == (400, "body", "body: the request has no body; send a JSON object")
    for ctype in ("text/plain", "text/json"):
        r = post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": ctype})
        assert _error(r) == (400, "body", "body: send a JSON object with Content-Type: "
                                          f"application/json (got Content-Type: {ctype})")
    r = post("/v1/completions", content='{"prompt": "café"}'.encode("latin-1"),
             headers={"Content-Type": "application/json"})
    assert _error(r) == (400, "body", "body: cannot be read as JSON: 'utf-8' codec can't decode "
                                      "byte 0xe9 in position 15: invalid continuation byte")
    r = post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/" + "x" * 5000})
    assert _error(r) == (400, "body", "body: send a JSON object with Content-Type: application/json "
                                      f"(got Content-Type: text/{'x' * 72}...)")
    import gzip
    r = post("/v1/completions", content=gzip.compress(b'{"prompt": "hi"}'),
             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert _error(r) == (400, "body", "body: Content-Encoding: gzip is not supported; send the JSON as is")
    r = post("/v1/completions", content=b'{"prompt": "hi"}',  # labelled gzip, bytes plain JSON
             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert _error(r) == (400, "body", "body: Content-Encoding: gzip is not supported; send the JSON as is")
    r = post("/v1/completions", content=b'{"prompt": "hi", "\\ud800": 1}',
             headers={"Content-Type": "application/json"})
    assert _error(r) == (400, "body", 'body: a key or text is not valid Unicode, got "\\ud800"')
    deep = b'{"prompt": ' + b"[" * 960 + b"]" * 960 + b"}"   # json parses it; our message must not
    r = post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert _error(r)[:2] == (400, "prompt")


def test_route_errors_name_the_route_not_the_body(server):
    """B5: 404 and 405 say which method and path, in OpenAI's error shape."""
    r = server.client.get("/v1/completions")
    assert _error(r) == (405, None, "Method Not Allowed: GET /v1/completions")
    assert r.headers["allow"] == "POST"
    r = server.client.post("/v1/chat/completions", json={"messages": []})
    assert _error(r) == (404, None, "Not Found: POST /v1/chat/completions")
    r = server.client.get("/" + "x" * 5000)
    assert _error(r) == (404, None, f"Not Found: GET /{'x' * 76}...")
    models = server.client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["kvflow-tiny"] and 0 < time.time() - models[0]["created"] < 3600


def test_null_means_the_default(server):
    """B5: as OpenAI's API, null for max_tokens, temperature, stream, seed, n, ignore_eos is the
    default (16 greedy tokens, not streamed); stop=[""] is a no-op like stop=""."""
    base = server.complete(prompt="Null is the default", ignore_eos=True).json()
    nulls = server.complete(prompt="Null is the default", max_tokens=None, temperature=None,
                            stream=None, seed=None, n=None, ignore_eos=True, stop=[""]).json()
    assert len(base["choices"][0]["token_ids"]) == 16
    assert nulls["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]


def test_tiny_temperature_is_greedy_and_any_int64_seed_works(server):
    """B5: temperature under 1e-5 is greedy as in vLLM (1e-39 used to overflow to NaN: HTTP
    500); seeds may be negative, as vLLM's."""
    body = dict(prompt="Greedy at heart", max_tokens=6, ignore_eos=True)
    greedy = server.complete(**body).json()["choices"][0]["token_ids"]
    for t in (1e-39, 5e-324, 9e-6):
        r = server.complete(**body, temperature=t)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy, (t, r.text)
    for seed in (-1, -2**63, 2**63 - 1):
        r = server.complete(**body, temperature=1.0, seed=seed)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6


def test_sampling_without_a_seed_draws_a_fresh_one(server):
    """B5: as vLLM, temperature > 0 without a seed differs between requests; with a seed it
    repeats."""
    body = dict(prompt="Sample me", max_tokens=12, temperature=1.0, ignore_eos=True)
    fresh = {tuple(server.complete(**body).json()["choices"][0]["token_ids"]) for _ in range(3)}
    assert len(fresh) == 3
    seeded = {tuple(server.complete(**body, seed=11).json()["choices"][0]["token_ids"]) for _ in range(2)}
    assert len(seeded) == 1


def test_stream_include_usage_ends_with_a_usage_chunk(server):
    """B5: stream_options.include_usage adds one chunk with no choices and the token counts
    just before [DONE] (as OpenAI and vLLM); without it no chunk has usage."""
    def events(**extra):
        with server.client.stream("POST", "/v1/completions", json=dict(
                prompt="count me", max_tokens=3, stream=True, ignore_eos=True, **extra)) as r:
            return [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    import json
    ev = events(stream_options={"include_usage": True})
    assert ev[-1] == "[DONE]"
    last = json.loads(ev[-2])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 9, "completion_tokens": 3,
                                                       "total_tokens": 12}
    assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in ev[:-2]) == 3
    plain = events()
    assert len(plain) == len(ev) - 1 and all("usage" not in json.loads(e) for e in plain[:-1])
    every = [json.loads(e) for e in events(stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True})[:-1]]
    assert [e["usage"]["completion_tokens"] for e in every] == [1, 2, 3, 3]  # vLLM's option


def test_client_disconnect_counts_as_aborted(server):
    """B5: /metrics counts a request whose client went away as outcome="aborted", not "error"."""
    count = server.requests_total
    before = count("aborted"), count("error")
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json={"prompt": "go away", "max_tokens": 1500, "ignore_eos": True})
    deadline = time.monotonic() + 4
    while count("aborted") == before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (count("aborted"), count("error")) == (before[0] + 1, before[1])
    total = server.total_blocks()
    assert server.wait_settled(total, idle=True) == {role: (n, 0) for role, n in total.items()}


def test_unknown_model_is_404_naming_the_served_one(server):
    """As vLLM: a request for a model the server does not serve is refused before any work."""
    r = server.complete(prompt="hi", max_tokens=2, model="nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": 'The model "nope" does not exist; this server serves '
                                             '"kvflow-tiny".', "type": "invalid_request_error",
                                  "param": "model", "code": None}}
    r = server.client.post("/v1/completions", content=b'{"prompt": "hi", "model": "\\ud800"}',
                           headers={"Content-Type": "application/json"})  # a lone surrogate: no 500
    assert _error(r) == (404, "model", 'The model "\\ud800" does not exist; this server serves '
                                       '"kvflow-tiny".')


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
