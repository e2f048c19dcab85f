"""Configs, built-in seeded models, tokenizers, kv_spec, sampling."""

import pytest
import torch

from kvflow.engine import sample
from kvflow.model import ByteTokenizer, ModelConfig, load_model

def test_tiny_weights_identical_in_every_process():
    """Values recorded by another process when the seed was chosen: P and D build the same model."""
    model, _ = load_model("kvflow-tiny")
    assert model.model.embed_tokens.weight[3, 7].item() == 0.6420032978057861
    assert model.model.layers[2].mlp.up_proj.weight[5, 9].item() == -0.0005856206989847124
    assert sum(float(p.double().sum()) for p in model.parameters()) == pytest.approx(1954.4247089956152,
                                                                                     rel=1e-12)
    assert not any(p.requires_grad for p in model.parameters())
    again, _ = load_model("kvflow-tiny")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_tiny_shape_and_kv_spec():
    model, tok = load_model("kvflow-tiny")
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (4, 256, 8, 2, 32, 258)
    assert sum(p.numel() for p in model.parameters()) == 2_362_624
    spec = model.kv_spec(16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype,
            spec.layout) == (4, 2, 32, 16, torch.float32, "NHD")
    assert spec.bytes_per_token == 4 * 2 * 2 * 32 * 4
    assert model.kv_spec(8, dtype=torch.bfloat16, layout="HND").bytes_per_block == 8 * 4 * 2 * 2 * 32 * 2
    with pytest.raises(ValueError, match=r"^layout must be 'NHD', 'HND' or 'BM_NHD' for a K/V model, got 'MLA'$"):
        model.kv_spec(16, layout="MLA")
    assert tok.vocab_size == c.vocab_size


def test_llama_32l_preset_has_llama3_8b_kv_geometry():
    c = ModelConfig.preset("kvflow-llama-32l")
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size) == (32, 8, 128, 1024)
    from kvflow import KVCacheSpec
    spec = KVCacheSpec(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       block_size=64, dtype=torch.bfloat16)
    assert spec.bytes_per_token == 131072  # Llama-3-8B: 32 x 2 x 8 x 128 x 2 bytes


def test_load_model_bad_name():
    with pytest.raises(ValueError, match=r"^name_or_path='nope' is neither a built-in model "
                                         r"\['kvflow-llama-32l', 'kvflow-tiny'\] nor a directory "
                                         r"with config.json$"):
        load_model("nope")


def test_config_checks():
    with pytest.raises(ValueError, match=r"^num_heads=6 must be a multiple of num_kv_heads=4"):
        ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=6, num_kv_heads=4,
                    head_dim=4, intermediate_size=8)
    with pytest.raises(ValueError, match=r"^hidden_size must be a positive int, got 0$"):
        ModelConfig(vocab_size=8, hidden_size=0, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=4, intermediate_size=8)
    with pytest.raises(ValueError, match=r"^rope_scaling rope_type='longrope' is not supported; "
                                         r"kvflow implements \('default', 'linear', 'dynamic', "
                                         r"'llama3', 'yarn'\)$"):
        ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=4, intermediate_size=8, rope_scaling={"rope_type": "longrope"})
    with pytest.raises(ValueError, match=r"^rope_scaling=\{'rope_type': 'yarn'\}: rope_type 'yarn' "
                                         r"takes \('factor', "):
        ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=4, intermediate_size=8, rope_scaling={"rope_type": "yarn"})
    with pytest.raises(ValueError, match=r"^name='x' is not a built-in model"):
        ModelConfig.preset("x")


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, KV")
    assert ids == [256, 104, 195, 169, 108, 108, 111, 44, 32, 75, 86]
    assert tok.decode(ids + [257]) == "héllo, KV"
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    with pytest.raises(TypeError, match=r"^text must be a str, got bytes$"):
        tok.encode(b"ab")


def test_sample_greedy_ties_and_temperature():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample(logits, 0.0) == 1  # first of the tied maxima
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    draws = [sample(logits, 1.0, g1) for _ in range(50)]
    assert draws == [sample(logits, 1.0, g2) for _ in range(50)]
    assert set(draws) <= {0, 1, 2, 3} and {1, 3} <= set(draws)
    # near-zero temperature concentrates on the maxima
    assert set(sample(logits, 1e-4, g1) for _ in range(20)) <= {1, 3}
    # below 1e-5 it is greedy (vLLM's _SAMPLING_EPS): logits / 1e-39 would overflow to NaN
    assert [sample(logits, t, g1) for t in (1e-39, 5e-324, 9.9e-6)] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0, got -1.0$"):
        sample(logits, -1.0)
    with pytest.raises(ValueError, match=r"^logits must be a non-empty 1-D tensor \[vocab\], got shape \(2, 2\)$"):
        sample(torch.zeros(2, 2), 0.0)
