"""The bit-level float conversions of the numba and Triton-interpreter paths
(:mod:`kvflow.kernels.numba.floats`) equal torch's: decoding every bit pattern of each 8/16-bit
format, encoding random float32 bit patterns and edge values with round-to-nearest-even; the
reference's scale divisions are correctly rounded on every device."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kvflow.kernels.numba.floats import KINDS, decode, encode
from kvflow.kernels.reference_reblock import FP8_MAX, div_rn

from tests.conftest import DEVICES

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
EDGES = [0.0, -0.0, 448.0, 464.0, 65504.0, 65519.0, 65520.0, 1e30, 2.0 ** -9, 2.0 ** -10,
         1.5 * 2.0 ** -9, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-40, 57344.0, 61439.0]


@numba.njit
def _encode_all(x, mbits, bias, emin, out):
    for i in range(x.shape[0]):
        out[i] = encode(x[i], mbits, bias, emin)


@numba.njit
def _decode_all(b, mbits, bias, out):
    for i in range(b.shape[0]):
        out[i] = decode(b[i], mbits, bias)


@pytest.mark.parametrize("dtype", list(KINDS), ids=str)
def test_encode_rounds_like_torch(dtype):
    _, mbits, bias, emin = KINDS[dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g).to(torch.int32)
    x = x.view(torch.float32)
    x = torch.cat([x[torch.isfinite(x)], torch.randn(20_000, generator=g) * 300,
                   torch.tensor(EDGES), -torch.tensor(EDGES)])
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):   # fp8 callers clamp first
        m = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
        x = x.clamp(-m, m)
    out = np.zeros(x.numel(), np.int64)
    _encode_all(x.numpy(), mbits, bias, emin, out)
    isz = dtype.itemsize
    ref = x.to(dtype).view(_INT[isz]).long() & ((1 << 8 * isz) - 1)
    bad = (torch.from_numpy(out) != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. {x[bad[:3]].tolist()}"


@pytest.mark.parametrize("dtype", [d for d in KINDS if d.itemsize < 4], ids=str)
def test_decode_every_pattern_like_torch(dtype):
    _, mbits, bias, _ = KINDS[dtype]
    pats = torch.arange(1 << 8 * dtype.itemsize)
    out = np.zeros(pats.numel(), np.float32)
    _decode_all(pats.numpy(), mbits, bias, out)
    ref = pats.to(_INT[dtype.itemsize]).view(dtype).float()
    finite = torch.isfinite(ref)
    got = torch.from_numpy(out)
    assert torch.equal(got[finite].view(torch.int32), ref[finite].view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", list(FP8_MAX.values()))
def test_div_rn_is_correctly_rounded(device, m):
    # float32 quotients rounded once: float64 division then one rounding is exact here
    a = torch.rand(4096, generator=torch.Generator().manual_seed(3)) * 1000 + 2.0 ** -100
    want = (a.double() / m).float()
    once_more = a * (torch.tensor(1.0) / m)       # what torch's CUDA tensor / float computes
    assert (once_more != want).sum() > 1000       # so the values below tell the two apart
    got = div_rn(a.to(device), m).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    inv = div_rn(1.0, a.to(device)).cpu()
    assert torch.equal(inv.view(torch.int32), (1.0 / a.double()).float().view(torch.int32))


@pytest.mark.parametrize("dtype", [d for d in KINDS if d.itemsize < 4], ids=str)
def test_nan_encodes_to_torchs_nan_bits(dtype):
    """NaN (either sign, quiet or signalling payloads) encodes to the bits torch's .to() gives,
    never to a finite value (a NaN in P's K/V must not turn finite in D's)."""
    _, mbits, bias, emin = KINDS[dtype]
    nans = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x7FFFFFFF],
                        dtype=torch.int32).view(torch.float32)
    out = np.zeros(nans.numel(), np.int64)
    _encode_all(nans.numpy(), mbits, bias, emin, out)
    isz = dtype.itemsize
    ref = nans.to(dtype).view(_INT[isz]).long() & ((1 << 8 * isz) - 1)
    assert out.tolist() == ref.tolist()
    assert torch.from_numpy(out).to(_INT[isz]).view(dtype).float().isnan().all()
