"""math.cuh's exp2f_fma (the share of fa3_fp8's exponentials computed on the FMA units) emulated step by step in
float32 with its own constants, read from the source: its relative error is what its comment says (below 1.7e-3,
far under e4m3's 2^-4 step), 2^-inf and anything below 2^-127 give +0 (masked scores), and NaN stays NaN."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

SRC = (Path(__file__).resolve().parent.parent / "cuda_src" / "common" / "math.cuh").read_text()
BODY = SRC[SRC.index("float exp2f_fma(float x)"):]
BODY = BODY[: BODY.index("\n}\n")]
f32 = np.float32


def _coefficients():
    """(c2, c1, c0) of p = fmaf(fmaf(c2, fr, c1), fr, c0), as written in the kernel."""
    m = re.search(r"fmaf\(fmaf\(([\d.e+-]+)f, fr, ([\d.e+-]+)f\), fr, ([\d.e+-]+)f\)", BODY)
    assert m, "exp2f_fma's polynomial is no longer fmaf(fmaf(c2, fr, c1), fr, c0)"
    return tuple(f32(float(v)) for v in m.groups())


def _fma(a, b, c):  # float32 fused multiply-add: the product is exact in float64, one rounding to float32
    return (a.astype(np.float64) * b + c).astype(f32)


def exp2_fma(x):
    """exp2f_fma's steps in float32: max.NaN clamp at -127, round by 1.5 * 2^23, polynomial, 2^k from its bits."""
    x = np.asarray(x, dtype=f32)
    xc = np.where(np.isnan(x), x, np.maximum(x, f32(-127)))
    magic = f32(12582912.0)
    assert "12582912.f" in BODY and "0fC2FE0000" in BODY  # the constants emulated here
    y = (xc + magic).astype(f32)
    fr = (xc - (y - magic).astype(f32)).astype(f32)
    c2, c1, c0 = _coefficients()
    p = _fma(_fma(np.full_like(fr, c2), fr, c1), fr, c0)
    bits = (y.view(np.uint32).astype(np.uint64) << 23) + 0x3F800000
    two_k = (bits & 0xFFFFFFFF).astype(np.uint32).view(f32)
    return (p * two_k).astype(f32)


def test_relative_error_over_the_softmax_range():
    x = np.linspace(-126, 9, 2_000_001, dtype=np.float64).astype(f32)  # P~ x 256 <= 2^8.75 in fa3_fp8
    got = exp2_fma(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / ref - 1)) < 1.75e-3


def test_minus_infinity_and_underflow_give_zero_and_nan_stays():
    out = exp2_fma(np.array([-np.inf, -1e30, -200, -127.4, np.nan], dtype=f32))
    assert out[0] == 0 and out[1] == 0 and out[2] == 0 and out[3] == 0 and not np.signbit(out[0])
    assert np.isnan(out[4])
