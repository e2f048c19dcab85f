"""Issue 14 kind 3: P and D pair only when their models agree, not only their KV cache specs.
Two Hugging Face checkpoints of kvflow-tiny's shapes (one with kvflow-tiny's own weights, one
with other seeded weights) pair with a kvflow-tiny instance exactly when the weights are
equal; a max_model_len or dtype difference is refused too, naming both sides' values."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from kvflow.model import PRESETS, LlamaForCausalLM, ModelConfig, load_model
from kvflow.model.llama import init_random_
from kvflow.model.loader import SEED
from kvflow.serve.protocol import Pair, PairResult
from kvflow.serve.instance.decode import DecodeInstance
from kvflow.serve.instance.fingerprint import check_fingerprint, model_fingerprint
from kvflow.serve.instance.prefill import PrefillInstance

from tests.reliability_harness import make_instance

TINY = PRESETS["kvflow-tiny"]


def save_checkpoint(path, seed: int) -> str:
    """A local HF Llama checkpoint with kvflow-tiny's config and the weights of
    ``init_random_(seed)`` (``SEED``: kvflow-tiny's own); a word-level tokenizer of 258 tokens."""
    from tokenizers import Tokenizer, models
    path.mkdir()
    cfg = {"model_type": "llama", "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
           "num_hidden_layers": TINY.num_layers, "num_attention_heads": TINY.num_heads,
           "num_key_value_heads": TINY.num_kv_heads, "head_dim": TINY.head_dim,
           "intermediate_size": TINY.intermediate_size, "rope_theta": TINY.rope_theta,
           "rms_norm_eps": TINY.rms_norm_eps,
           "max_position_embeddings": TINY.max_position_embeddings,
           "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 257}
    (path / "config.json").write_text(json.dumps(cfg))
    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(258)}, unk_token="<0>")).save(
        str(path / "tokenizer.json"))
    model = init_random_(LlamaForCausalLM(TINY), seed)
    save_file({k: v.contiguous() for k, v in model.named_parameters()},
              str(path / "model.safetensors"))
    return str(path)


def pair(p, d) -> tuple[PairResult, PairResult]:
    """The router's Pair to each side (from their Register messages); (P's, D's) answers."""
    p.register(), d.register()
    rp, rd = p.out.pop(), d.out.pop()
    p.on_pair(Pair(peer_id=rd.instance_id, peer_role="decode", peer_spec=rd.spec,
                   peer_num_blocks=rd.num_blocks, data_addr=rd.data_addr, shm_name=rd.shm_name,
                   peer_fingerprint=rd.fingerprint), [], None)
    d.on_pair(Pair(peer_id=rp.instance_id, peer_role="prefill", peer_spec=rp.spec,
                   peer_num_blocks=rp.num_blocks, shm_name=rp.shm_name,
                   peer_fingerprint=rp.fingerprint), [], None)
    return p.out.pop(), d.out.pop()


@pytest.fixture
def instances():
    made = []

    def make(cls, role, **kw):
        made.append(make_instance(cls, role, **kw))
        return made[-1]
    yield make
    for inst in made:
        inst.close()


def test_other_weights_of_the_same_shapes_are_refused(tmp_path, instances):
    same, other = save_checkpoint(tmp_path / "same", SEED), save_checkpoint(tmp_path / "other", 1)
    p = instances(PrefillInstance, "prefill")                     # kvflow-tiny
    d_same = instances(DecodeInstance, "decode", model=same)       # its weights, another name
    d_other = instances(DecodeInstance, "decode", model=other)     # same shapes, other weights
    assert p.spec == d_other.spec                                  # the KV cache spec check passes
    assert all(r.ok for r in pair(p, d_same)) and list(p.connector.links) == [d_same.instance_id]
    wp, wd = p.fingerprint["weights"], d_other.fingerprint["weights"]
    res_p, res_d = pair(p, d_other)
    assert not res_p.ok and res_p.error == (
        f"model fingerprint mismatch, pairing refused: weights: {wp[:12]}… ({p.instance_id}) vs "
        f"{wd[:12]}… ({d_other.instance_id})")
    assert not res_d.ok and res_d.error == (
        f"model fingerprint mismatch, pairing refused: weights: {wd[:12]}… "
        f"({d_other.instance_id}) vs {wp[:12]}… ({p.instance_id})")
    assert list(p.connector.links) == [d_same.instance_id]                   # no link to the refused D


def test_max_model_len_and_dtype_mismatches_are_refused(instances):
    p = instances(PrefillInstance, "prefill")                     # max_model_len 256, float32
    d = instances(DecodeInstance, "decode", max_model_len=128)
    res_p, res_d = pair(p, d)
    assert res_p.error == ("model fingerprint mismatch, pairing refused: max_model_len: 256 "
                           f"({p.instance_id}) vs 128 ({d.instance_id})")
    assert res_d.error.endswith(f"max_model_len: 128 ({d.instance_id}) vs 256 ({p.instance_id})")
    d16 = instances(DecodeInstance, "decode", dtype="bfloat16")
    res_p, _ = pair(p, d16)
    # a KV dtype alone is mapped (ipc-pull converts); the model's dtype is the fingerprint's
    assert not res_p.ok and res_p.error.startswith(
        f"model fingerprint mismatch, pairing refused: dtype: float32 ({p.instance_id}) vs "
        f"bfloat16 ({d16.instance_id}); weights: ")
    assert list(p.connector.links) == []


def test_fingerprint_holds_the_config_dtype_length_and_a_weights_digest():
    a, _ = load_model("kvflow-tiny")
    fp = model_fingerprint(a, 256)
    keys = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "name"]
    assert list(fp) == keys + ["dtype", "max_model_len", "weights"]
    assert (fp["dtype"], fp["max_model_len"], len(fp["weights"])) == ("float32", 256, 32)
    assert model_fingerprint(load_model("kvflow-tiny")[0], 256) == fp   # stable across loads
    with torch.no_grad():
        a.model.layers[3].mlp.down_proj.weight[7, 5] += 1e-6           # one parameter, one value
    changed = model_fingerprint(a, 256)
    assert [k for k in fp if fp[k] != changed[k]] == ["weights"]
    b16 = model_fingerprint(load_model("kvflow-tiny", dtype=torch.bfloat16)[0], 256)
    assert [k for k in fp if fp[k] != b16[k]] == ["dtype", "weights"]


def test_check_fingerprint_names_every_difference_with_both_values():
    fp = model_fingerprint(load_model("kvflow-tiny")[0], 256)
    assert check_fingerprint(fp, "p-1", dict(fp), "d-2") == ""
    other = dict(fp, rope_theta=500000.0, dtype="bfloat16", weights="91c0" + "0" * 28)
    assert check_fingerprint(fp, "p-1", other, "d-2") == (
        "model fingerprint mismatch, pairing refused: rope_theta: 10000.0 (p-1) vs 500000.0 (d-2); "
        f"dtype: float32 (p-1) vs bfloat16 (d-2); weights: {fp['weights'][:12]}… (p-1) vs "
        "91c000000000… (d-2)")
    assert check_fingerprint(fp, "p-1", {}, "d-2") == (
        "model fingerprint missing, pairing refused: d-2 sent none (a kvflow older than this p-1?)")
