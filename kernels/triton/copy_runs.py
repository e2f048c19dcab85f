"""One Triton kernel for gather, scatter and copy_blocks: copy runs of bytes between tables.

Layout: one block of one per-layer tensor is ``spec.block_bytes`` contiguous bytes in every
layout (NHD, HND, MLA), so every op is "copy run ``src_id`` of source tensor ``j`` to run
``dst_id`` of destination tensor ``j``". A cache side is an int64 table of per-tensor base
addresses (built once per cache and device, see :func:`cache_table`); a staging side is one
buffer whose run ``(j, i)`` starts at ``(j * n + i) * run`` words (``staging_shape`` order).

Grid: 1-D; program ``p`` walks work items ``w = p, p + G, p + 2G, ...`` over
(tensor ``j``) x (pair ``i``) x (chunk ``c`` of ``CHUNK`` words), chunk fastest, so programs
that run at the same time stream neighbouring bytes. By default ``G`` is the number of work
items (one program each, the hardware schedules them); ``max_ctas`` caps it (background copies
beside prefill), and then each program loops. Pairs whose cache-side id is
outside ``[0, num_blocks)`` (the -1 padding included) are skipped: destination untouched.

Words: bytes are moved as int64/int32/int16/uint8 words (whatever divides the run and every base
address), and pointers carry a ``tl.multiple_of`` hint of the common alignment (16 bytes when
possible), so on sm_90 the body compiles to 128-bit ``ld.global.v2.b64`` / ``st.global.v2.b64``.
Constexprs (word type, alignment, run length) are fixed per cache; the pair count ``n`` and the
layer range are runtime values, so a new request size never recompiles.

Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (CI); the int64 -> pointer cast
works in both the interpreter and the compiler.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

import triton
import triton.language as tl

from ..tables import alignment, device_table as cache_table  # noqa: F401 (re-exported)


def _copy_runs(src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids,
               n, src_n, dst_n, total,
               WORD: tl.constexpr, ALIGN: tl.constexpr, RUN: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
               SRC_CACHE: tl.constexpr, DST_CACHE: tl.constexpr, STREAM: tl.constexpr):
    """Copy ``total`` work items; see the module docstring. RUN, CHUNK, BLOCK are in words."""
    NCHUNK: tl.constexpr = (RUN + CHUNK - 1) // CHUNK
    ar = tl.arange(0, BLOCK)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        c = w % NCHUNK
        r = w // NCHUNK
        i = r % n
        j = r // n
        valid = i >= 0
        if SRC_CACHE:
            s = tl.load(src_ids + i).to(tl.int64)
            valid = valid & (s >= 0) & (s < src_n)
            base = tl.load(src_table + j).to(tl.pointer_type(WORD))
            sp = base + s * RUN
        else:
            sp = src_stage + (j.to(tl.int64) * n + i) * RUN
        if DST_CACHE:
            d = tl.load(dst_ids + i).to(tl.int64)
            valid = valid & (d >= 0) & (d < dst_n)
            base = tl.load(dst_table + j).to(tl.pointer_type(WORD))
            dp = base + d * RUN
        else:
            dp = dst_stage + (j.to(tl.int64) * n + i) * RUN
        if valid:
            sp = tl.multiple_of(sp + c * CHUNK, ALIGN)
            dp = tl.multiple_of(dp + c * CHUNK, ALIGN)
            for k in range(0, CHUNK, BLOCK):
                offs = k + ar
                if EVEN:
                    if STREAM:
                        v = tl.load(sp + offs, eviction_policy="evict_first")
                        tl.store(dp + offs, v, cache_modifier=".cs")
                    else:
                        tl.store(dp + offs, tl.load(sp + offs))
                else:
                    m = c * CHUNK + offs < RUN
                    if STREAM:
                        v = tl.load(sp + offs, mask=m, eviction_policy="evict_first")
                        tl.store(dp + offs, v, mask=m, cache_modifier=".cs")
                    else:
                        tl.store(dp + offs, tl.load(sp + offs, mask=m), mask=m)


@dataclasses.dataclass
class LaunchConfig:
    """Launch settings of the copy kernel, tuned on one H200 for the Llama-3-8B geometry.

    Source: the launch sweep (``python -m kvflow.bench sweep``; 5 interleaved repeats at 1K
    tokens, 2 at 4K and 16K, ratio to the same-run ``copy_``) of 2026-11-30,
    ``bench/results/raw/launch_sweep-round3-nvidia-h200-20261130.json``. With these defaults
    gather / scatter / copy_blocks reach 0.94 / 0.93 / 0.91 of the ceiling at 1K tokens,
    0.96 / 0.94 / 0.93 at 4K and 0.95 / 0.94 / 0.93 at 16K; a persistent grid at 4 warps gives
    0.91 / 0.91 / 0.88, 0.91 / 0.90 / 0.92 and 0.89 / 0.89 / 0.91. copy_blocks items and steps
    of 16-64 KiB (``bench/results/raw/launch_sweep-round4-nvidia-h200x2-20261130.json``) gain
    0.02 for MLA bf16 at 1K and 0.005 for fp8 but lose 0.01 for bf16 NHD/HND at 4K and 16K, so
    the defaults stay those of the Llama-3-8B geometry.

    Attributes
    ----------
    block_bytes : int
        Bytes one gather / scatter program moves per loop step (``BLOCK`` words). 16 KiB at
        16 warps is two 16-byte loads per thread; 8 KiB and 32 KiB were 0.01 lower, 32 warps
        0.05-0.07 lower.
    chunk_bytes : int
        Work item size of gather and scatter; a run longer than this is split into chunks.
        16 KiB (one loop step) measured best.
    copy_block_bytes : int
        Loop step of copy_blocks: 64 KiB (eight 16-byte loads per thread at 16 warps);
        +0.01 over 16 KiB at 1K tokens.
    copy_chunk_bytes : int
        Work item size of copy_blocks, which reads two ids and two table entries per item
        before its first load: whole runs (up to 128 KiB) amortise them (32 KiB items: -0.02
        at 4K and 16K tokens).
    ctas_per_sm : int
        Programs per SM of a persistent grid (``persistent=True``; 16: 0.89-0.91 of the copy
        ceiling vs 0.73-0.75 at 1).
    num_warps : int
        Warps per program on full-grid launches: 16 (+0.02-0.03 over 4 and 8 warps for gather
        and scatter, +0.01 for copy_blocks).
    capped_block_bytes, capped_num_warps : int
        ``block_bytes`` and ``num_warps`` when ``max_ctas`` caps the grid below one program
        per SM (background copies): fewer programs must each keep more bytes in flight
        (64 KiB per step at 16 warps).
    streaming : bool
        Streaming cache hints on full-grid launches: loads ``evict_first``, stores ``.cs``.
        Off: on the H200 of 2026-11-30 they cost 3-5% of the ceiling at full grid.
    capped_streaming : bool
        The same hints on ``max_ctas``-capped launches (background copies beside a prefill:
        the bytes are touched once; keep them from evicting the prefill's working set in L2).
    persistent : bool
        Full-grid launches: True caps the grid at ``ctas_per_sm`` x SMs and lets each program
        loop over work items; False (default) launches one program per work item and lets the
        hardware schedule them (+0.02-0.04 at 4K and 16K tokens). ``max_ctas`` launches are
        always persistent.
    """

    block_bytes: int = 16384
    chunk_bytes: int = 16384
    copy_block_bytes: int = 65536
    copy_chunk_bytes: int = 131072
    ctas_per_sm: int = 16
    num_warps: int = 16
    capped_block_bytes: int = 65536
    capped_num_warps: int = 16
    streaming: bool = False
    capped_streaming: bool = True
    persistent: bool = False


CONFIG = LaunchConfig()
_WORD = {8: (torch.int64, tl.int64), 4: (torch.int32, tl.int32),
         2: (torch.int16, tl.int16), 1: (torch.uint8, tl.uint8)}
_JIT: dict[bool, Any] = {}
_SMS: dict[int, int] = {}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel():
    """The jitted kernel; built on first use (so the interpreter flag is read at run time)."""
    mode = interpreting()
    if mode not in _JIT:
        _JIT[mode] = triton.jit(_copy_runs)
    return _JIT[mode]


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def launch(*, src_table=None, dst_table=None, src_stage=None, dst_stage=None,
           src_ids=None, dst_ids=None, n: int, num_tensors: int, src_n: int, dst_n: int,
           run_bytes: int, align: int, device: torch.device, max_ctas: int | None,
           config: LaunchConfig | None = None) -> None:
    """Launch the kernel for ``num_tensors`` x ``n`` runs of ``run_bytes`` bytes.

    Exactly one of ``src_table`` / ``src_stage`` and one of ``dst_table`` / ``dst_stage`` is
    given; a table side needs its ids. ``align`` is the common alignment (bytes) of every base
    address and of ``run_bytes``. Runs on ``device``'s current stream; returns without waiting.
    """
    cfg = config or CONFIG
    word = min(align, 8)
    torch_word, tl_word = _WORD[word]
    run = run_bytes // word
    sms = _sm_count(device)
    capped = max_ctas is not None and max_ctas < sms
    both = src_table is not None and dst_table is not None  # copy_blocks
    step, warps = (cfg.capped_block_bytes, cfg.capped_num_warps) if capped else \
        (cfg.copy_block_bytes if both else cfg.block_bytes, cfg.num_warps)
    block = max(4, min(triton.next_power_of_2(run), step // word))
    chunk_bytes = cfg.copy_chunk_bytes if both else cfg.chunk_bytes
    chunk = block * max(1, min(-(-run // block), chunk_bytes // word // block))
    even = run % chunk == 0
    total = num_tensors * n * (-(-run // chunk))
    if total >= 2 ** 31:
        raise ValueError(f"{total} work items exceed the kernel's int32 index; split the call")
    limit = max_ctas or (cfg.ctas_per_sm * sms if cfg.persistent else total)
    grid = min(total, limit)

    def words(t):
        return t.view(-1).view(torch.uint8).view(torch_word) if t is not None else None

    args = (src_table, dst_table, words(src_stage), words(dst_stage), src_ids, dst_ids)
    with _on(device):
        kernel()[(grid,)](*args, n, src_n, dst_n, total,
                          WORD=tl_word, ALIGN=align, RUN=run, CHUNK=chunk, BLOCK=block,
                          EVEN=even, SRC_CACHE=src_table is not None,
                          DST_CACHE=dst_table is not None,
                          STREAM=cfg.capped_streaming if capped else cfg.streaming,
                          num_warps=warps)


class _on:
    """``torch.cuda.device(device)`` for CUDA devices; nothing for CPU (interpreter)."""

    def __init__(self, device: torch.device) -> None:
        self.ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False
