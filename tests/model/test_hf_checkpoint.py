"""Local Hugging Face checkpoints (Llama, Qwen2) built on disk, checked against an independent
forward written here from the raw safetensors weights (float64, complex-number RoPE)."""

import json
import re
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import PagedKVCache
from kvflow.engine import Engine, sample
from kvflow.model import HFTokenizer, load_model

WORDS = "the a cat dog sat on mat and ran to home fast slow big small red blue".split()
SPECIAL = ["<unk>", "<s>", "</s>"]
H, L, NH, NKV, HD, FF = 64, 2, 4, 2, 16, 96


def build_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    return len(vocab)


def build_checkpoint(path, model_type):
    vocab = build_tokenizer(path)
    qwen = model_type == "qwen2"
    cfg = {"model_type": model_type, "vocab_size": vocab, "hidden_size": H,
           "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "intermediate_size": FF, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
           "rope_theta": 1000.0 if qwen else 500000.0, "tie_word_embeddings": qwen,
           "bos_token_id": 1, "eos_token_id": 2}
    if not qwen:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(7 if qwen else 3)

    def rnd(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    w = {"model.embed_tokens.weight": rnd(vocab, H, scale=1.0), "model.norm.weight": 1 + rnd(H, scale=0.1)}
    if not qwen:
        w["lm_head.weight"] = rnd(vocab, H)
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(H, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(H, scale=0.1)
        for n, out in (("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD)):
            w[p + f"self_attn.{n}_proj.weight"] = rnd(out, H)
            if qwen:
                w[p + f"self_attn.{n}_proj.bias"] = rnd(out, scale=0.1)
        w[p + "self_attn.o_proj.weight"] = rnd(H, NH * HD)
        w[p + "mlp.gate_proj.weight"] = rnd(FF, H)
        w[p + "mlp.up_proj.weight"] = rnd(FF, H)
        w[p + "mlp.down_proj.weight"] = rnd(H, FF)
    save_file(w, str(path / "model.safetensors"))
    return cfg


def inv_freq(cfg):
    f = [cfg["rope_theta"] ** (-2 * i / HD) for i in range(HD // 2)]
    rs = cfg.get("rope_scaling")
    if rs:  # Llama 3.1 frequency scaling, written out per frequency
        out = []
        for x in f:
            wl = 2 * math.pi / x
            old = rs["original_max_position_embeddings"]
            if wl < old / rs["high_freq_factor"]:
                out.append(x)
            elif wl > old / rs["low_freq_factor"]:
                out.append(x / rs["factor"])
            else:
                s = (old / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
                out.append((1 - s) * x / rs["factor"] + s * x)
        f = out
    return torch.tensor(f, dtype=torch.float64)


def reference_logits(path, cfg, ids):
    """Dense float64 forward from the raw tensors: logits [T, vocab]."""
    w = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    T = len(ids)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq(cfg)[None]
    rot = torch.polar(torch.ones_like(ang), ang)  # e^{i p theta}

    def rope(x):  # pairs (j, j + HD/2) as complex numbers
        c = torch.complex(x[..., : HD // 2], x[..., HD // 2:]) * rot[:, None]
        return torch.cat((c.real, c.imag), -1)

    def norm(x, wt):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * wt

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    h = w["model.embed_tokens.weight"][ids]
    for i in range(L):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = rope(lin(x, p + "self_attn.q_proj").view(T, NH, HD))
        k = rope(lin(x, p + "self_attn.k_proj").view(T, NKV, HD))
        v = lin(x, p + "self_attn.v_proj").view(T, NKV, HD)
        out = torch.empty(T, NH, HD, dtype=torch.float64)
        for hh in range(NH):
            kv = hh // (NH // NKV)
            s = q[:, hh] @ k[:, kv].T / math.sqrt(HD)
            s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            out[:, hh] = torch.softmax(s, -1) @ v[:, kv]
        h = h + lin(out.reshape(T, NH * HD), p + "self_attn.o_proj")
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        g, u = lin(x, p + "mlp.gate_proj"), lin(x, p + "mlp.up_proj")
        h = h + lin(g * torch.sigmoid(g) * u, p + "mlp.down_proj")
        del g, u
    h = norm(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_checkpoint_forward_matches_independent_reference(tmp_path, model_type):
    cfg = build_checkpoint(tmp_path, model_type)
    model, tok = load_model(str(tmp_path))
    c = model.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.tie_word_embeddings, c.attention_bias) == \
        (L, NKV, HD, model_type == "qwen2", model_type == "qwen2")
    ids = tok.encode("the big cat sat on the red mat and the small dog ran home fast")
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.vocab_size == 20
    assert tok.decode(ids) == "the big cat sat on the red mat and the small dog ran home fast"
    engine = Engine(model, PagedKVCache(model.kv_spec(4), 16))
    table = [9, 3, 14, 0, 7, 11, 5, 2]  # 32 tokens of block_size 4
    seq = list(ids)
    logits = engine.prefill(seq, table, chunk_size=5)
    for _ in range(6):
        ref = reference_logits(tmp_path, cfg, seq)[-1].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
        assert sample(logits, 0.0) == int(ref.argmax())
        seq.append(sample(logits, 0.0))
        logits = engine.decode([(seq[-1], len(seq) - 1, table)])[0]


def test_checkpoint_errors(tmp_path):
    cfg = build_checkpoint(tmp_path, "llama")
    w = load_file(str(tmp_path / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    w["model.extra.weight"] = torch.zeros(1)
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not match a 2-layer model: missing "
                                         r"\['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected \['model.extra.weight'\]$"):
        load_model(str(tmp_path))
    build_checkpoint(tmp_path, "llama")  # weights of head_dim 16, config.json says 32
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 2 * HD}))
    with pytest.raises(ValueError, match=r": model.layers.0.self_attn.k_proj.weight has shape "
                                         r"\[32, 64\] but config.json \(hidden_size=64, "
                                         r"num_attention_heads=4, num_key_value_heads=2, head_dim=32, "
                                         r"intermediate_size=96, vocab_size=20\) needs \[64, 64\] "
                                         r"\(8 tensors differ\)$"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"^config.json model_type='gpt2' is not supported; "
                                         r"use one of \('llama', 'qwen2'\)$"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json$"):
        HFTokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'tokenizer.json'))} cannot "
                                         f"be read by tokenizers: "):
        HFTokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'model.safetensors'))} is "
                                         f"not a readable safetensors file: "):
        load_model(str(tmp_path))
