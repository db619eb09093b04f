"""A W12 GEMM for many rows on the runtime layout (w12/layout.py): `w12.matmul_tiled` above the flow kernel's 32 rows,
where a batch verify step puts B requests' trees in one pass (hybrid-27b: 72-280 rows).

One program owns BN weight rows and BM rows of x. Per 64-column group it loads the BN rows' tiles (each row block's
hi bytes [16, 64] and lo nibbles, as `w12_untile_kernel` reads them), decodes them in registers to BF16 and adds
x[BM, 64] @ w[BN, 64]^T to an fp32 accumulator with `tl.dot` (wgmma on sm_90, mma.sync elsewhere); the masked last
group (K % 64 columns) after the loop. Programs of one weight tile are consecutive in the grid, so that the tiles a
second or third x block reads come from L2. Then the escapes: escape entries hold code 0, which decodes to +0.0, so
each row adds val x x[:, col] for its escapes (val: the escape's BF16 bits, int16), in CSR order (a loop of the block's largest escape count, masked per
row: no atomics, the same order every run; x and the value from their bits, their product exact in fp64 and rounded
once to fp32, as an fp32 multiply rounds it, without a flush of subnormal x to zero), then the bias, and one rounding
to BF16.

Per element, as `w12_untile_kernel`: code = hi << 4 | lo4, bits = ((code & 0x7FF) + (e0 << 7)) | ((code & 0x800)
<< 4), 0 for code 0; with Q8 the 8-bit view, bits = (((hi & 0x7F) << 4 | 8) + (e0 << 7)) | ((hi & 0x80) << 8), 0 for
hi 0. The bits go through fp32 (bits << 16), whose conversion to BF16 is exact. As in the flow kernel, a
non-finite x at a column where a row has an escape makes that row's output NaN (the decoded +0.0 times +-Inf or NaN):
`w12.matmul`'s documented difference from the decoded weight's product.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["w12_mm_tiled_kernel"]


@triton.jit
def _decode(hi, lo, e, Q8: tl.constexpr):
    """BF16 weights [BN, 64] from hi bytes and lo nibbles (int32) and the rows' e0 [BN, 1]."""
    if Q8:
        bits = ((((hi & 0x7F) << 4) | 0x8) + (e << 7)) | ((hi & 0x80) << 8)
        bits = tl.where(hi == 0, 0, bits)
    else:
        code = (hi << 4) | lo
        bits = ((code & 0x7FF) + (e << 7)) | ((code & 0x800) << 4)
        bits = tl.where(code == 0, 0, bits)
    return (bits << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def w12_mm_tiled_kernel(x, ldx, tiles, e0, rowptr, ecol, evals, bias, out, M, N, KF, kr, NF, nr, SB,
                        HAS_BIAS: tl.constexpr, Q8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pn = pid // num_m
    pm = pid - pn * num_m
    n = pn * BN + tl.arange(0, BN)
    m = pm * BM + tl.arange(0, BM)
    j = tl.arange(0, 64)
    nok = n < N
    mok = m < M
    b = n // 16
    r = (n % 16)[:, None]
    R = tl.where(b < NF, 16, nr)[:, None]
    base = (b.to(tl.int64) * SB)[:, None]
    e = tl.load(e0 + n, mask=nok, other=0).to(tl.int32)[:, None]
    xrow = x + m.to(tl.int64)[:, None] * ldx
    xbits = x.to(tl.pointer_type(tl.int16)) + m.to(tl.int64)[:, None] * ldx
    jj = j % 16
    lo_off = (8 * (j // 16) + jj % 8)[None, :]
    lo_shift = (4 * (jj // 8))[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for c in range(0, KF):
        t = base + c * 96 * R
        hi = tl.load(tiles + t + 64 * r + j[None, :], mask=nok[:, None], other=0).to(tl.int32)
        lo = (tl.load(tiles + t + 64 * R + 32 * r + lo_off, mask=nok[:, None], other=0).to(tl.int32) >> lo_shift) & 0xF
        w = _decode(hi, lo, e, Q8)
        xt = tl.load(xrow + (c * 64 + j)[None, :], mask=mok[:, None], other=0.0)
        acc = tl.dot(xt, tl.trans(w), acc)
    if kr > 0:  # the masked last group: [R, kr] hi bytes, then [R, (kr + 1) / 2] lo bytes (two nibbles each)
        t = base + KF * 96 * R
        ok = nok[:, None] & (j < kr)[None, :]
        hi = tl.load(tiles + t + kr * r + j[None, :], mask=ok, other=0).to(tl.int32)
        lb = (kr + 1) // 2
        lo = (tl.load(tiles + t + R * kr + lb * r + (j // 2)[None, :], mask=ok, other=0).to(tl.int32) >>
              (4 * (j % 2))[None, :]) & 0xF
        w = _decode(hi, lo, e, Q8)
        w = tl.where(ok, w, 0.0)
        xt = tl.load(xrow + (KF * 64 + j)[None, :], mask=mok[:, None] & (j < kr)[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(w), acc)
    # the escapes, row by row in CSR order
    s = tl.load(rowptr + n, mask=nok, other=0)
    cnt = tl.load(rowptr + n + 1, mask=nok, other=0) - s
    for i in range(0, tl.max(cnt, 0)):
        has = i < cnt
        col = tl.load(ecol + s + i, mask=has, other=0)
        v = ((tl.load(evals + s + i, mask=has, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        xb = tl.load(xbits + col[None, :], mask=mok[:, None] & has[None, :], other=0).to(tl.int32) & 0xFFFF
        xg = (xb << 16).to(tl.float32, bitcast=True)
        acc += (xg.to(tl.float64) * v.to(tl.float64)[None, :]).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=mok[:, None] & nok[None, :])
