"""config.json fields that change the math: read in both conventions (transformers >= 5
``rope_parameters``, 4.x ``rope_theta`` + ``rope_scaling``), and every one kvflow does not
honour refused with one error naming the field and its value."""

from __future__ import annotations

import re

import pytest

from kvflow.model import ModelConfig

LLAMA = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
         "max_position_embeddings": 256}
QWEN2 = {**LLAMA, "model_type": "qwen2"}
KINDS = "('default', 'linear', 'dynamic', 'llama3', 'yarn')"

REFUSED = {
    "rope_type": ({**LLAMA, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                  f"config.json rope_type='longrope' is not supported; kvflow implements {KINDS}"),
    "rope_type-v4": ({**LLAMA, "rope_scaling": {"type": "su", "factor": 2.0}},
                     f"config.json rope_type='su' is not supported; kvflow implements {KINDS}"),
    "rope key": ({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}},
                 "config.json rope parameter beta_fast=3 is not used by rope_type 'linear' (it "
                 "reads ('factor',)); kvflow refuses what it does not honour"),
    "mrope_section": ({**QWEN2, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 2]}},
                      "config.json rope parameter mrope_section=[2, 2] is not used by rope_type "
                      "'default' (it reads rope_theta only); kvflow refuses what it does not honour"),
    "factor missing": ({**LLAMA, "rope_parameters": {"rope_type": "dynamic"}},
                       "config.json rope_type='dynamic' needs rope parameter 'factor'"),
    "rope_theta NaN": ({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
                       "config.json rope_theta=nan must be a number > 1"),
    "not an object": ([LLAMA], "config.json must hold a JSON object, got a list"),
    "factor inf": ({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": float("inf")}},
                   "rope_scaling factor=inf must be a positive finite number"),
    "factor < 1": ({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 0.5}},
                   "rope_scaling factor=0.5 must be >= 1"),
    "partial_rotary_factor": ({**LLAMA, "partial_rotary_factor": 0.5},
                              "config.json partial_rotary_factor=0.5 is not supported: kvflow "
                              "rotates the whole head_dim (partial_rotary_factor 1)"),
    "partial_rotary_factor in rope": (
        {**LLAMA, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
        "config.json partial_rotary_factor=0.25 is not supported: kvflow rotates the whole "
        "head_dim (partial_rotary_factor 1)"),
    "rope_theta twice": ({**LLAMA, "rope_theta": 10000.0,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
                         "config.json gives rope_theta twice with different values: 100000.0 and 10000.0"),
    "both conventions": ({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0},
                          "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
                         "config.json rope_scaling={'type': 'linear', 'factor': 2.0} and "
                         "rope_parameters={'rope_type': 'linear', 'factor': 4.0} disagree; keep one"),
    "per-layer rope": ({**LLAMA, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
                       "config.json rope_parameters has per-layer-type entries ['full_attention']; "
                       "kvflow uses one RoPE for every layer"),
    "use_sliding_window": ({**QWEN2, "use_sliding_window": True, "sliding_window": 16,
                            "max_window_layers": 1},
                           "config.json use_sliding_window=True (sliding_window=16, "
                           "max_window_layers=1 of 2 layers) is not supported; kvflow attends "
                           "to the whole context"),
    "layer_types": ({**QWEN2, "layer_types": ["full_attention", "sliding_attention"]},
                    "config.json layer_types holds ['sliding_attention']; kvflow implements only "
                    "full_attention layers"),
    "hidden_act": ({**LLAMA, "hidden_act": "gelu"},
                   "config.json hidden_act='gelu' is not supported; kvflow's MLP is SwiGLU (silu)"),
    "attn_logit_softcapping": ({**LLAMA, "attn_logit_softcapping": 50.0},
                               "config.json attn_logit_softcapping=50.0 is not supported by "
                               "kvflow's llama forward"),
    "quantization_config": ({**QWEN2, "quantization_config": {"quant_method": "gptq"}},
                            "config.json quantization_config={'quant_method': 'gptq'} is not "
                            "supported by kvflow's qwen2 forward"),
    "head_dim": ({**LLAMA, "head_dim": 15},
                 "config.json head_dim=15 is odd; RoPE rotates pairs of dims"),
    "missing size": ({k: v for k, v in LLAMA.items() if k != "intermediate_size"},
                     "config.json has no intermediate_size"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unhonoured_field_is_refused_naming_it(case):
    cfg, msg = REFUSED[case]
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        ModelConfig.from_hf(cfg)


def test_both_conventions_and_defaults():
    v5 = ModelConfig.from_hf({**LLAMA, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert (v5.rope_theta, v5.rope_scaling) == (100000.0, None)
    v4 = ModelConfig.from_hf({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert (v4.rope_theta, v4.rope_scaling) == (500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})  # defaults to max_position_embeddings
    # what transformers 5 writes for a 4.x yarn config: both type and rope_type; yarn's factor
    # None means max_position_embeddings / original_max_position_embeddings
    yarn = ModelConfig.from_hf({**QWEN2, "rope_parameters": {
        "type": "yarn", "rope_type": "yarn", "factor": None, "rope_theta": 1e6,
        "original_max_position_embeddings": 64}})
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64}
    both = ModelConfig.from_hf({**LLAMA, "rope_theta": 1e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}})
    assert (both.rope_theta, both.rope_scaling) == (1e5, {"rope_type": "linear", "factor": 2.0})
    plain = ModelConfig.from_hf({k: v for k, v in QWEN2.items() if k != "max_position_embeddings"})
    assert (plain.rope_theta, plain.max_position_embeddings, plain.attention_bias, plain.o_bias) == \
        (10000.0, 32768, True, False)  # transformers' Qwen2Config defaults
    # Qwen2.5 ships an inactive sliding window; Llama's mlp_bias / attention_bias are honoured
    qwen25 = ModelConfig.from_hf({**QWEN2, "use_sliding_window": False, "sliding_window": 32768,
                                  "max_window_layers": 1, "layer_types": ["full_attention"] * 2})
    assert qwen25.num_layers == 2
    biased = ModelConfig.from_hf({**LLAMA, "attention_bias": True, "mlp_bias": True})
    assert (biased.attention_bias, biased.o_bias, biased.mlp_bias) == (True, True, True)
