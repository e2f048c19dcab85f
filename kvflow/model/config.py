"""Model configuration of the Llama family (Llama 2/3, Qwen2) and kvflow's built-in presets.

A :class:`ModelConfig` holds what the forward pass and the KV cache need; it is filled either
from a preset name (``"kvflow-tiny"``, ``"kvflow-llama-32l"``) or from a Hugging Face
``config.json`` (:meth:`ModelConfig.from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .hf_config import HF_MODEL_TYPES, model_config_kwargs
from .rope import check_rope_scaling

__all__ = ["ModelConfig", "PRESETS", "HF_MODEL_TYPES", "BYTE_VOCAB"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Geometry and constants of a Llama-family decoder.

    Attributes
    ----------
    vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size : int
        Sizes (``num_heads`` query heads share ``num_kv_heads`` KV heads, GQA).
    rope_theta : float
        RoPE base (Su et al. 2021, "RoFormer"), HF ``rotate_half`` convention.
    rope_scaling : dict or None
        None (plain RoPE) or ``{"rope_type": t, ...}`` with t one of linear, dynamic, llama3,
        yarn and the keys that type reads (:mod:`kvflow.model.rope`).
    rms_norm_eps : float
        Epsilon of RMSNorm (Zhang & Sennrich 2019).
    max_position_embeddings : int
        Longest sequence (tokens) the model accepts.
    tie_word_embeddings : bool
        ``lm_head`` shares the embedding matrix.
    attention_bias : bool
        q/k/v projections carry a bias (Qwen2: always).
    o_bias : bool
        The output projection carries a bias (Llama with ``attention_bias``; never Qwen2).
    mlp_bias : bool
        gate/up/down projections carry a bias (Llama ``mlp_bias``; never Qwen2).
    name : str
        Preset name or checkpoint path.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA groups)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A built-in configuration by name (see :data:`PRESETS`).

        Raises
        ------
        ValueError
            Naming ``name`` and the known presets.
        """
        if name not in PRESETS:
            raise ValueError(f"name={name!r} is not a built-in model; known: {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` of a Llama or Qwen2 model (written by
        transformers 4.x or >= 5: ``rope_theta``/``rope_scaling`` or ``rope_parameters``).

        Raises
        ------
        ValueError
            Naming the field and value, for anything that would change the math and that
            kvflow does not reproduce: ``model_type`` other than :data:`HF_MODEL_TYPES`, an
            unsupported RoPE (type, key, ``partial_rotary_factor``), ``hidden_act`` other than
            silu, an active sliding window, soft-capping or other families' fields
            (:func:`kvflow.model.hf_config.model_config_kwargs`).
        """
        return cls(**model_config_kwargs(cfg), name=name)


# Byte-level vocabulary: 256 bytes + <bos> (256) + <eos> (257).
BYTE_VOCAB = 258

PRESETS: dict[str, ModelConfig] = {
    # Embedded default: cheap on 2 CPU cores, GQA 8:2, seeded random weights.
    "kvflow-tiny": ModelConfig(
        vocab_size=BYTE_VOCAB, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=32, intermediate_size=512, max_position_embeddings=4096, name="kvflow-tiny"),
    # Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128: 128 KiB of bf16 KV per
    # token) with a narrow residual stream (hidden 1024 = 8 x 128, MLP 2048), so transfers have
    # real sizes while compute stays cheap. ~0.3 G parameters; meant for the GPU.
    "kvflow-llama-32l": ModelConfig(
        vocab_size=BYTE_VOCAB, hidden_size=1024, num_layers=32, num_heads=8, num_kv_heads=8,
        head_dim=128, intermediate_size=2048, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=32768, name="kvflow-llama-32l"),
}
