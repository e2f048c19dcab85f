"""A Hugging Face ``config.json`` of a Llama or Qwen2 model, read into a
:class:`~kvflow.model.config.ModelConfig`, refusing every field that would change the math
and that kvflow's forward (``kvflow/model/llama.py``) does not reproduce.

The fields checked are those ``LlamaConfig`` / ``Qwen2Config`` of transformers 5 read in their
forward, plus fields of neighbouring families that a mislabelled checkpoint could carry.
Defaults are transformers' for the model type.
"""

from __future__ import annotations

from typing import Any

from .rope import rope_from_hf

# model_type values of config.json that this forward reproduces exactly.
HF_MODEL_TYPES = ("llama", "qwen2")
# transformers' defaults per model type, for fields a config.json may leave out.
_DEFAULTS = {"llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
             "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32}}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")
# Fields of other families that change the forward; any non-null value is refused.
_FOREIGN = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
            "embedding_multiplier", "residual_multiplier", "attention_multiplier",
            "logits_scaling", "use_qk_norm", "qk_layernorm", "use_parallel_residual",
            "quantization_config", "mrope_section")


def model_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :class:`ModelConfig` for a ``config.json`` dict.

    Raises
    ------
    ValueError
        Naming the field and its value: a ``model_type`` other than :data:`HF_MODEL_TYPES`;
        a missing size; ``hidden_act`` other than silu; an active sliding window (Qwen2
        ``use_sliding_window`` with a sliding layer, or ``layer_types`` other than
        full_attention); a RoPE kvflow does not implement (:func:`kvflow.model.rope.rope_from_hf`);
        an odd head_dim; any of :data:`_FOREIGN` set; a config.json that is not a JSON object.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json must hold a JSON object, got a {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type={mt!r} is not supported; use one of {HF_MODEL_TYPES}")
    for f in _REQUIRED:
        if f not in cfg:
            raise ValueError(f"config.json has no {f}")
    for f in _FOREIGN:
        if cfg.get(f) is not None:
            raise ValueError(f"config.json {f}={cfg[f]!r} is not supported by kvflow's "
                             f"{mt} forward")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r} is not supported; kvflow's MLP is "
                         "SwiGLU (silu)")
    layers = cfg["num_hidden_layers"]
    if mt == "qwen2":
        _refuse_sliding_window(cfg, layers)
    defaults = _DEFAULTS[mt]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else 0)
    if isinstance(head_dim, int) and head_dim % 2:
        raise ValueError(f"config.json head_dim={head_dim} is odd; RoPE rotates pairs of dims")
    max_pos = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
    theta, scaling = rope_from_hf({**cfg, "max_position_embeddings": max_pos})
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or defaults["num_key_value_heads"] or heads,
        head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2: q/k/v always carry a bias, o and the MLP never (its attention_bias and
        # mlp_bias fields are not read by transformers either).
        attention_bias=True if mt == "qwen2" else bias,
        o_bias=False if mt == "qwen2" else bias,
        mlp_bias=False if mt == "qwen2" else bool(cfg.get("mlp_bias", False)),
    )


def _refuse_sliding_window(cfg: dict[str, Any], layers: int) -> None:
    """Qwen2 layers at and after ``max_window_layers`` use sliding-window attention when
    ``use_sliding_window`` (transformers' ``Qwen2Config``); kvflow attends to the whole context."""
    types = cfg.get("layer_types")
    if types is not None:
        other = sorted({t for t in types if t != "full_attention"})
        if other:
            raise ValueError(f"config.json layer_types holds {other}; kvflow implements only "
                             "full_attention layers")
        return
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None and \
            cfg.get("max_window_layers", 28) < layers:
        raise ValueError(f"config.json use_sliding_window=True (sliding_window="
                         f"{cfg['sliding_window']}, max_window_layers="
                         f"{cfg.get('max_window_layers', 28)} of {layers} layers) is not "
                         "supported; kvflow attends to the whole context")
