"""One Triton kernel for gather, scatter and copy_blocks: copy runs of bytes between tables.

Layout: one block of one per-layer tensor is ``spec.block_bytes`` contiguous bytes in every
layout (NHD, HND, MLA, block-major BM_NHD), so every op is "copy run ``src_id`` of source tensor
``j`` to run ``dst_id`` of destination tensor ``j``"; block ``b`` of a cache tensor starts
``b * spec.block_stride_bytes`` after the tensor's base (``block_bytes`` unless block-major).
A cache side is an int64 table of per-tensor base
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
Constexprs (word type, alignment, run length) are fixed per cache; every address (tables,
staging buffers, ids) and the pair count ``n`` are runtime int64/int32 values that are never
specialised on, so a new request size or buffer never recompiles and one compiled kernel per
launch plan (:mod:`.launch`) serves every call.

Checks (``CHECK``): one work item per pair (tensor 0, chunk 0), after its copy so that the
checks' memory traffic never delays it, records into the device's error record
(:mod:`kvflow.kernels.errors`) an id outside ``[-1, num_blocks)`` (that pair was skipped like
padding) and, with ``DUP``, a destination id already stamped with this call's number (a
per-cache int32 array, :func:`kvflow.kernels.tables.stamps`), or with ``SHARED`` a source id
stamped as a destination (copies within one cache; both leave undefined content).

Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (CI); the int64 -> pointer cast
works in both the interpreter and the compiler.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import triton
import triton.language as tl


def _copy_runs(src_table, dst_table, src_stage, dst_stage, src_ids, dst_ids,
               n, src_n, dst_n, total, errors, ready, stamps, call, op, digest, tensor0,
               WORD: tl.constexpr, ALIGN: tl.constexpr, RUN: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
               SRC_CACHE: tl.constexpr, DST_CACHE: tl.constexpr, STREAM: tl.constexpr,
               SRC_I64: tl.constexpr, DST_I64: tl.constexpr, CHECK: tl.constexpr,
               DUP: tl.constexpr, SHARED: tl.constexpr, STAMP_ONLY: tl.constexpr,
               DIGEST: tl.constexpr, WPW: tl.constexpr, STORE: tl.constexpr,
               SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr):
    """Copy ``total`` work items; see the module docstring. RUN, CHUNK, BLOCK are in words;
    every pointer argument is an int64 address (so a new buffer never recompiles).
    ``SRC_STRIDE`` / ``DST_STRIDE``: words from one block of a cache side's tensor to the next
    (``RUN`` in layer-major layouts, ``spec.block_stride_bytes`` in block-major ones).

    Copies within one cache take two launches: ``STAMP_ONLY`` (one item per pair: check and
    stamp the destination ids, copy nothing), then the copy with ``SHARED``, which reports a
    pair whose source block carries this call's stamp (it is also a destination).

    ``DIGEST``: each valid item also adds the digest of the words it moved
    (:mod:`kvflow.kernels.digest`; ``WPW`` 32-bit words per ``WORD``, 1 or 2) into the int32
    ``digest[i]`` of its pair with one wrapping integer atomic add (order-independent, relaxed:
    no fence, so a program never waits for its own stores before it ends); positions count
    from the cache's tensor 0 (``tensor0``: the layer range's first tensor). ``STORE`` False
    (a digest-only launch of a cache side, :func:`kvflow.kernels.digest.digest_blocks`):
    the words are read and digested, nothing is written."""
    NCHUNK: tl.constexpr = (RUN + CHUNK - 1) // CHUNK
    ar = tl.arange(0, BLOCK)
    err = errors.to(tl.pointer_type(tl.int64))
    free = tl.full([], 0, tl.int64)  # the record's lock word: 0 free, 1 taken
    taken = tl.full([], 1, tl.int64)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        if STAMP_ONLY:
            c = 0
            i = w
            j = 0
        else:
            c = w % NCHUNK
            r = w // NCHUNK
            i = r % n
            j = r // n
        valid = i >= 0
        first = (j == 0) & (c == 0)  # one work item per pair checks and reports its ids
        if SRC_CACHE:
            if SRC_I64:
                s = tl.load(src_ids.to(tl.pointer_type(tl.int64)) + i)
            else:
                s = tl.load(src_ids.to(tl.pointer_type(tl.int32)) + i).to(tl.int64)
            in_src = (s >= 0) & (s < src_n)
            valid = valid & in_src
            base = tl.load(src_table.to(tl.pointer_type(tl.int64)) + j).to(tl.pointer_type(WORD))
            sp = base + s * SRC_STRIDE
        else:
            sp = src_stage.to(tl.pointer_type(WORD)) + (j.to(tl.int64) * n + i) * RUN
        if DST_CACHE:
            if DST_I64:
                d = tl.load(dst_ids.to(tl.pointer_type(tl.int64)) + i)
            else:
                d = tl.load(dst_ids.to(tl.pointer_type(tl.int32)) + i).to(tl.int64)
            in_dst = (d >= 0) & (d < dst_n)
            valid = valid & in_dst
            base = tl.load(dst_table.to(tl.pointer_type(tl.int64)) + j).to(tl.pointer_type(WORD))
            dp = base + d * DST_STRIDE
        elif STORE:
            dp = dst_stage.to(tl.pointer_type(WORD)) + (j.to(tl.int64) * n + i) * RUN
        else:  # digest only: no destination, nothing is written
            dp = sp
        if STAMP_ONLY:
            valid = False
        if valid:
            sp = tl.multiple_of(sp + c * CHUNK, ALIGN)
            dp = tl.multiple_of(dp + c * CHUNK, ALIGN)
            if DIGEST:  # 32-bit lanes: one multiply, add and or per 32-bit word
                acc = tl.zeros([BLOCK], tl.uint32)
                lane_c = ((ar.to(tl.int64) * WPW * 0x9E3779B1) & 0xFFFFFFFF).to(tl.uint32)
                step_c = tl.full([], 0x9E3779B1, tl.int64).to(tl.uint32)
            for k in range(0, CHUNK, BLOCK):
                offs = k + ar
                if EVEN:
                    if STREAM:
                        v = tl.load(sp + offs, eviction_policy="evict_first")
                        if STORE:
                            tl.store(dp + offs, v, cache_modifier=".cs")
                    else:
                        v = tl.load(sp + offs)
                        if STORE:
                            tl.store(dp + offs, v)
                else:
                    m = c * CHUNK + offs < RUN
                    if STREAM:
                        v = tl.load(sp + offs, mask=m, other=0, eviction_policy="evict_first")
                        if STORE:
                            tl.store(dp + offs, v, mask=m, cache_modifier=".cs")
                    else:
                        v = tl.load(sp + offs, mask=m, other=0)
                        if STORE:
                            tl.store(dp + offs, v, mask=m)
                if DIGEST:  # kvflow.kernels.digest: sum of word * m(pos), mod 2**32
                    p0 = ((j.to(tl.int64) + tensor0) * RUN + c * CHUNK + k) * WPW
                    pc = ((p0 * 0x9E3779B1) & 0xFFFFFFFF).to(tl.uint32) + lane_c  # p * C
                    acc += v.to(tl.uint32) * (pc | 1)  # the low word (or the only one)
                    if WPW == 2:
                        acc += (v >> 32).to(tl.uint32) * ((pc + step_c) | 1)
            if DIGEST:
                total = tl.sum(acc, axis=0).to(tl.int32, bitcast=True)
                tl.atomic_add(digest.to(tl.pointer_type(tl.int32)) + i, total, sem="relaxed")
        if CHECK:  # after the copy, so the checks' memory traffic never delays it
            if first:
                code = tl.full([], -1, tl.int32)  # op * 16 + side * 4 + kind (kernels/errors.py)
                value = tl.full([], 0, tl.int64)
                limit = tl.full([], 0, tl.int32)
                if SRC_CACHE:
                    if (s < -1) | (s >= src_n):
                        code, value, limit = op * 16, s, src_n
                    if SHARED:
                        if in_src:
                            if tl.load(stamps.to(tl.pointer_type(tl.int32)) + s) == call:
                                code, value, limit = op * 16 + 2, s, src_n
                if DST_CACHE:
                    if (d < -1) | (d >= dst_n):
                        code, value, limit = op * 16 + 4, d, dst_n
                    if DUP:
                        if in_dst:
                            if tl.atomic_xchg(stamps.to(tl.pointer_type(tl.int32)) + d, call) == call:
                                code, value, limit = op * 16 + 5, d, dst_n
                if code >= 0:
                    if tl.atomic_cas(err, free, taken) == 0:
                        tl.store(err + 1, code)
                        tl.store(err + 2, i)
                        tl.store(err + 3, value)
                        tl.store(err + 4, limit)
                        tl.store(ready.to(tl.pointer_type(tl.int64)), 1)


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


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_JIT: dict[bool, Any] = {}
# Runtime ints that change per call: never specialise on them (a value of 1 would become a
# constant and the compiled kernel would be wrong for the next call), so one compile serves all.
_RUNTIME = ("src_table", "dst_table", "src_stage", "dst_stage", "src_ids", "dst_ids", "n",
            "src_n", "dst_n", "total", "errors", "ready", "stamps", "call", "op", "digest", "tensor0")


def kernel():
    """The jitted kernel; built on first use (so the interpreter flag is read at run time)."""
    mode = interpreting()
    if mode not in _JIT:
        _JIT[mode] = triton.jit(_copy_runs, do_not_specialize=list(_RUNTIME))
    return _JIT[mode]
