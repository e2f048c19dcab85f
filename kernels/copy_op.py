"""``copy_blocks``: block pairs between two caches of one spec (or within one cache), checked
and dispatched to a backend; the id and spec rules of :mod:`.ops` apply (padding -1 skipped).
"""

from __future__ import annotations

from typing import Any

from kvflow.cache import PagedKVCache
from kvflow.layout import normalize_layers

from . import digest as _digest
from .block_scales import move_scales, per_block
from .errors import shared
from .registry import get_backend
from .validate import check_block_strides, check_cache, check_ids, check_same_spec, shared_block
from .validate import check_max_ctas as _check_max_ctas, check_validate as _check_validate
from .validate import relation as _relation


_USE_COPY_SEQUENCE = ("; copy_blocks moves block pairs between caches of one spec: to move a "
                      "sequence's tokens between block tables of different specs, call "
                      "copy_sequence")


def _check_disjoint(src_cache: PagedKVCache, dst_cache: PagedKVCache, s: torch.Tensor,
                    d: torch.Tensor, validate: bool, on_device: bool) -> bool:
    """Copying within one memory is allowed only as one cache with disjoint block ids; True
    when it is one cache (ids checked on the device are checked there, see
    :mod:`kvflow.kernels.errors`).

    Two cache objects over the same tensors (e.g. ``PagedKVCache(..., buffer=c.buffer)``)
    count as one cache; caches whose memory overlaps in any other way are refused."""
    relation = _relation(src_cache, dst_cache)
    if relation == "overlapping":
        raise ValueError("src_cache and dst_cache overlap in memory without being the same "
                         "cache (same tensors); copy_blocks needs disjoint caches or one cache")
    if relation == "same" and validate and not on_device:
        both = shared_block(s, d)
        if both >= 0:
            raise shared(both)
    return relation == "same"


def copy_blocks(src_cache: PagedKVCache, dst_cache: PagedKVCache, src_ids: Any, dst_ids: Any,
                layers: Any = None, *, backend: str = "auto", max_ctas: int | None = None,
                validate: bool = True, direction: str = "pull",
                digest: Any = None) -> PagedKVCache:
    """Copy block pairs from one cache to another of the same spec: block ``src_ids[i]`` of
    every tensor in the layer range goes to block ``dst_ids[i]``.

    Caches of different specs (block_size, layout, dtype, KV heads) hold a token at different
    places, so a block of one is no block of the other: :func:`kvflow.kernels.copy_sequence`
    moves a sequence's tokens from one block table into another (re-blocking).

    Equal fp8 specs with ``scales="block_head"``: each moved block's scales (of the layer
    range) move with it, ``dst_cache.scales[j, dst_ids[i]] = src_cache.scales[j, src_ids[i]]``
    (:mod:`kvflow.kernels.block_scales`).

    The caches may be in different processes' memory mapped into this one (shared memory on
    CPU, CUDA IPC on GPU) or, on GPU backends, on two peer-accessible GPUs; the kernel runs on
    ``dst_cache``'s device.

    Parameters
    ----------
    src_cache, dst_cache : PagedKVCache
        Same ``spec`` (every field); may be the same cache, or two objects over the same
        tensors (then ids must not overlap); any other overlap of their memory is refused.
    src_ids, dst_ids : torch.Tensor, int32 or int64, shape [n] each
        Pairs of blocks; -1 on either side skips the pair; ``dst_ids`` distinct.
    layers, backend, max_ctas, validate
        As :func:`gather_blocks`.
    direction : {"pull", "push"}
        Caches on two peer GPUs: ``"pull"`` runs the kernel on ``dst_cache``'s GPU (reading the
        peer), ``"push"`` on ``src_cache``'s GPU (writing the peer). Only backends that list it
        in their ``directions`` (``triton``, ``numba_cuda``) take ``"push"``.
    digest : torch.Tensor, int32, shape [n], optional
        Also write ``digest[i]``, the digest of the bytes pair ``i`` moved (0 for a skipped
        pair), as ``digest`` of :func:`gather_blocks`; on the device the kernel runs on
        (``dst_cache``'s, or ``src_cache``'s for ``"push"``). Equal specs only.

    Returns
    -------
    PagedKVCache
        ``dst_cache``.

    Raises
    ------
    ValueError
        The specs differ (naming each differing field and both values, and copy_sequence), the
        id counts differ, ids out of range or repeated (``dst_ids``), overlapping caches; also
        TypeError for an argument of the wrong type, as :func:`gather_blocks`.
    """
    if direction not in ("pull", "push"):
        raise ValueError(f"direction must be 'pull' or 'push', got {direction!r}")
    if type(src_cache) is not PagedKVCache:
        src_cache = check_cache("src_cache", src_cache)
    if type(dst_cache) is not PagedKVCache:
        dst_cache = check_cache("dst_cache", dst_cache)
    dev, spec = dst_cache.device, dst_cache.spec
    _check_validate(validate, dev, src_cache.device)
    if dst_cache.backend_state.get("checked_spec") is not src_cache.spec:  # specs are frozen
        check_same_spec("src_cache", src_cache.spec, "dst_cache", spec, _USE_COPY_SEQUENCE)
        dst_cache.backend_state["checked_spec"] = src_cache.spec
    start, stop = (0, spec.num_layers) if layers is None else normalize_layers(layers, spec.num_layers)
    be = get_backend(backend, dev)
    check_block_strides(be, spec)
    checks = getattr(be, "device_checks", False)
    s, s_dev = check_ids("src_ids", src_ids, src_cache.num_blocks, dev, validate,
                         device_checks=checks)
    d, d_dev = check_ids("dst_ids", dst_ids, dst_cache.num_blocks, dev, validate,
                         unique=True, device_checks=checks)
    if s.shape[0] != d.shape[0]:
        raise ValueError(f"src_ids has {s.numel()} ids but dst_ids has {d.numel()}; "
                         f"they pair one to one")
    same = _check_disjoint(src_cache, dst_cache, s, d, validate, s_dev or d_dev)
    if max_ctas is not None:
        max_ctas = _check_max_ctas(max_ctas)
    if src_cache.device.type != dst_cache.device.type:
        raise ValueError(f"src_cache is on {src_cache.device} and dst_cache on {dst_cache.device}; "
                         f"copy_blocks moves between caches of one device type")
    if direction == "push" and "push" not in getattr(be, "directions", ("pull",)):
        raise ValueError(f"direction='push' is not supported by backend {be.name!r}; "
                         f"use 'pull' or one of the triton/numba_cuda backends")
    if digest is not None:
        digest = _digest.check_digest(digest, s.shape[0],
                               dev if direction == "pull" else src_cache.device, spec)
    if s.shape[0]:
        kw = {} if direction == "pull" else {"direction": direction}
        if s_dev or d_dev:
            kw["check"] = True
            if same:
                kw["same"] = True
        if digest is not None and getattr(be, "digests", False):
            kw["digest"] = digest
        be.copy(src_cache, dst_cache, s, d, start, stop, max_ctas, **kw)
        if digest is not None and "digest" not in kw:
            _digest.copied(src_cache, s, d, dst_cache.num_blocks, start, stop, digest)
        if per_block(spec):  # the blocks' scales move with their bytes
            tpl = spec.tensors_per_layer
            move_scales(src_cache.scales[start * tpl:stop * tpl],
                        dst_cache.scales[start * tpl:stop * tpl], s, d)
    return dst_cache
