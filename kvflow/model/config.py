"""Model configuration of the Llama family (Llama 2/3, Qwen2) and kvflow's built-in presets.

A :class:`ModelConfig` holds what the forward pass and the KV cache need; it is filled either
from a preset name (``"kvflow-tiny"``, ``"kvflow-llama-32l"``) or from a Hugging Face
``config.json`` (:meth:`ModelConfig.from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# model_type values of config.json that this forward reproduces exactly.
HF_MODEL_TYPES = ("llama", "qwen2")


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
        HF ``rope_scaling``; ``None`` or ``{"rope_type": "llama3", ...}`` (Llama 3.1) are supported.
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
        rs = self.rope_scaling
        if rs is not None and (rs.get("rope_type") or rs.get("type")) not in ("default", "llama3"):
            raise ValueError(f"rope_scaling={rs!r} is not supported; use None or rope_type 'llama3'")

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
        """Build from a Hugging Face ``config.json`` of a Llama or Qwen2 model.

        Raises
        ------
        ValueError
            For a ``model_type`` other than :data:`HF_MODEL_TYPES`, or Qwen2 with
            ``use_sliding_window`` (not implemented).
        """
        mt = cfg.get("model_type")
        if mt not in HF_MODEL_TYPES:
            raise ValueError(f"config.json model_type={mt!r} is not supported; use one of {HF_MODEL_TYPES}")
        if mt == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=True is not supported")
        heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            name=name,
        )


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
