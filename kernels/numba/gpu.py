"""The ``numba_cuda`` backend: the triton backend's "copy runs" kernel written with numba-cuda.

A second GPU backend for comparison (docs/design.md, "Measuring": the Numba baselines). Same
work decomposition as :mod:`kvflow.kernels.triton.copy_runs`: a grid-stride loop of thread blocks
over (tensor ``j``) x (pair ``i``) x (chunk ``c``), one launch for all layers, cache sides read
as int64 base-address tables (built once per cache and device in ``cache.backend_state``),
staging sides as one base address plus ``(j * n + i) * block_bytes``; block ``b`` of a cache
tensor starts ``b * spec.block_stride_bytes`` after its base (block-major ``BM_NHD`` too). Inside a chunk the threads
of a block copy consecutive ``width``-byte words, where ``width`` (16, 8, 4, 2 or 1) is the
largest power of two dividing ``block_bytes`` and every base address; the 16-byte copy is an
LLVM ``<2 x i64>`` load/store with ``align 16`` (a 128-bit ``ld.global.v2``/``st.global.v2``).
Ids outside ``[0, num_blocks)`` (the -1 padding included) are skipped.

Needs the ``numba-cuda`` package and a CUDA GPU. With ``NUMBA_ENABLE_CUDASIM=1`` (set before
numba is imported) the backend runs in numba's CUDA simulator on CPU tensors instead, which
tests the indexing logic (slowly: keep shapes tiny); the 16-byte intrinsic is then replaced by
``ctypes.memmove``.
"""

from __future__ import annotations

import ctypes

import torch

from ..registry import register_backend
from ..tables import alignment as _alignment, device_table as _table

try:
    from numba import config as _config
    from numba import cuda
    _SIM = bool(_config.ENABLE_CUDASIM)
    _IMPORT_ERROR = None
except ImportError as exc:  # numba or numba-cuda missing
    cuda, _SIM, _IMPORT_ERROR = None, False, str(exc)

THREADS = 4 if _SIM else 256
CTAS_PER_SM = 4
CHUNK_BYTES = 65536
_KERNELS: dict[int, object] = {}


def _make_copies():
    """Device functions ``copy(dst_addr, src_addr)`` moving one word of each width."""
    if _SIM:
        def make(width):
            @cuda.jit(device=True)
            def copy(dst, src):
                ctypes.memmove(int(dst), int(src), width)
            return copy
        return {w: make(w) for w in (16, 8, 4, 2, 1)}

    from llvmlite import ir
    from numba.cuda.extending import intrinsic
    try:  # numba-cuda with its own type system re-exports the scalar types here
        from numba.cuda import types
        types.void, types.int64  # noqa: B018 - probe
    except (ImportError, AttributeError):
        from numba.core import types

    def make(width):
        ty = ir.VectorType(ir.IntType(64), 2) if width == 16 else ir.IntType(8 * width)

        @intrinsic
        def copy(typingctx, dst, src):
            def codegen(context, builder, signature, args):
                d = builder.inttoptr(args[0], ty.as_pointer(1))  # global
                s = builder.inttoptr(args[1], ty.as_pointer(1))
                builder.store(builder.load(s, align=width), d, align=width)
                return context.get_dummy_value()
            return types.void(types.int64, types.int64), codegen
        return copy
    return {w: make(w) for w in (16, 8, 4, 2, 1)}


def _kernel(width: int):
    """The copy kernel for one word width, compiled lazily (per argument types) on first use."""
    if width in _KERNELS:
        return _KERNELS[width]
    copy = _make_copies()[width]

    @cuda.jit
    def copy_runs(src_table, dst_table, src_ids, dst_ids, src_stage, dst_stage, n, src_n,
                  dst_n, run, chunk, nchunk, total, src_cache, dst_cache, src_step, dst_step):
        for w in range(cuda.blockIdx.x, total, cuda.gridDim.x):
            c = w % nchunk
            r = w // nchunk
            i = r % n
            j = r // n
            if src_cache:
                s = src_ids[i]
                if s < 0 or s >= src_n:
                    continue
                sa = src_table[j] + s * src_step
            else:
                sa = src_stage + (j * n + i) * run
            if dst_cache:
                d = dst_ids[i]
                if d < 0 or d >= dst_n:
                    continue
                da = dst_table[j] + d * dst_step
            else:
                da = dst_stage + (j * n + i) * run
            lo = c * chunk
            hi = min(lo + chunk, run)
            for off in range(lo + cuda.threadIdx.x * width, hi, cuda.blockDim.x * width):
                copy(da + off, sa + off)

    _KERNELS[width] = copy_runs
    return copy_runs


def _arr(t: torch.Tensor):
    return t.numpy() if _SIM else cuda.as_cuda_array(t)


def _launch(device, src_table, dst_table, src_ids, dst_ids, src_stage: int, dst_stage: int,
            n: int, src_n: int, dst_n: int, num_tensors: int, run: int, align: int,
            max_ctas, src_step: int, dst_step: int) -> None:
    width = _alignment(align, run, src_step, dst_step)
    chunk = max(width, min(run, CHUNK_BYTES))
    nchunk = -(-run // chunk)
    total = num_tensors * n * nchunk
    if _SIM:
        grid, stream = min(total, max_ctas or 2), 0
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        sms = torch.cuda.get_device_properties(idx).multi_processor_count
        grid = min(total, max_ctas or CTAS_PER_SM * sms)
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
    args = (_arr(src_table), _arr(dst_table), _arr(src_ids), _arr(dst_ids), src_stage, dst_stage,
            n, src_n, dst_n, run, chunk, nchunk, total, src_stage == 0, dst_stage == 0,
            src_step, dst_step)
    if _SIM:
        _kernel(width)[grid, THREADS](*args)
    else:
        with cuda.gpus[idx]:
            _kernel(width)[grid, THREADS, stream](*args)


_COMPILE_ERROR: str | None = None


def _noop(a):  # the smallest kernel: compiled once to prove the toolchain works
    pass


class NumbaCUDABackend:
    """A backend of :mod:`kvflow.kernels.registry` (contract: :mod:`kvflow.kernels.contract`)."""

    name = "numba_cuda"
    directions = ("pull", "push")
    devices = {"cpu"} if _SIM else {"cuda"}
    block_strides = True  # block-major caches (BM_NHD): blocks block_stride_bytes apart

    def unavailable_reason(self) -> str | None:
        if cuda is None:
            return f"numba-cuda is not importable ({_IMPORT_ERROR})"
        if _SIM:
            return None
        global _COMPILE_ERROR
        try:
            if not cuda.is_available():
                return "numba.cuda.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - a broken driver or toolkit
            return f"numba.cuda failed to initialise: {exc}"
        if _COMPILE_ERROR is None:  # once per process: can this install compile a kernel?
            try:
                cuda.jit("void(int64[:])")(_noop)
                _COMPILE_ERROR = ""
            except Exception as exc:  # noqa: BLE001 - e.g. numba-cuda vs a newer numpy
                _COMPILE_ERROR = f"numba-cuda cannot compile here ({type(exc).__name__}: {exc})"
        return _COMPILE_ERROR or None

    def gather(self, cache, ids, out, start, stop, max_ctas=None):
        T = cache.spec.tensors_per_layer
        table, align = _table(cache, cache.device)
        t = table[start * T:stop * T]
        _launch(cache.device, t, t, ids, ids, 0, out.data_ptr(), ids.numel(), cache.num_blocks,
                ids.numel(), (stop - start) * T, cache.spec.block_bytes,
                _alignment(align, out.data_ptr()), max_ctas, cache.spec.block_stride_bytes,
                cache.spec.block_bytes)

    def scatter(self, src, cache, ids, start, stop, max_ctas=None):
        T = cache.spec.tensors_per_layer
        table, align = _table(cache, cache.device)
        t = table[start * T:stop * T]
        _launch(cache.device, t, t, ids, ids, src.data_ptr(), 0, ids.numel(), ids.numel(),
                cache.num_blocks, (stop - start) * T, cache.spec.block_bytes,
                _alignment(align, src.data_ptr()), max_ctas, cache.spec.block_bytes,
                cache.spec.block_stride_bytes)

    def copy(self, src_cache, dst_cache, src_ids, dst_ids, start, stop, max_ctas=None,
             direction="pull"):
        if direction not in ("pull", "push"):
            raise ValueError(f"direction must be 'pull' or 'push', got {direction!r}")
        dev = dst_cache.device if direction == "pull" else src_cache.device
        T = src_cache.spec.tensors_per_layer
        s_table, s_align = _table(src_cache, dev)
        d_table, d_align = _table(dst_cache, dev)
        _launch(dev, s_table[start * T:stop * T], d_table[start * T:stop * T],
                src_ids.to(dev, non_blocking=True), dst_ids.to(dev, non_blocking=True), 0, 0,
                src_ids.numel(), src_cache.num_blocks, dst_cache.num_blocks, (stop - start) * T,
                src_cache.spec.block_bytes, _alignment(s_align, d_align), max_ctas,
                src_cache.spec.block_stride_bytes, dst_cache.spec.block_stride_bytes)


register_backend(NumbaCUDABackend())
