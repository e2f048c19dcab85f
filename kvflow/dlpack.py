"""Foreign arrays (paddle, numpy, cupy: anything with ``__dlpack__``) as torch tensors, zero-copy.

torch 2.13's ``from_dlpack`` aborts the whole process (an uncaught C++ error, not a Python
exception) on a tensor with a negative stride, e.g. ``np.arange(4)[::-1]``; such arrays are
refused here first, with the argument's name.
"""

from __future__ import annotations

from typing import Any

import torch


def to_torch(x: Any, name: str, *, writable: bool = False) -> Any:
    """Return ``x`` as a torch tensor sharing its memory when ``x`` is a DLPack producer;
    anything else (a torch tensor, None, a list) unchanged.

    ``writable``: ``x`` will be written (an op's destination); a read-only array is refused.

    Raises
    ------
    TypeError
        ``x`` has a negative stride, or DLPack refused it (the producer's reason quoted).
    ValueError
        ``writable`` and ``x`` is a read-only array.
    """
    if isinstance(x, torch.Tensor) or not hasattr(x, "__dlpack__"):
        return x
    flags = getattr(x, "flags", None)  # numpy: torch has no read-only tensors, so refuse here
    if writable and flags is not None and getattr(flags, "writeable", True) is False:
        raise ValueError(f"{name} is read-only (a numpy array with flags.writeable False); "
                         f"kvflow writes into it")
    strides = getattr(x, "strides", None)  # numpy and cupy: bytes; paddle has none negative
    if strides is not None and any(s < 0 for s in strides):
        raise TypeError(f"{name} has a negative stride ({tuple(strides)}); pass a copy with "
                        f"positive strides (e.g. numpy.ascontiguousarray)")
    try:
        return torch.utils.dlpack.from_dlpack(x)
    except Exception as exc:  # noqa: BLE001 - report the producer's own reason
        raise TypeError(f"{name} could not be taken through DLPack: {exc}") from exc
