"""Value checks of block ids that live on the host, compiled with numba (one pass, no Python
loop, no temporary tensors): what :mod:`kvflow.kernels.validate` runs for CPU ids.

Each returns the first finding in a fixed order so the error names the same id as a plain
scan would: the lowest position of an out-of-range id; the smallest repeated block; the
smallest block on both sides.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def first_bad(ids, num_blocks):
    """Position of the first id outside ``[-1, num_blocks)``, or -1."""
    for i in range(ids.shape[0]):
        if ids[i] < -1 or ids[i] >= num_blocks:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def smallest_repeat(ids):
    """The smallest id >= 0 that appears more than once, or -1."""
    real = np.sort(ids[ids >= 0])
    for k in range(1, real.shape[0]):
        if real[k] == real[k - 1]:
            return real[k]
    return -1


@numba.njit(cache=True, nogil=True)
def smallest_shared(a, b):
    """The smallest id >= 0 present in both ``a`` and ``b``, or -1."""
    x = np.sort(a[a >= 0])
    y = np.sort(b[b >= 0])
    i = j = 0
    while i < x.shape[0] and j < y.shape[0]:
        if x[i] == y[j]:
            return x[i]
        if x[i] < y[j]:
            i += 1
        else:
            j += 1
    return -1
