"""Layer ranges: the ``layers=`` argument of every op (None, an int, a range, a slice or
``(start, stop)``) as one half-open ``(start, stop)``."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def is_int(x: Any) -> bool:
    """True for a Python or numpy integer, False for a bool (``True`` is no layer or count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def normalize_layers(layers: Any, num_layers: int) -> tuple[int, int]:
    """Turn ``layers`` (None, an int, a step-1 ``range``/``slice``, or ``(start, stop)``)
    into a half-open ``(start, stop)`` with ``0 <= start < stop <= num_layers``.

    Raises
    ------
    TypeError, ValueError
        Naming ``layers`` and its value.
    """
    if layers is None:
        return 0, num_layers
    if is_int(layers):
        start, stop = int(layers), int(layers) + 1
    elif isinstance(layers, (range, slice)):
        step = 1 if layers.step is None else layers.step
        if step != 1:
            raise ValueError(f"layers must be a contiguous range (step 1), got {layers!r}")
        start = 0 if layers.start is None else layers.start
        stop = num_layers if layers.stop is None else layers.stop
        if not (is_int(start) and is_int(stop)):
            raise TypeError(f"layers must be None, an int, a range, a slice or (start, stop) "
                            f"of ints, got {layers!r}")
        start, stop = int(start), int(stop)
    elif isinstance(layers, tuple) and len(layers) == 2 and all(is_int(x) for x in layers):
        start, stop = int(layers[0]), int(layers[1])
    else:
        raise TypeError(f"layers must be None, an int, a range, a slice or (start, stop), got {layers!r}")
    if not start < stop:
        raise ValueError(f"layers={layers!r} is empty or reversed: start {start} must be below "
                         f"stop {stop}")
    if not (0 <= start and stop <= num_layers):
        raise ValueError(f"layers={layers!r} is outside the cache's {num_layers} layers "
                         f"(need 0 <= start < stop <= {num_layers})")
    return start, stop
