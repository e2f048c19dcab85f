"""Per-block digests of moved KV (``--kv-verify``): the definition, in torch (the reference).

The digest of one block pair ``i`` over a layer range ``[start, stop)`` reads the moved bytes
as little-endian 32-bit words ``w[p]``, ``p = j * R + k`` for cache tensor ``j`` (``j = layer *
tensors_per_layer + t``, counted from layer 0 whatever the range) and word ``k < R =
block_bytes / 4`` of its run, and is

    digest[i] = (sum over p of w[p] * m(p)) mod 2**32,   m(p) = ((p * 0x9E3779B1) mod 2**32) | 1

stored as an int32 (the same 32 bits, two's complement). Everything is 32-bit arithmetic
(one multiply, one add, one or per word: the copy stays memory-bound on a GPU). Positions are
absolute, so the digest of a layer range is the sum of its layers' digests mod 2**32 (a
receiver that scatters layer by layer adds them up, :func:`fold`). Each term only depends on
its own word and position, and addition mod 2**32 does not depend on order, so programs may
add their parts in any order (wrapping integer atomics): every backend gets
the same bits. ``m(p)`` is odd, so a change of any one word always changes its term (the
digest detects every single-word corruption); terms weighted by position also see swapped
words, and K/V or layer swaps (``j`` is part of ``p``). It is an integrity check against
faults (a torn copy, a corrupted frame), not a cryptographic MAC: a peer that can write the
bytes can write a matching digest.

The digest covers block bytes only: the per-block fp8 scales of a ``scales="block_head"``
cache are not in it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.layout import normalize_layers

MULT = 0x9E3779B1
MASK = 0xFFFFFFFF


def multipliers(num_words: int, device: Any = "cpu") -> torch.Tensor:
    """``m(p)`` for ``p < num_words`` as int64 values below 2**32 (module docstring)."""
    p = torch.arange(num_words, dtype=torch.int64, device=device)
    return ((p * MULT) & MASK) | 1


def digest_words(words: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Digests of ``words``: int32 (or any 4-byte dtype) ``[n, P]``, row ``i`` the words of
    block pair ``i`` at positions ``first, first + 1, ...``; returns int32 ``[n]``."""
    w = words.view(torch.int32).to(torch.int64) & MASK
    m = multipliers(first + w.shape[1], w.device)[first:]
    return fold(((w * m) & MASK).sum(dim=1))


def fold(total: torch.Tensor) -> torch.Tensor:
    """int64 sums ``total`` (any sign) mod 2**32 as int32 (the digest's 32 bits)."""
    low = total & MASK
    return (low - ((low >> 31) & 1) * (MASK + 1)).to(torch.int32)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as int32 words (fp8 and other dtypes alike)."""
    return t.contiguous().view(torch.uint8).view(torch.int32)


def check_digestible(spec: Any) -> None:
    """Raise ValueError when blocks of ``spec`` are not whole 32-bit words."""
    if spec.block_bytes % 4:
        raise ValueError(f"digest needs block_bytes to be a multiple of 4, got "
                         f"{spec.block_bytes} (spec {spec})")


def check_digest(digest: Any, n: int, device: torch.device, spec: Any) -> torch.Tensor | None:
    """The ``digest=`` argument of an op (None, or int32 ``[n]`` contiguous on ``device``),
    zeroed for the op to fill.

    Raises
    ------
    TypeError
        Not a tensor, or not int32.
    ValueError
        Another shape or device, not contiguous, or blocks that are not whole 32-bit words.
    """
    if digest is None:
        return None
    if not isinstance(digest, torch.Tensor):
        raise TypeError(f"digest must be None or an int32 torch.Tensor of shape [{n}], got "
                        f"{type(digest).__name__}")
    if digest.dtype != torch.int32:
        raise TypeError(f"digest must have dtype torch.int32, got {digest.dtype}")
    if tuple(digest.shape) != (n,):
        raise ValueError(f"digest must have shape [{n}] (one per id), got {list(digest.shape)}")
    if digest.device != device:
        raise ValueError(f"digest is on {digest.device}; the op runs on {device}")
    if not digest.is_contiguous():
        raise ValueError("digest must be contiguous")
    check_digestible(spec)
    return digest.zero_()


def no_reblock(digest: Any) -> None:
    """Raise ValueError when ``digest`` is given to a re-blocked move (not supported)."""
    if digest is not None:
        raise ValueError("digest= is not supported for re-blocked moves (another spec, "
                         "num_tokens or head_start); digest moves of equal specs")


def block_digest(cache: Any, block_ids: Any, layers: Any = None) -> torch.Tensor:
    """The digests of blocks ``block_ids`` of ``cache`` over ``layers`` (the reference).

    Parameters
    ----------
    cache : PagedKVCache
    block_ids : sequence of int or 1-D integer tensor, shape [n]
        Block ids; -1 (padding) gives digest 0.
    layers : None, int, range, slice or (start, stop)
        Layer range (default: all layers).

    Returns
    -------
    torch.Tensor
        int32 ``[n]`` on ``cache.device``: what ``gather_blocks(..., digest=d)`` writes.

    Raises
    ------
    ValueError
        ``block_bytes`` not a multiple of 4, or an id outside ``[-1, num_blocks)``.
    """
    spec = cache.spec
    check_digestible(spec)
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).to(cache.device)
    bad = (ids < -1) | (ids >= cache.num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"block_ids[{i}] = {int(ids[i])} is outside [-1, {cache.num_blocks})")
    start, stop = normalize_layers(layers, spec.num_layers)
    T = spec.tensors_per_layer
    valid = ids >= 0
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    tensors = cache.tensors()[start * T:stop * T]
    if not tensors or ids.numel() == 0:
        return torch.zeros(ids.numel(), dtype=torch.int32, device=cache.device)
    rows = torch.cat([_words(t.index_select(0, safe)).reshape(ids.numel(), -1)
                      for t in tensors], dim=1)
    first = start * T * (spec.block_bytes // 4)
    got = digest_words(rows, first)
    return torch.where(valid, got, torch.zeros_like(got))


def digest_blocks(cache: Any, block_ids: Any, layers: Any = None, *,
                  backend: str = "auto") -> torch.Tensor:
    """:func:`block_digest` computed by a backend's kernel: one launch that reads the blocks
    once and writes nothing but the digests (``triton``: a digest-only launch of the copy
    kernel, ~a gather's reads without its writes); backends without one (or runs not 4-byte
    aligned) use :func:`block_digest`. For a sender that copies nothing itself (``ipc-pull``:
    D copies out of P's exported cache).

    Parameters
    ----------
    cache : PagedKVCache
    block_ids : sequence of int or 1-D int32/int64 tensor, shape [n]
        Block ids; -1 (padding) gives digest 0.
    layers : None, int, range, slice or (start, stop)
        Layer range (default: all layers).
    backend : str
        As the ops' ``backend`` (``"auto"``, ``"triton"``, ...).

    Returns
    -------
    torch.Tensor
        int32 ``[n]`` on ``cache.device``, equal to ``block_digest(cache, block_ids, layers)``
        (enqueued on the current stream; read it with ``.tolist()``).

    Raises
    ------
    TypeError, ValueError
        Bad ids (an id outside ``[-1, num_blocks)`` names its index and value), a bad layer
        range, or ``block_bytes`` not a multiple of 4.
    """
    from .registry import get_backend
    from .validate import check_cache, check_ids
    cache = check_cache("cache", cache)
    check_digestible(cache.spec)
    start, stop = normalize_layers(layers, cache.spec.num_layers)
    be = get_backend(backend, cache.device)
    ids, _ = check_ids("block_ids", block_ids, cache.num_blocks, cache.device)
    out = torch.zeros(ids.shape[0], dtype=torch.int32, device=cache.device)
    kernel = getattr(be, "digest", None)
    if ids.shape[0] and not (kernel is not None and kernel(cache, ids, start, stop, out)):
        out.copy_(block_digest(cache, ids, (start, stop)))
    return out


def staged_digest(buf: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The digests of the slots of a staging buffer ``[layers, tensors, n, *block_shape]``
    (``staging_shape`` order) of layers from ``start``: int32 ``[n]``, slot ``i`` as the
    block it holds."""
    L, T, n = buf.shape[:3]
    words = _words(buf).reshape(L * T, n, -1).permute(1, 0, 2).reshape(n, -1)
    return digest_words(words, start * T * (words.shape[1] // max(1, L * T)))


# ---- the reference digests of one op, for backends that do not digest in their launch ----
def _masked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros_like(values))


def gathered(cache: Any, ids: torch.Tensor, out: torch.Tensor, start: int,
             digest: torch.Tensor) -> None:
    """``digest[i]`` = the digest of slot ``i`` of the gathered ``out`` (layers from
    ``start``; 0 for a skipped id)."""
    valid = (ids >= 0) & (ids < cache.num_blocks)
    digest.copy_(_masked(staged_digest(out, start), valid.to(digest.device)))


def scattered(src: torch.Tensor, cache: Any, ids: torch.Tensor, start: int,
              digest: torch.Tensor) -> None:
    """``digest[i]`` = the digest of slot ``i`` of ``src`` (layers from ``start``; 0 where
    ``ids[i]`` was skipped)."""
    valid = (ids >= 0) & (ids < cache.num_blocks)
    digest.copy_(_masked(staged_digest(src, start), valid.to(digest.device)))


def copied(src_cache: Any, src_ids: torch.Tensor, dst_ids: torch.Tensor, dst_n: int,
           start: int, stop: int, digest: torch.Tensor) -> None:
    """``digest[i]`` = the digest of source block ``src_ids[i]`` (0 for a skipped pair)."""
    s = src_ids.to(torch.int64).to(src_cache.device)
    d = dst_ids.to(torch.int64).to(src_cache.device)
    valid = (s >= 0) & (s < src_cache.num_blocks) & (d >= 0) & (d < dst_n)
    ids = torch.where(valid, s, torch.full_like(s, -1))
    digest.copy_(block_digest(src_cache, ids, (start, stop)).to(digest.device))
