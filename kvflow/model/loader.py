"""``load_model``: a built-in seeded model by name, or a local Hugging Face checkpoint by path."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from .config import PRESETS, ModelConfig
from .llama import LlamaForCausalLM, init_random_
from .tokenizer import ByteTokenizer, HFTokenizer

# Every process that builds a built-in model gets the same weights from this seed.
SEED = 20261129


def load_model(name_or_path: str = "kvflow-tiny", *, dtype: Any = torch.float32,
               device: Any = "cpu") -> tuple[LlamaForCausalLM, Any]:
    """Build a model and its tokenizer.

    Parameters
    ----------
    name_or_path : str
        A built-in name (``"kvflow-tiny"``: 4 layers, hidden 256, 8 heads / 2 KV heads of
        head_dim 32, byte tokenizer; ``"kvflow-llama-32l"``: Llama-3-8B KV geometry, see
        :data:`kvflow.model.config.PRESETS`), weights seeded so every process gets identical
        ones; or a local directory with ``config.json`` (``model_type`` llama or qwen2),
        ``*.safetensors`` and ``tokenizer.json``.
    dtype : torch.dtype
        Parameter dtype (float32 on CPU).
    device : str or torch.device

    Returns
    -------
    (LlamaForCausalLM, tokenizer)
        The model in eval mode; the tokenizer has ``encode``, ``decode``, ``bos_token_id``,
        ``eos_token_id``, ``vocab_size``.

    Raises
    ------
    ValueError
        ``name_or_path`` is neither a built-in name nor a checkpoint directory; a checkpoint
        misses weights, carries unexpected ones, or one of a shape its config.json does not
        give (named); config.json asks for math kvflow does not do
        (:meth:`ModelConfig.from_hf`, the field named).
    """
    if name_or_path in PRESETS:
        model = init_random_(LlamaForCausalLM(PRESETS[name_or_path]), SEED)
        return _ready(model.to(dtype=dtype, device=device)), ByteTokenizer()
    if not os.path.isfile(os.path.join(str(name_or_path), "config.json")):
        raise ValueError(f"name_or_path={name_or_path!r} is neither a built-in model "
                         f"{sorted(PRESETS)} nor a directory with config.json")
    return _load_hf(str(name_or_path), dtype, device)


def _load_hf(path: str, dtype: Any, device: Any):
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = ModelConfig.from_hf(json.load(f), name=path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"name_or_path={path!r} has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
    # Old checkpoints store the RoPE table; tied models may still store lm_head.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaForCausalLM(config)  # parameters uninitialised: all are loaded below
    expected = {k for k, _ in model.named_parameters()}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match a {config.num_layers}-layer "
                         f"model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    wrong = [k for k in sorted(state) if tuple(state[k].shape) != shapes[k]]
    if wrong:
        k, c = wrong[0], config
        raise ValueError(f"checkpoint {path!r}: {k} has shape {list(state[k].shape)} but "
                         f"config.json (hidden_size={c.hidden_size}, num_attention_heads="
                         f"{c.num_heads}, num_key_value_heads={c.num_kv_heads}, head_dim="
                         f"{c.head_dim}, intermediate_size={c.intermediate_size}, vocab_size="
                         f"{c.vocab_size}) needs {list(shapes[k])} ({len(wrong)} tensors differ)")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return _ready(model.to(device=device)), HFTokenizer(path)


def _ready(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Inference only: eval mode, no gradients."""
    return model.eval().requires_grad_(False)
