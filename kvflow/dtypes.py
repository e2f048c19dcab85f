"""The element types a KV cache can hold, and the conversion of any framework's dtype to torch's.

kvflow moves bytes, so every dtype a cache may hold is listed here by its names (fp8 e4m3 and
e5m2 included); :func:`as_torch_dtype` takes a torch, numpy or paddle dtype or one of the names.
"""

from __future__ import annotations

from typing import Any

import torch

#: The one-byte float dtypes; an fp8 cache holds float32 dequantization scales (:mod:`kvflow.scales`).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def as_torch_dtype(dtype: Any) -> torch.dtype:
    """Convert a torch, numpy or paddle dtype (or its name) to a ``torch.dtype``.

    Raises
    ------
    TypeError
        If ``dtype`` names no dtype kvflow can store, e.g. ``dtype='complex64'``.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPE_NAMES.values():
            return dtype
        raise TypeError(f"dtype={dtype!r} is not a dtype kvflow can store; use one of "
                        f"{sorted({str(d) for d in _DTYPE_NAMES.values()})}")
    name = getattr(dtype, "name", None)  # numpy dtypes and numpy scalar types' dtype
    if name is None and isinstance(dtype, type):
        name = getattr(dtype, "__name__", None)  # np.float16 (a scalar type)
    if name is None:
        name = str(dtype)  # 'bfloat16', 'paddle.bfloat16', 'VarType.BF16'
    key = name.rsplit(".", 1)[-1].lower()
    key = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(key, key)
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    raise TypeError(f"dtype={dtype!r} is not a dtype kvflow can store; use a torch.dtype or "
                    f"one of the names {sorted(_DTYPE_NAMES)}")
