"""Launch plans: the copy kernel's settings worked out once, so a call only fills in addresses.

A :class:`Plan` holds everything that is fixed for one (op, cache or cache pair, layer range,
id dtypes, checks, alignment, ``max_ctas``): word type, run, chunk and block lengths, warps, the
grid rule and, after its first launch on a GPU, the compiled kernel itself. Later calls launch
that compiled kernel directly (``CompiledKernel[grid](*args, stream=...)``) and skip Triton's
per-call argument binding and specialisation, which is most of a Triton launch's host time
(issue #16: 57 us per kvflow call against 9 us for a bare launch). Plans live in the cache's
``backend_state`` (see :mod:`kvflow.kernels.triton`). Launches after the first do not call
Triton's launch hooks (``triton.knobs.runtime.launch_enter_hook``, used by profilers).
"""

from __future__ import annotations

from typing import Any

import torch

from . import copy_runs as _cr

_WORDS = {8: _cr.tl.int64, 4: _cr.tl.int32, 2: _cr.tl.int16, 1: _cr.tl.uint8}
_SMS: dict[int, int] = {}
MAX_ITEMS = 2 ** 31


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the interpreter, which runs programs one
    after another)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def current_config() -> Any:
    """The :class:`~.copy_runs.LaunchConfig` in force (the launch sweep swaps it); a plan made
    under another one is rebuilt."""
    return _cr.CONFIG


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)  # what Triton's own launcher reads


def _get_device() -> int:
    return torch._C._cuda_getDevice()


class Plan:
    """One launch shape of the copy kernel (see the module docstring).

    Parameters
    ----------
    device : torch.device
        Where the kernel runs.
    run_bytes, align : int
        Bytes per run (``spec.block_bytes``) and the common alignment of every base address.
    num_tensors : int
        Per-layer tensors in the layer range (layers x tensors per layer).
    src_cache, dst_cache : bool
        Which sides are caches (with ids); the others are staging buffers.
    src_i64, dst_i64 : bool
        Id dtypes (int64 when True, else int32).
    check, dup : bool
        Record bad ids on the device; also repeated destination ids.
    shared, stamp_only : bool
        Copies within one cache: the copy that skips pairs whose source is stamped, and the
        launch before it that only stamps (one work item per pair).
    max_ctas : int or None
        Grid cap; None fills the GPU.
    src_stride, dst_stride : int or None
        Bytes from one block of a cache side's tensor to the next
        (``spec.block_stride_bytes``); None: ``run_bytes`` (layer-major layouts).
    digest : bool
        Also add each pair's digest (:mod:`kvflow.kernels.digest`) into the ``digest`` array
        of :meth:`launch`; needs 4- or 8-byte words (``align >= 4``).
    store : bool
        False: a digest-only launch (``digest`` True, a cache source, no destination): the
        words are read and digested, nothing is written.
    """

    def __init__(self, *, device: torch.device, run_bytes: int, align: int, num_tensors: int,
                 src_cache: bool, dst_cache: bool, src_i64: bool, dst_i64: bool, check: bool,
                 dup: bool, max_ctas: int | None, config: Any = None, shared: bool = False,
                 stamp_only: bool = False, digest: bool = False, store: bool = True,
                 src_stride: int | None = None, dst_stride: int | None = None) -> None:
        cfg = self.config = config or _cr.CONFIG
        word = min(align, 8)
        if digest and word < 4:
            raise ValueError(f"a digest launch needs 4-byte aligned runs, got alignment {align}")
        if not store and not (digest and src_cache and not dst_cache):
            raise ValueError("store=False is a digest-only launch: digest=True, a cache source "
                             "and no destination")
        run = run_bytes // word
        sms = sm_count(device)
        capped = max_ctas is not None and max_ctas < sms
        both = src_cache and dst_cache  # copy_blocks
        step, warps = (cfg.capped_block_bytes, cfg.capped_num_warps) if capped else \
            (cfg.copy_block_bytes if both else cfg.block_bytes, cfg.num_warps)
        block = max(4, min(_cr.triton.next_power_of_2(run), step // word))
        chunk_bytes = cfg.copy_chunk_bytes if both else cfg.chunk_bytes
        chunk = block * max(1, min(-(-run // block), chunk_bytes // word // block))
        self.device, self.warps = device, warps
        self.index = device.index if device.type == "cuda" else None
        # work items per pair of ids
        self.per_pair = 1 if stamp_only else num_tensors * (-(-run // chunk))
        self.limit = max_ctas or (cfg.ctas_per_sm * sms if cfg.persistent else None)
        self.consts = dict(WORD=_WORDS[word], ALIGN=align, RUN=run, CHUNK=chunk, BLOCK=block,
                           EVEN=run % chunk == 0, SRC_CACHE=src_cache, DST_CACHE=dst_cache,
                           STREAM=cfg.capped_streaming if capped else cfg.streaming,
                           SRC_I64=src_i64, DST_I64=dst_i64, CHECK=check, DUP=dup,
                           SHARED=shared, STAMP_ONLY=stamp_only, DIGEST=digest,
                           WPW=2 if word == 8 else 1, STORE=store,
                           SRC_STRIDE=(src_stride or run_bytes) // word,
                           DST_STRIDE=(dst_stride or run_bytes) // word)
        self.const_values = tuple(self.consts.values())
        self.compiled = None

    def launch(self, src_table: int, dst_table: int, src_stage: int, dst_stage: int,
               src_ids: int, dst_ids: int, n: int, src_n: int, dst_n: int, errors: int,
               ready: int, stamps: int, call: int, op: int, digest: int = 0,
               tensor0: int = 0) -> None:
        """Enqueue one copy of ``n`` pairs on the device's current stream (no wait).

        Every address is an int (0 for a side that is not used; ``digest``: an int32 array
        of ``n``, zeroed by the caller, when the plan digests; ``tensor0``: the cache tensor
        the layer range starts at, for the digest's positions). Raises ValueError when the
        work items would overflow the kernel's int32 index."""
        total = self.per_pair * n
        if total >= MAX_ITEMS:
            raise ValueError(f"{total} work items exceed the kernel's int32 index; split the call")
        grid = total if self.limit is None or total < self.limit else self.limit
        k = self.compiled
        if k is not None and _get_device() == self.index:  # the common case, kept short
            # The call Triton's JIT makes after binding (runtime/jit.py), without launch
            # metadata or hooks: (grid, stream, function, packed metadata, ..., all args).
            k.run(grid, 1, 1, _raw_stream(self.index), k.function, k.packed_metadata, None,
                  None, None, src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids, n,
                  src_n, dst_n, total, errors, ready, stamps, call, op, digest,
                  tensor0, *self.const_values)
            return
        args = (src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids, n, src_n, dst_n,
                total, errors, ready, stamps, call, op, digest, tensor0)
        if self.index is None:  # Triton's interpreter: no compiled kernel to keep
            _cr.kernel()[(grid,)](*args, **self.consts, num_warps=self.warps)
            return
        prev = _get_device()
        torch.cuda.set_device(self.index)
        try:
            if self.compiled is None:
                self.compiled = _cr.kernel()[(grid,)](*args, **self.consts, num_warps=self.warps)
            else:
                k = self.compiled
                k.run(grid, 1, 1, _raw_stream(self.index), k.function, k.packed_metadata, None,
                      None, None, *args, *self.const_values)
        finally:
            torch.cuda.set_device(prev)
