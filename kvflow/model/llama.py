"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention is supplied by the caller.

The module tree and parameter names are those of Hugging Face ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight`` ...), so checkpoints load
without renaming. The model itself keeps no KV cache: :meth:`LlamaForCausalLM.forward` takes an
``attn(layer, q, k, v) -> out`` callable, and the engine passes one that writes K/V into a
paged cache and reads the context back through block tables (``kvflow.engine.attention``).

Tokens are flat: ``input_ids`` [T] with their ``positions`` [T]; a prefill chunk and a batch of
decode tokens look the same to the model.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from kvflow.layout import KVCacheSpec

from .config import ModelConfig
from .rope import rope_frequencies

# attn(layer, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [same]) -> [T, num_heads, head_dim]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (filled by a loader or
    :func:`init_random_`, so building a model costs no random init)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size] (uninitialised, like :class:`Linear`)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """float32 [head_dim // 2] inverse frequencies of ``config``'s RoPE and its cos/sin scale
    (yarn's attention factor, else 1.0); see :func:`kvflow.model.rope.rope_frequencies`."""
    return rope_frequencies(config.rope_theta, config.rope_scaling, config.head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by cos/sin [T, head_dim] (HF ``rotate_half`` layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos[:, None] + rot.float() * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def forward(self, layer: int, x, cos, sin, attn: AttentionFn) -> torch.Tensor:
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.nh, self.hd), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.nkv, self.hd), cos, sin)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        return self.o_proj(attn(layer, q, k, v).reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, layer, h, cos, sin, attn):
        h = h + self.self_attn(layer, self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 causal LM with caller-supplied attention.

    Parameters
    ----------
    config : ModelConfig

    Examples
    --------
    >>> from kvflow.model import load_model
    >>> from kvflow.engine.attention import dense_causal_attention
    >>> model, tok = load_model("kvflow-tiny")
    >>> ids = torch.tensor(tok.encode("hello"))
    >>> h = model(ids, torch.arange(len(ids)), dense_causal_attention)
    >>> model.compute_logits(h).shape
    torch.Size([6, 258])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope: torch.Tensor | None = None  # [max_position_embeddings, 2, head_dim] cos, sin

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of ``input_ids`` [T] (int64) at ``positions`` [T].

        ``attn`` is called once per layer, in order; ``on_layer_done(layer)`` after each layer.
        """
        cos, sin = self.rope_table()[positions].unbind(1)
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(i, h, cos, sin, attn)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm(h)

    def rope_table(self) -> torch.Tensor:
        """float32 [max_position_embeddings, 2, head_dim] cos and sin of every position (times
        the RoPE's attention scale, yarn), built once (per device): a position's values never
        depend on which tokens share its forward, so chunked prefill writes exactly the bytes
        of a one-shot prefill."""
        if self._rope is None or self._rope.device != self.inv_freq.device:
            pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32,
                               device=self.inv_freq.device)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope = torch.stack((emb.cos(), emb.sin()), dim=1)
            if self.rope_scale != 1.0:
                self._rope *= self.rope_scale
        return self._rope

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab_size] of hidden states [T, hidden_size]."""
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w).float()

    def kv_spec(self, block_size: int, *, dtype: torch.dtype | None = None,
                layout: str = "NHD") -> KVCacheSpec:
        """The :class:`KVCacheSpec` of this model's cache (layers, KV heads, head_dim from the
        config; ``dtype`` defaults to the model's). ``layout`` is "NHD", "HND" or "BM_NHD"
        (block-major NHD)."""
        if layout not in ("NHD", "HND", "BM_NHD"):
            raise ValueError(f"layout must be 'NHD', 'HND' or 'BM_NHD' for a K/V model, got "
                             f"{layout!r}")
        c = self.config
        return KVCacheSpec(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, block_size=block_size,
                           dtype=self.dtype if dtype is None else dtype, layout=layout)


@torch.no_grad()
def init_random_(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """Fill every parameter from a ``torch.Generator`` seeded with ``seed`` (CPU, float32, in
    sorted-name order), so every process builds identical weights: Linear weights
    N(0, 1/fan_in), embeddings N(0, 1), biases N(0, 0.02^2), norm weights 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            w = 0.02 * torch.randn(p.shape, generator=g)
        elif "embed_tokens" in name:
            w = torch.randn(p.shape, generator=g)
        else:
            w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        p.copy_(w)
    return model
