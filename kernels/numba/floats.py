"""Float conversions as integer bit operations, for numba (which has no bfloat16 or fp8 type).

Formats are numbered by :data:`KINDS`. Decoding is exact; encoding from float32 rounds to
nearest even, as ``torch.Tensor.to`` does (float16 and bfloat16 overflow to inf; fp8 callers
clamp to the largest finite value first, so inf saturates); NaN encodes to the NaN bits torch
gives (bfloat16 0xFFFF, float16 sign|0x7E00|payload, fp8 sign|0x7F).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

#: dtype -> (kind, mantissa bits, exponent bias, smallest normal exponent)
KINDS = {torch.float32: (0, 23, 127, -126), torch.bfloat16: (1, 7, 127, -126),
         torch.float16: (2, 10, 15, -14), torch.float8_e4m3fn: (3, 3, 7, -6),
         torch.float8_e5m2: (4, 2, 15, -14)}


@intrinsic
def u32_as_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32."""
    def codegen(context, builder, signature, args):
        v = builder.trunc(args[0], context.get_value_type(types.uint32)) \
            if args[0].type.width > 32 else args[0]
        return builder.bitcast(v, context.get_value_type(types.float32))
    return types.float32(u), codegen


@intrinsic
def f32_as_u32(typingctx, x):
    """The bits of a float32 as a uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return types.uint32(x), codegen


@numba.njit(inline="always")
def decode(bits, mbits, bias):
    """A float of ``mbits`` mantissa bits and ``bias`` (bits right-aligned in an int) to
    float32; for float32 itself pass ``mbits = 23``."""
    b = np.int64(bits)
    if mbits == 23:
        return u32_as_f32(b)
    ebits_shift = mbits
    total = 1 + (8 if bias == 127 else (5 if bias == 15 else 4)) + mbits
    sign = (b >> (total - 1)) & 1
    e = (b >> ebits_shift) & ((1 << (total - 1 - mbits)) - 1)
    m = b & ((1 << mbits) - 1)
    if e == 0:  # subnormal or zero: m * 2**(1 - bias - mbits), exact in float32
        v = np.float32(m) * np.float32(2.0 ** (1 - bias - mbits))
        return -v if sign else v
    out = (sign << 31) | ((e - bias + 127) << 23) | (m << (23 - mbits))
    return u32_as_f32(out)


@numba.njit(inline="always")
def encode(x, mbits, bias, emin):
    """float32 ``x`` to the bits of a float of ``mbits`` mantissa bits, ``bias`` and smallest
    normal exponent ``emin``, rounding to nearest even (float32 itself: its bits)."""
    u = np.int64(f32_as_u32(np.float32(x)))
    if mbits == 23:
        return u
    total = 1 + (8 if bias == 127 else (5 if bias == 15 else 4)) + mbits
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: the bits torch's .to() gives
        if bias == 127:
            return np.int64(0xFFFF)  # bfloat16: 0xFFFF whatever the sign
        if mbits == 10:  # the quiet bit set, the payload's top bits kept
            return (sign << 15) | 0x7E00 | ((a & 0x7FFFFF) >> 13)
        return (sign << 7) | 0x7F  # fp8 e4m3fn and e5m2
    shift = 23 - mbits
    if bias == 127:  # bfloat16: the float32 bits rounded (subnormals and overflow included)
        r = (a + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift
        return (sign << (total - 1)) | r
    e32 = (a >> 23) - 127
    if e32 >= emin:
        if bias == 15 and mbits == 10 and e32 > 15:
            r = np.int64(0x7C00)  # float16 overflow: inf
        else:
            r = (a + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift
            r -= (127 - bias) << mbits
            if bias == 15 and mbits == 10 and r > 0x7C00:
                r = np.int64(0x7C00)
    else:
        sig = (a & 0x7FFFFF) | (0x800000 if (a >> 23) else 0)
        e = e32 if (a >> 23) else -126
        s = 23 + emin - mbits - e
        if s > 31:
            s = 31
        r = (sig + (1 << (s - 1)) - 1 + ((sig >> s) & 1)) >> s
    return (sign << (total - 1)) | r
