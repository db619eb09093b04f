"""W12 GEMV on CUDA cores for tiny M (the decode step): no tensor cores, no wgmma.

Each program owns BLOCK_N weight rows and a K range (split-K). Per K tile it loads the two
halves of `hi` and the shared `lo` plane exactly like the tensor-core kernel (16-byte vector
loads, see `tc.py`), decodes straight to fp32 (bits << 16), and does fp32 FMAs against x
broadcast over the rows: `acc[BN, BKH, BT] += w[BN, BKH, 1] * x[1, BKH, BT]`. The K reduction
across threads happens once, after the loop. Escapes, bias, the split-K partials and the
output rounding are shared with `tc.py`.

Two switches (the H200 tile sweep measures them against the above; tuned entries pick them):

* USE_ASM: the packed PTX decode of `pk_decode.py` (two weights per integer op), fp32 out.
* TOK2D (BLOCK_T <= 4): decode the [BN, BK/2] tile once and keep one 2-D accumulator per token,
  `acc_t[BN, BKH] += w * x_t[None, :]`, instead of the 3-D broadcast (with the broadcast, M=2 ran at
  half the M=1 speed on the H200). x_t is a [BKH] vector load per token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tc import _apply_escapes, _decode_halves, _store_tile, _tile_setup

__all__ = ["w12_matmul_gemv_kernel"]


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def w12_matmul_gemv_kernel(
    x_ptr, hi_ptr, lo_ptr, e0_ptr, rowptr_ptr, col_ptr, val_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, Kp, stride_lo, stride_xm, stride_xk,
    HAS_BIAS: tl.constexpr, Q8: tl.constexpr, SELECT_ZERO: tl.constexpr, ZERO_DENSE: tl.constexpr, SPLIT_K, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr = False, TOK2D: tl.constexpr = False,
):
    BKH: tl.constexpr = BLOCK_K // 2
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows, toks, row_ok, tok_ok, j, col_a, it0, it1, E, hi_p, lo_p, x_p = _tile_setup(
        x_ptr, hi_ptr, lo_ptr, e0_ptr, M, N, Kp, stride_lo, stride_xm, stride_xk, SPLIT_K, BLOCK_N, BLOCK_T, BLOCK_K)

    E16 = E.to(tl.int16)
    if TOK2D:
        tl.static_assert(BLOCK_T <= 4, "TOK2D keeps one accumulator per token: BLOCK_T <= 4")
        t0 = pid_t * BLOCK_T
        xr = x_ptr + t0.to(tl.int64) * stride_xm + (it0 * BLOCK_K + col_a) * stride_xk  # [BKH] token t0
        acc0 = tl.zeros((BLOCK_N, BKH), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BKH), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BKH), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BKH), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, BKH, BLOCK_T), dtype=tl.float32)
    for it in range(it0, it1):
        ka = it * BLOCK_K + col_a
        h_a8 = tl.load(hi_p)
        h_b8 = tl.load(hi_p + 32)
        wa, wb = _decode_halves(h_a8, h_b8, lo_p, E16, E, Q8, USE_ASM, SELECT_ZERO, True)  # fp32 [BN, BKH]
        if TOK2D:
            ma = ka < K
            mb = ka + 32 < K
            xa = tl.load(xr, mask=ma, other=0.0).to(tl.float32)
            xb = tl.load(xr + 32 * stride_xk, mask=mb, other=0.0).to(tl.float32)
            acc0 += wa * xa[None, :] + wb * xb[None, :]
            if BLOCK_T > 1:
                ok = t0 + 1 < M
                xa = tl.load(xr + stride_xm, mask=ma & ok, other=0.0).to(tl.float32)
                xb = tl.load(xr + stride_xm + 32 * stride_xk, mask=mb & ok, other=0.0).to(tl.float32)
                acc1 += wa * xa[None, :] + wb * xb[None, :]
            if BLOCK_T > 2:
                ok = t0 + 2 < M
                xa = tl.load(xr + 2 * stride_xm, mask=ma & ok, other=0.0).to(tl.float32)
                xb = tl.load(xr + 2 * stride_xm + 32 * stride_xk, mask=mb & ok, other=0.0).to(tl.float32)
                acc2 += wa * xa[None, :] + wb * xb[None, :]
                ok = t0 + 3 < M
                xa = tl.load(xr + 3 * stride_xm, mask=ma & ok, other=0.0).to(tl.float32)
                xb = tl.load(xr + 3 * stride_xm + 32 * stride_xk, mask=mb & ok, other=0.0).to(tl.float32)
                acc3 += wa * xa[None, :] + wb * xb[None, :]
            xr += BLOCK_K * stride_xk
        else:
            xa = tl.load(x_p, mask=(ka < K)[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)  # [BKH, BT]
            xb = tl.load(x_p + 32 * stride_xk, mask=(ka + 32 < K)[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)
            acc3 += wa[:, :, None] * xa[None, :, :] + wb[:, :, None] * xb[None, :, :]
            x_p += BLOCK_K * stride_xk
        hi_p += BLOCK_K
        lo_p += BKH

    if TOK2D:
        tc_ = tl.arange(0, BLOCK_T)[None, :]
        acc = tl.where(tc_ == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
        if BLOCK_T > 1:
            acc = tl.where(tc_ == 1, tl.sum(acc1, axis=1)[:, None], acc)
        if BLOCK_T > 2:
            acc = tl.where(tc_ == 2, tl.sum(acc2, axis=1)[:, None], acc)
            acc = tl.where(tc_ == 3, tl.sum(acc3, axis=1)[:, None], acc)
    else:
        acc = tl.sum(acc3, axis=1)  # [BN, BT]
    if pid_k == 0:
        acc = _apply_escapes(acc, rows, toks, row_ok, tok_ok, x_ptr, stride_xm, stride_xk, e0_ptr, rowptr_ptr,
                             col_ptr, val_ptr, ZERO_DENSE, Q8)
    _store_tile(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, bias_ptr, pid_k, M, N, SPLIT, HAS_BIAS)
