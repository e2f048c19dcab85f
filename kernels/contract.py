"""The backend contract: what the checked ops of :mod:`kvflow.kernels.ops` call, with what, and
what a backend guarantees in return. :mod:`kvflow.kernels.registry` holds the backends;
tests/kernels/test_kernel_contract.py checks every registered one against this module.

A backend (:class:`Backend`) is an object with

- ``name`` (str) and ``devices`` (set of device types it runs on, e.g. ``{"cpu"}``);
- ``unavailable_reason() -> str | None``: None when it can run in this process;
- ``gather(cache, ids, out, start, stop, max_ctas)``: ``out[l, t, i]`` = tensor ``t`` of layer
  ``start + l`` at block ``ids[i]``;
- ``scatter(src, cache, ids, start, stop, max_ctas)``: the inverse, block ``ids[i]`` of tensor
  ``t`` of layer ``start + l`` = ``src[l, t, i]``;
- ``copy(src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas)``: block pairs between
  caches of one spec, block ``src_ids[i]`` to block ``dst_ids[i]`` of every tensor of the range.

What the ops guarantee to the backend (checked before the call): caches are
:class:`~kvflow.cache.PagedKVCache` (``copy``: of equal specs); ids are 1-D int32 or int64
tensors of ``n >= 1`` ids on the device the kernel runs on (``copy`` with ``direction="push"``:
the destination's device, the backend moves them); ``out`` / ``src`` are contiguous staging
buffers of shape ``staging_shape(spec, n, (start, stop))`` and ``spec.dtype`` on the cache's
device, separate from the cache's memory; ``0 <= start < stop <= spec.num_layers`` (a half-open
range of layers); ``max_ctas`` is None or a positive int (a grid cap; CPU backends ignore it).
With ``validate=True`` (the default) destination ids are distinct and every id is in
``[-1, num_blocks)`` (ids on a GPU: see ``device_checks``); ``validate=False`` checks neither.

What the backend guarantees: the bytes of every block named by a valid id move unchanged; an
id outside ``[0, num_blocks)`` (the -1 padding among them) skips its slot or pair and leaves
the destination untouched; nothing else is written. A GPU backend may return before its kernel
ends (enqueued on the current stream of the device it runs on, no host synchronisation). The
per-block scales of fp8 ``scales="block_head"`` caches are moved by the ops
(:mod:`kvflow.kernels.block_scales`), not by the backend.

Optional capabilities, each an attribute and the keywords the ops then pass:

- ``device_checks = True``: ``check=True`` when ids on a GPU are to be validated; the kernel
  checks them on the device and records the first bad one (:mod:`kvflow.kernels.errors`);
  ``copy`` also gets ``same=True`` when both caches are one. Other backends get ids whose
  values were already checked on the host.
- ``digests = True``: ``digest=`` (int32 ``[n]``) on all three ops, written as
  :func:`kvflow.kernels.block_digest` defines, in the copy's own pass; without it the ops
  compute the digest with the torch reference after the copy.
- ``directions`` containing ``"push"``: ``copy`` takes ``direction="pull" | "push"`` (the kernel
  runs on the destination's or on the source's GPU).
- ``block_strides = True``: the backend steps ``spec.block_stride_bytes`` between blocks of a
  cache tensor (block-major ``BM_NHD``); the ops refuse a block-major cache on others.
- ``reblock(job, max_ctas, check)`` (:class:`Reblocker`): the re-blocked ops
  (:func:`kvflow.kernels.copy_sequence`, gather / scatter with a staging buffer of another
  spec) on a checked :class:`Job`; the result equals
  :func:`kvflow.kernels.reference_reblock.reblock`'s byte for byte (NaN and infinite inputs
  aside).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from .reblock import Mapping


@runtime_checkable
class Backend(Protocol):
    """The three block-pair ops of one backend (see the module docstring)."""

    name: str
    devices: set[str]

    def unavailable_reason(self) -> str | None: ...

    def gather(self, cache: Any, ids: torch.Tensor, out: torch.Tensor, start: int, stop: int,
               max_ctas: int | None = None) -> None: ...

    def scatter(self, src: torch.Tensor, cache: Any, ids: torch.Tensor, start: int, stop: int,
                max_ctas: int | None = None) -> None: ...

    def copy(self, src_cache: Any, dst_cache: Any, src_ids: torch.Tensor, dst_ids: torch.Tensor,
             start: int, stop: int, max_ctas: int | None = None) -> None: ...


@runtime_checkable
class Reblocker(Protocol):
    """A backend that also runs re-blocked ops (different specs, a partial block)."""

    def reblock(self, job: "Job", max_ctas: int | None = None, check: bool = False) -> None: ...


@dataclasses.dataclass
class Operand:
    """One side of a re-blocked op, already checked (:mod:`kvflow.kernels.reblock_ops`).

    ``cache`` with ``ids`` (a block table, int32/int64 on the kernel's device), or ``stage``
    (a contiguous staging buffer of ``num_blocks`` blocks per tensor, block ``i`` of the
    sequence in slot ``i``, ``ids`` None). ``j0``: the first per-layer tensor of the range in
    ``cache.tensors()`` order (0 for a stage); ``scales``: the side's float32 scales, the
    whole tensor (fp8 only, else None)."""

    spec: Any
    cache: Any
    stage: torch.Tensor | None
    ids: torch.Tensor | None
    num_blocks: int
    j0: int
    scales: torch.Tensor | None


@dataclasses.dataclass
class Job:
    """A checked re-blocked copy: ``ntensors`` per-layer tensors from ``src`` to ``dst``,
    tokens ``0 .. num_tokens - 1`` of the sequence, as ``mapping`` says
    (:class:`~kvflow.kernels.reblock.Mapping`)."""

    mapping: Mapping
    src: Operand
    dst: Operand
    ntensors: int
    num_tokens: int


# How the ops call each method: positional arguments, then the keywords of each capability.
_CALLS = {"gather": 6, "scatter": 6, "copy": 7}


def _keywords(backend: Any, method: str) -> list[str]:
    kw = []
    if getattr(backend, "device_checks", False):
        kw += ["check"] + (["same"] if method == "copy" else [])
    if getattr(backend, "digests", False):
        kw.append("digest")
    if method == "copy" and "push" in getattr(backend, "directions", ("pull",)):
        kw.append("direction")
    return kw


def contract_problems(backend: Any) -> list[str]:
    """What ``backend`` lacks of the contract (empty when it meets it): a missing attribute or
    method, or a method that cannot be called as the ops call it (positional arguments, plus
    the keywords its capabilities add; ``reblock(job, max_ctas, check=...)`` when defined)."""
    out = [f"no attribute {a!r}" for a in ("name", "devices") if not hasattr(backend, a)]
    if hasattr(backend, "devices") and not (isinstance(backend.devices, (set, frozenset))
                                            and all(isinstance(d, str) for d in backend.devices)):
        out.append(f"devices must be a set of device types, got {backend.devices!r}")
    calls = dict(_CALLS, unavailable_reason=0)
    if hasattr(backend, "reblock"):
        calls["reblock"] = 2
    for method, npos in calls.items():
        fn = getattr(backend, method, None)
        if not callable(fn):
            out.append(f"no method {method}()")
            continue
        kw = {k: None for k in _keywords(backend, method)} if method in _CALLS else {}
        if method == "reblock":
            kw = {"check": False}
        try:
            inspect.signature(fn).bind(*[None] * npos, **kw)
        except TypeError as exc:
            out.append(f"{method}() cannot be called with {npos} positional arguments"
                       + (f" and {', '.join(kw)}=" if kw else "") + f": {exc}")
    return out
