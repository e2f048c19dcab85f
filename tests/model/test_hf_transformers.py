"""kvflow against transformers' own forward on checkpoints transformers wrote (tests/hf_models.py):
every RoPE type Llama / Qwen2 checkpoints use, both config.json conventions (transformers >= 5
``rope_parameters``; 4.x top-level ``rope_theta`` + ``rope_scaling``), biases, tied embeddings,
an explicit head_dim. Last-token logits within 1e-4 (float32) and 32 greedy tokens identical,
on the colocated engine (chunked prefill, paged cache) and served disaggregated (ipc, tcp)."""

from __future__ import annotations

import pytest
import torch

from kvflow import PagedKVCache
from kvflow.engine import Engine, sample
from kvflow.model import ModelConfig, load_model
from kvflow.model.llama import rope_inv_freq

from tests.hf_models import CASES, PROMPTS, build, transformers_greedy
from tests.serve_server import Server

pytest.importorskip("transformers", reason="transformers is in the dev extra")

NEW_TOKENS = 32
# One server per KV connector, each serving a different checkpoint.
SERVED = {"ipc-pull": "llama-yarn-mscale-hd32", "tcp": "qwen2-v4-yarn"}


def kvflow_greedy(path, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """kvflow's logits of the last prompt token (prefill in chunks of 5 over scattered blocks)
    and ``n`` greedy tokens from batched decode."""
    model, _ = load_model(str(path))
    engine = Engine(model, PagedKVCache(model.kv_spec(4), 24))
    table = list(range(23, 23 - (len(ids) + n + 3) // 4, -1))
    logits = engine.prefill(ids, table, chunk_size=5)
    first, out = logits, []
    for _ in range(n):
        out.append(sample(logits, 0.0))
        logits = engine.decode([(out[-1], len(ids) + len(out) - 1, table)])[0]
    return first, out


ROPES = [
    {"rope_type": "default", "rope_theta": 100000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 2.0, "low_freq_factor": 0.5,
     "high_freq_factor": 3.0, "original_max_position_embeddings": 100},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096,
     "truncate": False, "beta_fast": 24.0, "beta_slow": 1.5},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 4096,
     "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": None, "original_max_position_embeddings": 1024,
     "attention_factor": 1.25},
]


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("i", range(len(ROPES)))
def test_rope_frequencies_equal_transformers_bit_for_bit(i, head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_hidden_layers=1,
                      vocab_size=8, intermediate_size=8, max_position_embeddings=131072,
                      rope_parameters=dict(ROPES[i]))
    ref = LlamaRotaryEmbedding(cfg)
    inv, scale = rope_inv_freq(ModelConfig.from_hf(cfg.to_dict()))
    assert torch.equal(inv, ref.inv_freq) and scale == ref.attention_scaling


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvflow_matches_transformers(tmp_path, case):
    build(tmp_path, case)
    _, tok = load_model(str(tmp_path))
    ids = tok.encode(PROMPTS[0])
    ref_logits, ref_tokens = transformers_greedy(tmp_path, ids, NEW_TOKENS)
    logits, tokens = kvflow_greedy(tmp_path, ids, NEW_TOKENS)
    diff = float((logits - ref_logits).abs().max())
    assert diff <= 1e-4, f"{case}: max |logit diff| {diff:.2e}"
    assert tokens == ref_tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{transfer: (server, checkpoint dir)}; both servers start at once."""
    out = {}
    try:
        for transfer, case in SERVED.items():
            path = tmp_path_factory.mktemp(case)
            build(path, case)
            out[transfer] = (Server("--model", str(path), "--kv-connector", transfer,
                                    "--block-size", "4", "--max-model-len", "128"), path)
        for srv, _ in out.values():
            srv.wait_healthy()
        yield out
    finally:
        for srv, _ in out.values():
            srv.stop()


@pytest.mark.parametrize("transfer", sorted(SERVED))
def test_served_disagg_matches_transformers(served, transfer):
    srv, path = served[transfer]
    _, tok = load_model(str(path))
    start = srv.total_blocks()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        _, want = transformers_greedy(path, ids, NEW_TOKENS)
        r = srv.complete(prompt=ids, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want, prompt
    assert srv.wait_free_blocks(start) == start
