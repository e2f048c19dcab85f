"""The public block-movement ops: checked wrappers that dispatch to a backend (``copy_blocks``
lives in :mod:`.copy_op` and is importable from here).

All three ops move whole blocks (``spec.block_bytes`` contiguous bytes per tensor; an fp8
``block_head`` cache's per-block scales with them, :mod:`.block_scales`) and count as payload
``valid_blocks * spec.block_bytes * tensors_per_layer * layers_in_range`` bytes.
Block id -1 is padding: skipped on both sides, destination untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.cache import PagedKVCache, overlaps
from kvflow.layout import normalize_layers

from . import digest as _digest
from .block_scales import check_stage_scales, move_scales, per_block
from .registry import get_backend
from .validate import check_block_strides, check_buffer, check_cache, check_ids
from .validate import check_max_ctas as _check_max_ctas, check_validate as _check_validate
from .copy_op import copy_blocks  # noqa: F401  (public here as before)


def _check_separate(name: str, buf: torch.Tensor, cache: PagedKVCache) -> None:
    if overlaps(cache, buf):
        raise ValueError(f"{name} lies in the cache's memory; the staging buffer must be "
                         f"separate memory")


def _staged(cache: Any, block_ids: Any, name: str, buf: Any, layers: Any, backend: str,
            validate: Any, unique: bool) -> tuple:
    """The checks of gather and scatter (a cache, its ids, a staging buffer ``name``), written
    for a short host path (issue #16): ``(cache, ids, buf, start, stop, backend, on_device)``."""
    if type(cache) is not PagedKVCache:
        cache = check_cache("cache", cache)
    dev, spec = cache.device, cache.spec
    _check_validate(validate, dev)
    start, stop = (0, spec.num_layers) if layers is None else normalize_layers(layers, spec.num_layers)
    be = get_backend(backend, dev)
    check_block_strides(be, spec)
    ids, on_device = check_ids("block_ids", block_ids, cache.num_blocks, dev, validate,
                               unique=unique, device_checks=getattr(be, "device_checks", False))
    buf = check_buffer(name, buf, (stop - start, spec.tensors_per_layer, ids.shape[0],
                                   *spec.block_shape), spec.dtype, dev)
    _check_separate(name, buf, cache)
    return cache, ids, buf, start, stop, be, on_device


def gather_blocks(cache: PagedKVCache, block_ids: Any, out: Any, layers: Any = None, *,
                  backend: str = "auto", max_ctas: int | None = None,
                  validate: bool = True, out_spec: Any = None, out_scales: Any = None,
                  num_tokens: Any = None, head_start: Any = None,
                  digest: Any = None) -> torch.Tensor:
    """Copy blocks of a paged cache into a contiguous staging buffer.

    Parameters
    ----------
    cache : PagedKVCache
        Source cache.
    block_ids : torch.Tensor, int32 or int64, shape [n]
        Physical block ids to read, in the order they land in ``out``; -1 skips the slot.
    out : torch.Tensor, shape ``staging_shape(cache.spec, n, layers)``, dtype ``cache.spec.dtype``
        ``out[l, t, i] = tensor t of layer (start + l) at block block_ids[i]``; contiguous, on
        the cache's device (see :func:`kvflow.staging_buffer`).
    layers : None, int, range, slice or (start, stop)
        Layer range (default: all layers).
    backend : str
        ``"auto"``, ``"torch"``, ``"numba"``, ``"triton"``, ... (see ``available_backends()``).
    max_ctas : int, optional
        GPU backends: cap on the grid (programs), for copies that run beside compute.
    validate : bool
        Check id values (range; distinct destinations): ids on the host are checked before
        any kernel runs; ids on a GPU are checked by the ``triton`` kernel on the device and
        reported by the next call or :func:`kvflow.kernels.check_errors` (no sync here); see
        :mod:`kvflow.kernels.validate`. False skips the checks (bad ids are still skipped).
    out_spec, out_scales, num_tokens, head_start : optional
        A staging buffer of another spec (re-blocking, :mod:`kvflow.kernels.reblock`): ``out``
        has shape ``staging_shape(out_spec, m, layers)`` and its block ``i`` holds tokens
        ``[i * out_spec.block_size, ...)`` of the sequence whose block table is ``block_ids``;
        ``num_tokens`` defaults to all both hold; fp8 ``out_spec`` takes float32
        ``out_scales`` of shape ``[tensors]`` or ``[tensors, m, num_kv_heads]`` (written when
        per block per head); ``head_start`` as in :func:`copy_sequence`. Without ``out_spec``,
        a cache of fp8 ``scales="block_head"`` needs ``out_scales`` float32
        ``[tensors, n, num_kv_heads]``: slot ``i`` gets the scales of block ``block_ids[i]``
        (:mod:`kvflow.kernels.block_scales`); other specs take none.
    digest : torch.Tensor, int32, shape [n], optional
        Also write ``digest[i]``, the digest of the bytes slot ``i`` received over the layer
        range (0 for a skipped id), defined by :func:`kvflow.kernels.block_digest`
        (:mod:`kvflow.kernels.digest`); ``triton`` and ``numba`` compute it in the copy's own
        launch, other backends with the torch reference after the copy. Equal specs only; on
        the cache's device.

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        Bad argument, naming it and its value; RuntimeError for an unavailable backend.
    """
    if out_spec is not None or num_tokens is not None or head_start is not None:
        _digest.no_reblock(digest)
        return _staged_reblocked(cache, block_ids, out, layers, True, out_spec, out_scales,
                                 backend, max_ctas, validate, num_tokens, head_start)
    cache, ids, out, start, stop, be, on_device = _staged(cache, block_ids, "out", out, layers,
                                                          backend, validate, unique=False)
    n = ids.shape[0]
    spec = cache.spec
    if out_scales is not None or per_block(spec):
        out_scales = check_stage_scales("out", out_scales, spec, (
            (stop - start) * spec.tensors_per_layer, n, spec.num_kv_heads), cache.device)
    if max_ctas is not None:
        max_ctas = _check_max_ctas(max_ctas)
    if digest is not None:
        digest = _digest.check_digest(digest, n, cache.device, spec)
    if n:
        kw = {} if digest is None or not getattr(be, "digests", False) else {"digest": digest}
        if on_device:
            kw["check"] = True
        be.gather(cache, ids, out, start, stop, max_ctas, **kw)
        if digest is not None and "digest" not in kw:
            _digest.gathered(cache, ids, out, start, digest)
        if out_scales is not None:
            tpl = spec.tensors_per_layer
            move_scales(cache.scales[start * tpl:stop * tpl], out_scales, ids,
                        torch.arange(n, device=ids.device))
    return out


def scatter_blocks(src: Any, cache: PagedKVCache, block_ids: Any, layers: Any = None, *,
                   backend: str = "auto", max_ctas: int | None = None,
                   validate: bool = True, src_spec: Any = None, src_scales: Any = None,
                   num_tokens: Any = None, head_start: Any = None,
                   digest: Any = None) -> PagedKVCache:
    """Copy a contiguous staging buffer into blocks of a paged cache (inverse of gather).

    Parameters
    ----------
    src : torch.Tensor, shape ``staging_shape(cache.spec, n, layers)``
        As the ``out`` of :func:`gather_blocks`.
    cache : PagedKVCache
        Destination cache.
    block_ids : torch.Tensor, int32 or int64, shape [n]
        Destination block of each slot of ``src``; distinct, -1 skips the slot.
    layers, backend, max_ctas, validate
        As :func:`gather_blocks`.
    src_spec, src_scales, num_tokens, head_start : optional
        A staging buffer of another spec, as ``out_spec`` ... of :func:`gather_blocks`.
        Without ``src_spec``, a cache of fp8 ``scales="block_head"`` needs ``src_scales``
        float32 ``[tensors, n, num_kv_heads]``, written to the scales of block
        ``block_ids[i]``.
    digest : torch.Tensor, int32, shape [n], optional
        Also write ``digest[i]``, the digest of slot ``i`` of ``src`` as written (0 where
        ``block_ids[i]`` is skipped), as ``digest`` of :func:`gather_blocks`: a block gathered
        with a digest and scattered with one gives equal digests iff its bytes arrived intact
        (with the bounds of :mod:`kvflow.kernels.digest`).

    Returns
    -------
    PagedKVCache
        ``cache``.
    """
    if src_spec is not None or num_tokens is not None or head_start is not None:
        _digest.no_reblock(digest)
        if src_spec is None:
            src_spec = getattr(cache, "spec", None)
        _staged_reblocked(cache, block_ids, src, layers, False, src_spec, src_scales, backend,
                          max_ctas, validate, num_tokens, head_start)
        return cache
    cache, ids, src, start, stop, be, on_device = _staged(cache, block_ids, "src", src, layers,
                                                          backend, validate, unique=True)
    n = ids.shape[0]
    spec = cache.spec
    if src_scales is not None or per_block(spec):
        src_scales = check_stage_scales("src", src_scales, spec, (
            (stop - start) * spec.tensors_per_layer, n, spec.num_kv_heads), cache.device)
    if max_ctas is not None:
        max_ctas = _check_max_ctas(max_ctas)
    if digest is not None:
        digest = _digest.check_digest(digest, n, cache.device, spec)
    if n:
        kw = {} if digest is None or not getattr(be, "digests", False) else {"digest": digest}
        if on_device:
            kw["check"] = True
        be.scatter(src, cache, ids, start, stop, max_ctas, **kw)
        if digest is not None and "digest" not in kw:
            _digest.scattered(src, cache, ids, start, digest)
        if src_scales is not None:
            tpl = spec.tensors_per_layer
            move_scales(src_scales, cache.scales[start * tpl:stop * tpl],
                        torch.arange(n, device=ids.device), ids)
    return cache


def _staged_reblocked(cache, block_ids, buf, layers, to_stage, spec, scales, backend, max_ctas,
                      validate, num_tokens, head_start):
    """gather / scatter with a staging buffer of another spec (:mod:`.reblock_ops`)."""
    from .reblock_ops import staged_reblocked
    if type(cache) is not PagedKVCache:
        cache = check_cache("cache", cache)
    _check_validate(validate, cache.device)
    if spec is None:
        spec = cache.spec
    if max_ctas is not None:
        max_ctas = _check_max_ctas(max_ctas)
    staged_reblocked(cache, block_ids, buf, layers, to_stage=to_stage, stage_spec=spec,
                     stage_scales=scales, backend=backend, max_ctas=max_ctas,
                     validate=validate, num_tokens=num_tokens, head_start=head_start)
    return buf


def payload_bytes(spec, num_blocks: int, layers: Any = None) -> int:
    """Bytes an op moves for ``num_blocks`` (non-padding) blocks over a layer range."""
    start, stop = normalize_layers(layers, spec.num_layers)
    return num_blocks * spec.block_bytes * spec.tensors_per_layer * (stop - start)
