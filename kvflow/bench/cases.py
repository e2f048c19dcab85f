"""Cases shared by the studies, the pytest-benchmark suites and the tests: cache geometries,
fills, block ids and byte comparison.

Geometries are plain dicts of :class:`~kvflow.layout.KVCacheSpec` fields. The default is
Llama-3-8B's KV cache (Meta's ``config.json``: ``num_hidden_layers=32,
num_key_value_heads=8``, head_dim ``hidden_size / num_attention_heads = 4096 / 32 = 128``) in
blocks of 64 tokens; MLA keeps the layer count and block size and stores one latent of 576 per
token (DeepSeek-V3: kv_lora_rank 512 + rope dim 64).
"""

from __future__ import annotations

from typing import Any

LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 64}
#: Small enough for a CPU test or a ``--smoke`` run (block 16, float32 in :func:`tiny_spec`).
TINY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16}
MLA_DIM = 576
LAYOUTS = ("NHD", "HND", "MLA")


def make_spec(geometry: dict[str, int] | None = None, layout: str = "NHD",
              dtype: Any = "bfloat16", mla_dim: int = MLA_DIM):
    """The :class:`~kvflow.layout.KVCacheSpec` of a case (``geometry`` defaults to
    :data:`LLAMA3_8B`; ``layout="MLA"`` keeps its layers and block size, one head of
    ``mla_dim``)."""
    from kvflow.layout import KVCacheSpec
    g = dict(geometry or LLAMA3_8B)
    if layout == "MLA":
        return KVCacheSpec(num_layers=g["num_layers"], num_kv_heads=1, head_dim=mla_dim,
                           block_size=g["block_size"], dtype=dtype, layout="MLA")
    return KVCacheSpec(**g, dtype=dtype, layout=layout)


def tiny_spec(layout: str = "NHD"):
    """:data:`TINY` in float32: the shapes of every ``--smoke`` run."""
    import torch
    return make_spec(TINY, layout, torch.float32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (``t`` must be contiguous)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` hold the same bytes (compared on ``a``'s device)."""
    import torch
    return torch.equal(as_bytes(a), as_bytes(b.to(a.device)))


def scramble(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with random bytes (8 at a time when possible: 7x faster than uint8 on CPU)."""
    import torch
    b = as_bytes(t)
    if b.numel() % 8 == 0:
        b.view(torch.int64).random_(generator=generator)
    else:
        b.random_(0, 256, generator=generator)
    return t


def pattern(j: int, blocks: torch.Tensor, spec, num_blocks: int) -> torch.Tensor:
    """int32 words ``[len(blocks), block_bytes // 4]`` that :func:`fill_pattern` wrote into
    blocks ``blocks`` of tensor ``j`` of a cache of ``num_blocks`` blocks (a hash of the word's
    position: every block of every tensor differs)."""
    import torch
    wpb = spec.block_bytes // 4
    w = (j * num_blocks + blocks.to(torch.int64))[:, None] * wpb + torch.arange(wpb, device=blocks.device)
    return ((w * 2654435761 + 12345) & 0xFFFFFFFF).to(torch.int32)


def fill_pattern(cache) -> None:
    """Write :func:`pattern` into every block of ``cache`` (so a reader can check any block
    without a copy of the source)."""
    import torch
    for j, t in enumerate(cache.tensors()):
        words = t.view(cache.num_blocks, -1).view(torch.int32)
        for lo in range(0, cache.num_blocks, 256):
            ids = torch.arange(lo, min(lo + 256, cache.num_blocks), device=t.device)
            words[lo:lo + ids.numel()] = pattern(j, ids, cache.spec, cache.num_blocks)


def disjoint_ids(num_blocks: int, n: int, generator: torch.Generator,
                 device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint sets of ``n`` random block ids of a ``num_blocks`` cache (source and
    destination of a copy within one cache, or of a P->D move)."""
    import torch
    if 2 * n > num_blocks:
        raise ValueError(f"2 x {n} blocks do not fit a cache of num_blocks={num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator)
    return perm[:n].to(device), perm[n:2 * n].to(device)


def blocks_equal(src, src_ids, dst, dst_ids) -> bool:
    """True when blocks ``dst_ids`` of cache ``dst`` hold the bytes of blocks ``src_ids`` of
    cache ``src`` (every layer, K and V; caches on any devices)."""
    import torch
    from kvflow.cache import staging_buffer
    from kvflow.kernels import gather_blocks
    n = len(src_ids)
    a = staging_buffer(src.spec, n, device=src.device)
    b = staging_buffer(dst.spec, n, device=dst.device)
    gather_blocks(src, src_ids, a, backend="torch")
    gather_blocks(dst, dst_ids, b, backend="torch")
    return torch.equal(as_bytes(a).cpu(), as_bytes(b).cpu())


def blocks_digest(cache, ids) -> str:
    """SHA-256 (hex) of blocks ``ids`` of ``cache`` in that order, every layer, K and V: two
    caches hold the same blocks, also in two processes, when their digests are equal."""
    import hashlib

    from kvflow.cache import staging_buffer
    from kvflow.kernels import gather_blocks
    out = staging_buffer(cache.spec, len(ids), device=cache.device)
    gather_blocks(cache, list(ids), out, backend="torch")
    return hashlib.sha256(as_bytes(out).cpu().numpy().tobytes()).hexdigest()
