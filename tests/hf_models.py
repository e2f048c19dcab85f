"""Tiny random Llama / Qwen2 checkpoints written by transformers' own ``save_pretrained``
(safetensors + the config.json transformers writes), and transformers' greedy output on them:
the reference a kvflow model path must match (docs/tutorials/real_model.md)."""

from __future__ import annotations

import json

import torch

from tests.model.test_hf_checkpoint import build_tokenizer

H, L, NH, NKV, FF, MAXPOS = 64, 2, 4, 2, 96, 128

# name -> config.json fields on top of the shared sizes. "v4" rewrites config.json the way
# transformers 4.x wrote it (top-level rope_theta + rope_scaling with "type").
CASES: dict[str, dict] = {
    # The bug: transformers >= 5 writes rope_parameters and no top-level rope_theta.
    "llama-theta1e5": dict(model_type="llama",
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama-llama3": dict(model_type="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-linear-bias": dict(model_type="llama", attention_bias=True, mlp_bias=True,
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                               "factor": 2.0}),
    "llama-yarn-mscale-hd32": dict(model_type="llama", head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
        "mscale": 1.0, "mscale_all_dim": 0.5}),
    "llama-dynamic": dict(model_type="llama", rope_parameters={"rope_type": "dynamic",
                                                               "rope_theta": 10000.0, "factor": 2.0}),
    "llama-v4-llama3": dict(model_type="llama", v4=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 2.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2-v4-yarn": dict(model_type="qwen2", v4=True, use_sliding_window=False,
                          sliding_window=4096, rope_parameters={
                              "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 32, "truncate": False}),
}
PROMPTS = ["the big cat sat on the red mat and the small dog ran home fast",
           "a blue dog", "slow"]


def build(path, case: str, seed: int = 0) -> dict:
    """Write checkpoint ``case`` of :data:`CASES` into ``path`` (config.json, model.safetensors,
    tokenizer.json); every parameter drawn from a seeded generator, large enough that greedy
    picks are far from ties. Returns the config.json written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CASES[case])
    mt, v4 = spec.pop("model_type"), spec.pop("v4", False)
    vocab = build_tokenizer(path)
    cfg = AutoConfig.for_model(mt, vocab_size=vocab, hidden_size=H, intermediate_size=FF,
                               num_hidden_layers=L, num_attention_heads=NH,
                               num_key_value_heads=NKV, max_position_embeddings=MAXPOS,
                               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **spec)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(path))
    written = json.loads((path / "config.json").read_text())
    if v4:
        rp = written.pop("rope_parameters")
        written["rope_theta"] = rp.pop("rope_theta")
        written["rope_scaling"] = {"type": rp.pop("rope_type"),
                                   **{k: v for k, v in rp.items() if k != "type"}}
        (path / "config.json").write_text(json.dumps(written, indent=2))
    return written


def transformers_greedy(path, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' float32 logits [vocab] of the last prompt token and its ``n`` greedy
    tokens (``generate(do_sample=False)``, EOS not stopping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, -1].float()
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return logits, out[0, len(ids):].tolist()
