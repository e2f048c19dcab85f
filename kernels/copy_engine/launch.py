"""Enqueue a :class:`~.plan.Plan` on a GPU as driver memcpys: no kernel, no SM.

Two paths, chosen once per process (:func:`path`; ``KVFLOW_COPY_ENGINE_PATH`` forces one):

- ``"batch"``: one ``cuMemcpyBatchAsync`` for the whole plan, when the driver has it (CUDA
  >= 12.8, ``cuDriverGetVersion() >= 12080``). The entry point comes from the maintained
  ``cuda-bindings`` package (``cuda.bindings.driver.cuGetProcAddress``, asked for the ABI of
  the driver's version: 12.8's takes a ``failIdx`` argument, 13.0's does not) and is called
  through ctypes with the plan's uint64 arrays, so a call costs one driver call however many
  copies it holds (the bindings' own wrapper would build a Python object per address). Every
  copy has one attribute set: source in stream order, and the
  ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` hint (run on the copy engines, beside
  kernels; the driver may ignore a hint).
- ``"per_run"``: one ``cuMemcpyAsync`` per copy of the plan (older drivers), from the same
  ``cuGetProcAddress``. The driver picks how it moves each (for device-to-device copies it
  may use a kernel).

Stream: the copies go on the **current torch stream** of the device, so they are ordered
after the work that wrote the source and before the work that reads the destination, as
the kernels of the other GPU backends are, with no event. The one exception: the batch call
refuses the legacy NULL stream (torch's default stream, handle 0); there the batch runs on a
side stream of the device, fenced both ways (the side stream waits for the current one, then
the current one waits for the side stream), so ordering is the same and the caching
allocator's reuse of the buffers stays safe. Nothing here waits for the device.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import torch

from .plan import Plan

PATHS = ("batch", "per_run")
_ENV = "KVFLOW_COPY_ENGINE_PATH"
_BATCH_MIN_VERSION = 12080
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread

try:
    from cuda.bindings import driver as _drv
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - missing or broken bindings: the backend says why
    _drv, _IMPORT_ERROR = None, f"{type(exc).__name__}: {exc}"

_P = ctypes.c_void_p
_BATCH_V2 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t,
                             _P)  # CUDA >= 13.0: no failIdx
_BATCH_V1 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t,
                             _P, _P)  # CUDA 12.8 / 12.9: failIdx before the stream
_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _P)


def bindings_error() -> str | None:
    """Why ``cuda.bindings.driver`` cannot be imported, or None."""
    return _IMPORT_ERROR


class _Driver:
    """The driver's entry points, resolved once: ``version``, ``batch`` (or None),
    ``batch_v1`` (the 12.8 ABI), ``memcpy``."""

    def __init__(self) -> None:
        err, self.version = _drv.cuDriverGetVersion()
        _check(err, "cuDriverGetVersion")
        self.batch_v1 = False
        self.batch = None
        if self.version >= _BATCH_MIN_VERSION:
            abi = 13000 if self.version >= 13000 else 12080
            fn = _entry("cuMemcpyBatchAsync", abi)
            if fn:
                self.batch_v1 = abi < 13000
                self.batch = (_BATCH_V1 if self.batch_v1 else _BATCH_V2)(fn)
        self.memcpy = _MEMCPY(_entry("cuMemcpyAsync", 4000))
        self.attrs: dict[int, Any] = {}  # per device: the one CUmemcpyAttributes of a batch
        self.side: dict[int, torch.cuda.Stream] = {}
        self.zero = np.zeros(1, dtype=np.uint64)  # attrsIdxs: one set for every copy
        self.fail = ctypes.c_size_t(0)

    def attr_ptr(self, index: int) -> int:
        a = self.attrs.get(index)
        if a is None:
            a = self.attrs[index] = _drv.CUmemcpyAttributes()
            a.srcAccessOrder = _drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            a.flags = int(_drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
            for hint in (a.srcLocHint, a.dstLocHint):  # hints; ignored for device memory
                hint.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                hint.id = index
        return a.getPtr()


_STATE: list[_Driver] = []


def _driver() -> _Driver:
    if not _STATE:
        _STATE.append(_Driver())
    return _STATE[0]


def _entry(name: str, version: int) -> int:
    """Address of driver function ``name`` with the ABI of CUDA ``version`` (0 if none)."""
    flags = _drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
    res = _drv.cuGetProcAddress(name.encode(), version, flags)
    _check(res[0], f"cuGetProcAddress({name!r})")
    return int(res[1] or 0)


def _check(err: Any, what: str) -> None:
    code = int(err)
    if code:
        name = _drv.cuGetErrorName(_drv.CUresult(code))
        text = name[1].decode() if isinstance(name[1], bytes) else str(name[1])
        raise RuntimeError(f"copy_engine: {what} failed with {text} ({code})")


def path() -> str:
    """The memcpy path of this process: ``"batch"`` when the driver has
    ``cuMemcpyBatchAsync``, else ``"per_run"``; ``KVFLOW_COPY_ENGINE_PATH`` may force
    ``"per_run"`` (or ``"batch"``, which then must exist).

    Raises
    ------
    ValueError
        ``KVFLOW_COPY_ENGINE_PATH`` names no path.
    RuntimeError
        ``"batch"`` forced on a driver without it (naming the driver's version).
    """
    want = os.environ.get(_ENV, "").strip() or "auto"
    if want not in PATHS + ("auto",):
        raise ValueError(f"{_ENV}={want!r} is not one of {('auto',) + PATHS}")
    drv = _driver()
    if want == "per_run" or (want == "auto" and drv.batch is None):
        return "per_run"
    if drv.batch is None:
        raise RuntimeError(f"{_ENV}=batch: the driver (CUDA {drv.version}) has no "
                           f"cuMemcpyBatchAsync (needs >= {_BATCH_MIN_VERSION})")
    return "batch"


def execute(plan: Plan, device: torch.device) -> None:
    """Enqueue every copy of ``plan`` on ``device``'s current stream (module docstring);
    returns without waiting. Raises RuntimeError naming the driver call and its error."""
    if plan.count == 0:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    prev = torch._C._cuda_getDevice()
    if prev != index:
        torch.cuda.set_device(index)
    try:
        try:
            _enqueue(plan, index)
        except _Retry:  # no context on this thread yet: make the device's primary one current
            _make_current(index)
            try:
                _enqueue(plan, index)
            except _Retry:
                raise RuntimeError(f"copy_engine: no CUDA context for cuda:{index} on this "
                                   f"thread (CUDA_ERROR_INVALID_CONTEXT)") from None
    finally:
        if prev != index:
            torch.cuda.set_device(prev)


class _Retry(Exception):
    pass


def _enqueue(plan: Plan, index: int) -> None:
    drv = _driver()
    stream = torch._C._cuda_getCurrentRawStream(index)
    if path() == "per_run":
        fn = drv.memcpy
        for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()):
            _result(fn(d, s, n, stream), "cuMemcpyAsync")
        return
    if stream != 0:
        _batch(drv, plan, index, stream)
        return
    cur = torch.cuda.current_stream(index)  # the legacy NULL stream: batch on a side stream
    side = drv.side.get(index)
    if side is None:
        side = drv.side[index] = torch.cuda.Stream(index)
    side.wait_stream(cur)
    _batch(drv, plan, index, side.cuda_stream)
    cur.wait_stream(side)


def _batch(drv: _Driver, plan: Plan, index: int, stream: int) -> None:
    args = (plan.dst.ctypes.data, plan.src.ctypes.data, plan.size.ctypes.data, plan.count,
            drv.attr_ptr(index), drv.zero.ctypes.data, 1)
    if drv.batch_v1:
        err = drv.batch(*args, ctypes.addressof(drv.fail), stream)
        what = f"cuMemcpyBatchAsync of {plan.count} copies (first failing: {drv.fail.value})"
    else:
        err = drv.batch(*args, stream)
        what = f"cuMemcpyBatchAsync of {plan.count} copies"
    _result(err, what)


def _result(err: int, what: str) -> None:
    if err == _INVALID_CONTEXT:
        raise _Retry
    if err:
        _check(err, what)


def _make_current(index: int) -> None:
    err, dev = _drv.cuDeviceGet(index)
    _check(err, "cuDeviceGet")
    err, ctx = _drv.cuDevicePrimaryCtxRetain(dev)
    _check(err, "cuDevicePrimaryCtxRetain")
    (err,) = _drv.cuCtxSetCurrent(ctx)
    _check(err, "cuCtxSetCurrent")
