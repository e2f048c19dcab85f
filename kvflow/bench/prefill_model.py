"""The prefill model of the layerwise bench (:mod:`.layerwise`): Llama-shaped decoder layers
with random weights (RMSNorm, QKV/O projections, causal SDPA with GQA, SwiGLU; no RoPE, which
costs no memory traffic that matters here), each writing its K and V through a caller's hook so
the bench decides where they go; :data:`MODELS` holds Llama-3-8B's shapes and a tiny one for
``--quick``. Torch is imported on first use, as every bench module does.
"""

from __future__ import annotations

#: Model shapes: Llama-3-8B (``config.json``) and a tiny one for ``--quick``.
MODELS = {"llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336),
          "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128)}


class Layer:
    """One decoder layer with random weights: RMSNorm, QKV/O projections, causal SDPA, SwiGLU."""

    def __init__(self, g: dict, dtype: torch.dtype, device: str) -> None:
        import torch
        h, d = g["hidden"], g["head_dim"]
        self.g = g
        mk = lambda o, i: torch.randn(o, i, dtype=dtype, device=device) / i ** 0.5  # noqa: E731
        self.wqkv = mk((g["heads"] + 2 * g["kv_heads"]) * d, h)
        self.wo, self.w13, self.w2 = mk(h, g["heads"] * d), mk(2 * g["inter"], h), mk(h, g["inter"])
        self.n1 = self.n2 = torch.ones(h, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, write_kv) -> torch.Tensor:
        import torch.nn.functional as F
        g, T = self.g, x.shape[0]
        q, k, v = F.linear(F.rms_norm(x, x.shape[-1:], self.n1), self.wqkv).split(
            [g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]], -1)
        q, k, v = (t.view(T, -1, g["head_dim"]) for t in (q, k, v))
        write_kv(k, v)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                           is_causal=True, enable_gqa=True)  # [1, heads, T, d]
        x = x + F.linear(o[0].transpose(0, 1).reshape(T, -1), self.wo)
        a, b = F.linear(F.rms_norm(x, x.shape[-1:], self.n2), self.w13).chunk(2, -1)
        return x + F.linear(F.silu(a) * b, self.w2)
