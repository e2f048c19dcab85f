"""Float conversions for the re-blocking kernel as Triton integer bit operations.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) converts float32 to bfloat16 and fp8 by
truncation and flushes bfloat16 subnormals, so under the interpreter the kernel converts with
these functions instead (the algorithm of :mod:`kvflow.kernels.numba.floats`: round to nearest
even, exact decoding). On a GPU it uses the hardware conversions (``cvt.rn``), which round the
same way; ``LaunchConfig.native_convert`` picks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_bits(b, MBITS: tl.constexpr, BIAS: tl.constexpr, EBITS: tl.constexpr):
    """int32 ``b`` holding a float's bits (right-aligned, zero-extended) -> float32."""
    if MBITS == 23:
        x = b.to(tl.float32, bitcast=True)
    elif BIAS == 127:  # bfloat16
        x = (b << 16).to(tl.float32, bitcast=True)
    else:
        sign = (b >> (EBITS + MBITS)) & 1
        e = (b >> MBITS) & ((1 << EBITS) - 1)
        m = b & ((1 << MBITS) - 1)
        normal = (sign << 31) | ((e - BIAS + 127) << 23) | (m << (23 - MBITS))
        sub = m.to(tl.float32) * (2.0 ** (1 - BIAS - MBITS))
        sub = tl.where(sign == 1, -sub, sub)
        x = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
    return x


@triton.jit
def encode_bits(x, MBITS: tl.constexpr, BIAS: tl.constexpr, EBITS: tl.constexpr,
                EMIN: tl.constexpr):
    """float32 ``x`` -> int32 bits of the narrower float, round to nearest even."""
    u = x.to(tl.int32, bitcast=True)
    if MBITS == 23:
        out = u
    else:
        SHIFT: tl.constexpr = 23 - MBITS
        sign = (u >> 31) & 1
        a = u & 0x7FFFFFFF
        rounded = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
        nan = a > 0x7F800000  # NaN: the bits torch's .to() gives on the CPU
        if BIAS == 127:  # bfloat16
            out = tl.where(nan, 0xFFFF, (sign << 15) | rounded)
        else:
            ef = a >> 23
            e32 = ef - 127
            r = rounded - ((127 - BIAS) << MBITS)
            if MBITS == 10:  # float16: overflow to inf
                r = tl.where((e32 > 15) | (r > 0x7C00), 0x7C00, r)
            sig = (a & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
            e = tl.where(ef > 0, e32, -126)
            s = tl.maximum(tl.minimum(23 + EMIN - MBITS - e, 31), 1)
            sub = (sig + ((1 << (s - 1)) - 1) + ((sig >> s) & 1)) >> s
            r = tl.where(e32 >= EMIN, r, sub)
            if MBITS == 10:  # float16: the quiet bit set, the payload's top bits kept
                r = tl.where(nan, 0x7E00 | ((a & 0x7FFFFF) >> 13), r)
            else:  # fp8 e4m3fn and e5m2
                r = tl.where(nan, 0x7F, r)
            out = (sign << (EBITS + MBITS)) | r
    return out
