"""W12 GEMM on tensor cores, swap-AB: `out[M, N] = x[M, K] @ W[N, K]^T` computed as
`acc[BN, BT] = W_tile[BN, BK] @ xT_tile[BK, BT]`, so the weight rows fill the MMA M dimension
(64/128 on wgmma) and the few decode tokens sit on the MMA N dimension (16..64).

On sm_90 Triton lowers `tl.dot` to wgmma, on sm_80/sm_89 to mma.sync; the same kernel serves
both (the "gemv" variant uses it for M > 4).

Decode happens in registers, from two byte planes read with 16-byte vector loads:

* Each 64-column group of `lo` holds the nibbles of columns `64g + i` (low nibble) and
  `64g + 32 + i` (high nibble). The kernel therefore walks a BK tile as two halves "a"
  (columns 64g + i) and "b" (64g + 32 + i), each `[BN, BK/2]`, paired element for element
  with the same `lo` tile. Both halves are 32-byte contiguous runs; no register shuffles.
* bits16 = ((c & 0x7FF) + (e0 << 7)) | ((c & 0x800) << 4) with c = hi << 4 | nib, rewritten
  as `hi*16 + 240*(hi & 0x80) + nib + (e0 << 7)` (the two are equal for 12-bit c).
* Code 0 is *not* special-cased on the hot path (unless SELECT_ZERO: the spec-literal decode).
  With e0 == 0 the formula already gives +0.0; with e0 != 0 a dense element never has code 0
  (the spec reserves it), so code 0 is an escape or padding. Padding meets x == 0. An escape decodes to v0 = 2^(e0-127) (bits e0 << 7)
  instead of +0.0, and the escape epilogue adds `x*esc - x*v0` (both products exact in fp32).
  This saves the compare+select per weight; the price is one extra fp32 rounding of a term
  2^-15 below the row's largest weights, far under the bf16 output rounding. Only contrived
  inputs notice (a one-hot x reading a tiny escape next to v0); SELECT_ZERO=True restores the
  bit-exact escape path at the cost of a compare+select per weight.
* The 8-bit view (Q8) reads every hi byte as its bin's midpoint (the lowest value of the bin for e0 == 0), hi == 0
  included: `hi*16 + 240*(hi & 0x80) + E8` with E8 = (e0 << 7) + 8 for e0 >= 1 and 0 for e0 == 0 (no select per
  weight). An escape (code 0) reads as that row's hi-0 value, which the escape epilogue takes back as above.

Escapes: the tile's rows own a contiguous range of the CSR list. The epilogue walks it row-parallel:
step j adds escape j of every row in the tile (rows with fewer escapes are masked), so the
cost is (max escapes of a row in the tile) x [BN, BT] FMAs, paid once per tile (split 0 only).

FUSE: instead of two MMAs of depth BK/2 per iteration (one per half), the decoded halves
are joined into one [BN, BK] operand in the tile-local K order k' = h * BK/2 + j, and x is loaded
in that same order (runs of 32 contiguous columns), so each iteration issues one MMA chain.

Split-K: program (pid_n, pid_t, pid_k) handles K iterations [it0, it1); SPLIT_K is a runtime
argument (one compiled kernel serves every split; SPLIT is the constexpr "split_k > 1"). With SPLIT it
writes fp32 partials to `ws[SPLIT_K, M, N]` and `w12_splitk_reduce_kernel` sums them in a fixed
order (deterministic), adds the bias and rounds once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pk_decode import decode_pk

__all__ = ["w12_matmul_tc_kernel", "w12_splitk_reduce_kernel"]


@triton.jit
def col_a_of(j):
    # pair index j in a BK tile -> column of half "a" (64g + i); half "b" is +32 (docs/w12-format.md)
    return (j // 32) * 64 + j % 32


@triton.jit
def _program_block(M, N, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (n, t, k) of a swap-AB grid (here, gemv.py, batch.py): its K share k, its weight rows and rows of x,
    and which of them exist."""
    pid_k = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    return pid_k, rows, toks, rows < N, toks < M


@triton.jit
def _tile_setup(x_ptr, hi_ptr, lo_ptr, e0_ptr, M, N, Kp, stride_lo, stride_xm, stride_xk, SPLIT_K,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # Shared prologue of the tc and gemv kernels: this program's rows/tokens, its K range under
    # split-K, the row exponent bases and the first-tile pointers of hi, lo and x.
    BKH: tl.constexpr = BLOCK_K // 2
    pid_k, rows, toks, row_ok, tok_ok = _program_block(M, N, BLOCK_N, BLOCK_T)
    j = tl.arange(0, BKH)
    col_a = col_a_of(j)  # [BKH] column of half "a" inside a BK tile; half "b" is +32

    n_it = tl.cdiv(Kp, BLOCK_K)
    per = tl.cdiv(n_it, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)

    # rows past N read row N-1 (results masked at the store): weight loads need no mask, so
    # they stay 16-byte vectors and the pipeliner sees plain loads
    rows_c = tl.minimum(rows, N - 1)
    E = (tl.load(e0_ptr + rows_c).to(tl.int32) << 7)[:, None]  # [BN, 1]
    rows64 = rows_c.to(tl.int64)
    hi_p = hi_ptr + rows64[:, None] * Kp + (it0 * BLOCK_K + col_a)[None, :]  # [BN, BKH]
    # stride_lo (= Kp // 2) comes from the host so the compiler sees it divisible by 16: 16-byte lo loads
    lo_p = lo_ptr + rows64[:, None] * stride_lo + (it0 * BKH + j)[None, :]  # [BN, BKH]
    x_p = x_ptr + toks.to(tl.int64)[None, :] * stride_xm + (it0 * BLOCK_K + col_a)[:, None] * stride_xk  # [BKH, BT]
    return rows, toks, row_ok, tok_ok, j, col_a, it0, it1, E, hi_p, lo_p, x_p


@triton.jit
def _decode_bits(h, nib, E, SELECT_ZERO: tl.constexpr):
    # h, nib: [BN, BKH] int32; E: [BN, 1] int32 (e0 << 7) -> bf16 bit patterns as int32 (0..0xFFFF)
    bits = h * 16 + (h & 0x80) * 240 + nib + E
    if SELECT_ZERO:
        bits = tl.where((h | nib) == 0, 0, bits)
    return bits


@triton.jit
def _decode_bits_q8(h, E8):
    # The 8-bit view: midpoint of the 16 codes sharing `hi` (E8 = _q8_base(E))
    return h * 16 + (h & 0x80) * 240 + E8


@triton.jit
def _q8_base(E):
    # E = e0 << 7 -> the 8-bit view's row constant: the bin midpoint (+8) for e0 >= 1, 0 for e0 == 0
    return tl.where(E > 0, E + 8, 0)


@triton.jit
def _bits_to_bf16(bits):
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bits_to_f32(bits):
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _decode_halves(h_a8, h_b8, lo_p, E16, E, Q8: tl.constexpr, USE_ASM: tl.constexpr, SELECT_ZERO: tl.constexpr,
                   F32: tl.constexpr):
    # h_a8, h_b8: uint8 [BN, BKH] hi bytes of the "a" / "b" half; lo_p: [BN, BKH] pointers to the
    # shared lo bytes (not read for Q8) -> weights (fp32 if F32 else bf16), both [BN, BKH]
    if USE_ASM and not SELECT_ZERO:
        # packed PTX decode (kernels/pk_decode.py), straight to the operand dtype
        if Q8:
            E8 = _q8_base(E).to(tl.int16)
            wa = decode_pk(h_a8, h_a8, E8, 2, F32)
            wb = decode_pk(h_b8, h_b8, E8, 2, F32)
        else:
            lo8 = tl.load(lo_p)
            wa = decode_pk(h_a8, lo8, E16, 0, F32)
            wb = decode_pk(h_b8, lo8, E16, 1, F32)
    else:
        h_a = h_a8.to(tl.int32)
        h_b = h_b8.to(tl.int32)
        if Q8:
            E8 = _q8_base(E)
            ba = _decode_bits_q8(h_a, E8)
            bb = _decode_bits_q8(h_b, E8)
        else:
            lo = tl.load(lo_p).to(tl.int32)
            ba = _decode_bits(h_a, lo & 0xF, E, SELECT_ZERO)
            bb = _decode_bits(h_b, lo >> 4, E, SELECT_ZERO)
        if F32:
            wa = _bits_to_f32(ba)
            wb = _bits_to_f32(bb)
        else:
            wa = _bits_to_bf16(ba)
            wb = _bits_to_bf16(bb)
    return wa, wb


@triton.jit
def _to_out(acc, out_ty: tl.constexpr):
    # fp32 -> output dtype, round-to-nearest-even. bf16 by integer rounding: the same bits as the
    # GPU's cvt.rn, and the interpreter (which truncates fp32 -> bf16) agrees with the GPU.
    if out_ty == tl.bfloat16:
        b = acc.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)  # NaN stays (quiet) NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(out_ty)


@triton.jit
def _escape_rows(rows, row_ok, e0_ptr, rowptr_ptr, Q8: tl.constexpr):
    """For the escape epilogues (here and kernels/batch.py): each row's first CSR entry and escape count, and v0
    [BN, 1], what the dense decode gave at an escape's place (code 0: 2^(e0 - 127); Q8: the 8-bit view of hi byte
    0, _q8_base), in fp32."""
    rp0 = tl.load(rowptr_ptr + rows, mask=row_ok, other=0)
    cnt = tl.load(rowptr_ptr + rows + 1, mask=row_ok, other=0) - rp0
    e0 = tl.load(e0_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    if Q8:
        v0 = (tl.where(e0 > 0, (e0 << 23) | 0x80000, 0).to(tl.float32, bitcast=True))[:, None]
    else:
        v0 = ((e0 << 23).to(tl.float32, bitcast=True))[:, None]
    return rp0, cnt, v0


@triton.jit
def _apply_escapes(acc, rows, toks, row_ok, tok_ok, x_ptr, stride_xm, stride_xk, e0_ptr, rowptr_ptr, col_ptr,
                   val_ptr, ZERO_DENSE: tl.constexpr, Q8: tl.constexpr = False):
    # acc: [BN, BT] fp32; rows: [BN]; toks: [BT]
    rp0, cnt, v0 = _escape_rows(rows, row_ok, e0_ptr, rowptr_ptr, Q8)
    x_row = x_ptr + toks.to(tl.int64)[None, :] * stride_xm  # [1, BT]
    n_max = tl.max(cnt, axis=0)
    for j in range(0, n_max):
        has = (j < cnt) & row_ok
        idx = rp0 + j
        col = tl.load(col_ptr + idx, mask=has, other=0)
        val = _bits_to_f32(tl.load(val_ptr + idx, mask=has, other=0).to(tl.int32))[:, None]  # [BN, 1]
        ok = has[:, None] & tok_ok[None, :]
        xv = tl.load(x_row + col.to(tl.int64)[:, None] * stride_xk, mask=ok, other=0.0).to(tl.float32)  # [BN, BT]
        if ZERO_DENSE:  # the dense decode gave +0.0 at escapes
            corr = xv * val
        else:
            corr = xv * val - xv * v0
        # where, not multiply-by-mask: 0 * Inf would turn masked lanes into NaN
        acc += tl.where(ok, corr, 0.0)
    return acc


@triton.jit
def _store_tile(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, bias_ptr, pid_k, M, N,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    # acc: [BN, BT] -> out[M, N] (rounded once) or, with SPLIT, ws[SPLIT_K, M, N] fp32 partials
    offs = toks.to(tl.int64)[None, :] * N + rows[:, None]
    ok = row_ok[:, None] & tok_ok[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs, _to_out(acc, out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=ok)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def w12_matmul_tc_kernel(
    x_ptr, hi_ptr, lo_ptr, e0_ptr, rowptr_ptr, col_ptr, val_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, Kp, stride_lo, stride_xm, stride_xk,
    HAS_BIAS: tl.constexpr, Q8: tl.constexpr, SELECT_ZERO: tl.constexpr, ZERO_DENSE: tl.constexpr, X_F16: tl.constexpr,
    SPLIT_K, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr = False,
    FUSE: tl.constexpr = False,
):
    BKH: tl.constexpr = BLOCK_K // 2
    pid_k = tl.program_id(2)
    rows, toks, row_ok, tok_ok, j, col_a, it0, it1, E, hi_p, lo_p, x_p = _tile_setup(
        x_ptr, hi_ptr, lo_ptr, e0_ptr, M, N, Kp, stride_lo, stride_xm, stride_xk, SPLIT_K, BLOCK_N, BLOCK_T, BLOCK_K)
    # FUSE: the K order inside a tile is k' = h * BKH + j (half h, pair j), the order of the joined tile below
    kf = tl.arange(0, BLOCK_K)
    col_f = col_a_of(kf % BKH) + 32 * (kf // BKH)  # [BK] runs of 32 contiguous columns: vector loads
    xf_p = x_ptr + toks.to(tl.int64)[None, :] * stride_xm + (it0 * BLOCK_K + col_f)[:, None] * stride_xk  # [BK, BT]

    E16 = E.to(tl.int16)  # for the packed decode (USE_ASM; SELECT_ZERO keeps the plain one)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for it in range(it0, it1):
        ka = it * BLOCK_K + col_a  # [BKH]
        h_a8 = tl.load(hi_p)
        h_b8 = tl.load(hi_p + 32)
        if FUSE:
            xf = tl.load(xf_p, mask=(it * BLOCK_K + col_f < K)[:, None] & tok_ok[None, :], other=0.0)  # [BK, BT]
        else:
            xa = tl.load(x_p, mask=(ka < K)[:, None] & tok_ok[None, :], other=0.0)  # [BKH, BT]
            xb = tl.load(x_p + 32 * stride_xk, mask=(ka + 32 < K)[:, None] & tok_ok[None, :], other=0.0)
        wa, wb = _decode_halves(h_a8, h_b8, lo_p, E16, E, Q8, USE_ASM, SELECT_ZERO, X_F16)
        if FUSE:
            # one [BN, BK] operand, one MMA chain of depth BK per iteration (not two of BK/2)
            w = tl.reshape(tl.permute(tl.join(wa, wb), (0, 2, 1)), (BLOCK_N, BLOCK_K))  # [BN, BK] in k' order
            if X_F16:
                acc = tl.dot(w, xf.to(tl.float32), acc, input_precision="tf32")
            else:
                acc = tl.dot(w, xf, acc)
        elif X_F16:
            # bf16 weights and fp16 activations are both exact in tf32: exact products, fp32 sums
            acc = tl.dot(wa, xa.to(tl.float32), acc, input_precision="tf32")
            acc = tl.dot(wb, xb.to(tl.float32), acc, input_precision="tf32")
        else:
            acc = tl.dot(wa, xa, acc)
            acc = tl.dot(wb, xb, acc)
        hi_p += BLOCK_K
        lo_p += BKH
        x_p += BLOCK_K * stride_xk
        xf_p += BLOCK_K * stride_xk

    if pid_k == 0:
        acc = _apply_escapes(acc, rows, toks, row_ok, tok_ok, x_ptr, stride_xm, stride_xk, e0_ptr, rowptr_ptr,
                             col_ptr, val_ptr, ZERO_DENSE, Q8)
    _store_tile(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, bias_ptr, pid_k, M, N, SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def w12_splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # out[M, N] = sum_s ws[s, M, N] (fixed order) + bias, rounded once
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    MN = tl.cast(M, tl.int64) * N  # tl.cast: M may arrive as a Python int (torch.compile specialises M == 1)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _to_out(acc, out_ptr.dtype.element_ty), mask=ok)
