"""CPU checks of the fixed-base decode's arithmetic without a GPU: the flow kernel's fixed-base build
(FlowConfig(fixed=True), w12/csrc/w12_flow.cu) and w12_common.cuh's XRange and scale_exact.

1. The fixed-base decode: for every code and every window base, the decoded bf16 is exactly
   2^(112 - e0) times the exact-base decode (e0 >= 1), or the exact decode itself (e0 = 0).
2. The scale identity on IEEE fp32 (numpy): sums of x * w' scaled by 2^(e0 - 112) equal sums of x * w
   bit for bit whenever the kernel's condition `scale_exact` holds, at the edges of that condition;
   outside it the identity can fail (subnormal products), which is why those rows take the exact base.
3. The x exponent range (XRange): the packed 16-bit max / min-non-zero trick equals a direct
   computation on hostile bit patterns (+-0, subnormals, +-Inf, NaN).
"""

from __future__ import annotations

import numpy as np
import pytest

from flow_emu import dec_exact, dec_fixed, prmt, scale_exact

U32 = np.uint32


def bits_to_f64(bits16: np.ndarray) -> np.ndarray:
    return (bits16.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def lanes(r):
    return r & U32(0xFFFF), r >> U32(16)


def test_fixed_base_decode_is_an_exact_power_of_two_multiple_for_every_code_and_base():
    codes = np.arange(4096, dtype=U32)
    hi, nib = codes >> U32(4), codes & U32(0xF)
    # the kernel's prmt gives `hi << 8 | lo byte`; the lo byte's other nibble (here 0xA) must not leak
    lo_byte = nib | U32(0xA0)
    ha = hi | (hi << U32(8))  # hi bytes of two columns (same code twice)
    la = lo_byte | (lo_byte << U32(8))
    y = prmt(ha, la, 0x1504)  # lanes: hi << 8 | lo byte
    off = (codes >> U32(7)) & U32(0xF)
    for e0 in range(0, 241):
        dense = (e0 + off <= 254) | (codes == 0)  # exponent 255 (+-Inf, NaN) is always an escape
        exact = dec_exact(prmt(ha, la & U32(0x0F0F), 0x1504), U32(e0 << 7 | e0 << 23))
        fixed = dec_fixed(y, U32(0 if e0 == 0 else 0x38003800))
        for le, lf in zip(lanes(exact), lanes(fixed)):
            le, lf = le[dense], lf[dense]
            if e0 == 0:
                assert np.array_equal(le, lf), "e0 = 0 rows decode with the exact base"
            else:
                ve, vf = bits_to_f64(le), bits_to_f64(lf)
                assert np.array_equal(vf * 2.0 ** (e0 - 112), ve), f"e0={e0}"
                nz = ve != 0
                assert np.all(np.abs(vf[nz]) >= 2.0**-15) and np.all(np.abs(vf) < 2.0), "w' outside [2^-15, 2)"


def _bf16(v: np.ndarray) -> np.ndarray:
    """float64 -> nearest bf16 value (as float64), round to nearest even."""
    b = v.astype(np.float32).view(U32)
    b = (b + U32(0x7FFF) + ((b >> U32(16)) & U32(1))) & U32(0xFFFF0000)
    return b.view(np.float32).astype(np.float64)


def _fp32_dot(x: np.ndarray, w: np.ndarray) -> np.float32:
    """sum(x * w) in fp32, products and sums rounded in a fixed (sequential) order."""
    acc = np.float32(0.0)
    with np.errstate(all="ignore"):  # overflow to +-Inf is part of what is compared
        for p in (x.astype(np.float32) * w.astype(np.float32)):
            acc = np.float32(acc + p)
    return acc


def _exps(v: np.ndarray) -> tuple[int, int]:
    """(Emin, Emax) of bf16 values: exponent fields of the smallest non-zero and the largest |v|."""
    b = (v.astype(np.float32).view(U32) >> U32(16)) & U32(0x7FFF)
    nz = b[b != 0]
    return (255 if nz.size == 0 else int(nz.min() >> 7)), int(b.max() >> 7)


def _case(e0: int, x_exp: int, n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row with window base e0 (w in [2^(e0-127), 2^(e0-112))) and x of magnitude ~2^x_exp."""
    w = _bf16(rng.uniform(1.0, 2.0, n) * 2.0 ** (e0 - 127 + rng.integers(0, 15, n)) * rng.choice([-1.0, 1.0], n))
    wp = w * 2.0 ** (112 - e0)  # the fixed-base decode
    x = _bf16(rng.standard_normal(n) * 2.0**x_exp)
    return w, wp, x


@pytest.mark.parametrize("e0", [1, 12, 60, 100, 112, 113, 127, 150, 200, 239, 240])
def test_scale_identity_holds_wherever_the_condition_does(e0):
    rng = np.random.default_rng(e0)
    s = e0 - 112
    checked = 0
    for x_exp in range(-140, 128, 3):
        w, wp, x = _case(e0, x_exp, 64, rng)
        emin, emax = _exps(x)
        if not np.isfinite(x).all() or not scale_exact(e0, emin, emax):
            continue
        true = _fp32_dot(x, w)
        primed = _fp32_dot(x, wp)
        scaled = np.float32(np.float64(primed) * 2.0**s)  # one exact power-of-two multiply (or two for s = 128)
        assert scaled.view(U32) == true.view(U32), (e0, x_exp, float(true), float(scaled))
        checked += 1
    assert checked >= 5, f"e0={e0}: too few x ranges inside the condition ({checked})"


def test_scale_identity_fails_outside_the_condition():
    """Why the condition exists: with subnormal products in one domain the two sums differ."""
    rng = np.random.default_rng(1)
    bad = 0
    for _ in range(200):
        e0, x_exp = 20, -40  # true products ~2^-147: subnormal; the condition rejects this row
        w, wp, x = _case(e0, x_exp, 64, rng)
        emin, emax = _exps(x)
        assert not scale_exact(e0, emin, emax)
        true = _fp32_dot(x, w)
        scaled = np.float32(np.float64(_fp32_dot(x, wp)) * 2.0 ** (e0 - 112))
        bad += int(scaled.view(U32) != true.view(U32))
    assert bad > 0


def _xrange(words: np.ndarray) -> tuple[int, int]:
    """XRange::add over 32-bit words (two bf16 each), then emin() / emax(), as the kernel computes them."""
    mx = np.zeros((), dtype=U32)
    mn = np.full((), 0xFFFFFFFF, dtype=U32)
    for v in words.astype(U32):
        a = v & U32(0x7FFF7FFF)
        mx = np.maximum(mx & U32(0xFFFF), a & U32(0xFFFF)) | (np.maximum(mx >> U32(16), a >> U32(16)) << U32(16))
        t = (((v | U32(0x80008000)) - U32(0x00010001)) ^ U32(0x80008000)).astype(U32)
        mn = np.minimum(mn & U32(0xFFFF), t & U32(0xFFFF)) | (np.minimum(mn >> U32(16), t >> U32(16)) << U32(16))
    emax = int(max(mx & U32(0xFFFF), mx >> U32(16)) >> U32(7))
    m = int(min(mn & U32(0xFFFF), mn >> U32(16)))
    return (255 if m == 0xFFFF else (m + 1) >> 7), emax


@pytest.mark.parametrize("seed", range(6))
def test_x_exponent_range_bit_trick(seed):
    rng = np.random.default_rng(seed)
    pool = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0xBF80, 0x7F7F, 0x00FF],
                    dtype=np.uint16)
    n = 2 * int(rng.integers(1, 40))
    h = np.where(rng.random(n) < 0.5, rng.choice(pool, n), rng.integers(0, 1 << 16, n).astype(np.uint16))
    if seed == 0:
        h[:] = 0  # all zero: no non-zero value
    if seed == 1:
        h[:] = np.array([0x8000, 0x0000] * (n // 2), dtype=np.uint16)
    words = h[0::2].astype(U32) | (h[1::2].astype(U32) << U32(16))
    a = h & np.uint16(0x7FFF)
    nz = a[a != 0]
    want = ((255 if nz.size == 0 else int(nz.min()) >> 7), int(a.max()) >> 7)
    assert _xrange(words) == want


def test_condition_bounds_hybrid_activation_ranges():
    """Real rows (e0 ~ 100-125) with activations between 2^-45 and 2^60 are inside the condition, so the
    exact-base recomputation never runs for them; rows of tiny weights need correspondingly larger x."""
    for e0 in range(100, 126):
        assert scale_exact(e0, 127 - 45, 127 + 60)
    assert not scale_exact(12, 127 - 60, 127)  # s = -100: x below 2^-37 would give subnormal products
    assert scale_exact(0, 0, 255)
