"""The runtime layout's (w12/layout.py) tensor-core GEMM for many rows of x: `out[M, N] = x[M, K] @ W[N, K]^T`,
swap-AB, `acc[BN, BT] = W_tile[BN, BK] @ xT_tile[BK, BT]`, with up to 256 rows of x on the MMA's N dimension, so
that a batch verify step of 33-256 rows reads and decodes the weight once (the flow kernel takes 32 rows a launch).
On sm_90 Triton lowers `tl.dot` to wgmma, elsewhere to mma.sync.

A program owns BLOCK_N weight rows (any row blocks of the layout, the partial last one included) and BLOCK_T rows of
x, and walks its K share in steps of GROUPS full 64-column groups (the tiles of its row blocks), then, in the last K
share, the masked last group (the layout's tail). Within a 64-column group the runtime layout keeps each row's 64 hi
bytes in column order and its 32 lo bytes as pairs: byte 8 p + j holds the low nibble of column 16 p + j and, in its
high nibble, that of column 16 p + j + 8 (p < 4, j < 8). The kernel therefore takes a group as two halves, "a"
(columns 16 p + j) and "b" (the same + 8), each [BN, 32]: half a's hi bytes are runs of 8, half b's the next 8, and
both decode against the same lo bytes, one 32-byte run a row. Each load takes whole sectors: a group's hi bytes in
one [BN, 32] load, split into the halves in registers, and x's 64 columns in one load in the MMA's k order (half a's
columns, then half b's: runs of 8 columns), so that each group of a step is one MMA of depth 64; the groups of a step
are loaded apart (each its own contiguous runs, which the compiler's copies keep; one tensor across groups would not
be contiguous). No byte is shuffled in memory.

KT (`BatchConfig.kt`) orders a group's k so that a thread's pairs of a row are adjacent in the tile: k = 32 h + 2 s +
b, h the half of the group's natural columns (0-31, 32-63), s < 16 a slot pair, b its column, is column pair
16 h + 4 (s % 4) + s // 4. Each half's lo nibbles are moved to the low nibbles in registers, so both halves decode as
half a; the tile copies are 16-byte ones and x is read in runs of two columns.

Decode: code = hi << 4 | nib, bits = ((code & 0x7FF) + (e0 << 7)) | ((code & 0x800) << 4). The main loop reads the
tiles as int16 pairs of adjacent columns (a pair's two hi bytes, and the lo byte pair that holds their nibbles), so
that on a GPU each pair decodes in the flow kernel's four instructions (`pk_decode.asm_text` modes `lo4` / `hi4`,
two pairs a call) into one 32-bit word whose halves are the two columns' BF16 bits, in the order the weight operand
takes them; the interpreter runs the same decode as integer ops. Code 0, where an escape sits, so reads as v0 =
2^(e0 - 127); the epilogue takes x * v0 back and adds x * value, in that order, for each escape of the program's
rows in its K share's columns (the flow kernel's correction: where x = I the result is the weight `w12.unpack`
gives, bit for bit, at any split). The 8-bit view (Q8) reads the hi bytes alone, each as its bin's midpoint
(`w12.reference.q8_view_bits`); an escape's hi byte 0 reads as that row's hi-0 value, which the epilogue takes back
the same way. fp16 x multiplies the decoded weight in fp32 (tf32 MMAs: bf16 weights and fp16 x are exact there), so
the products are exact and only the fp32 sums round. Where x itself is +-Inf or NaN at an escape's column the output
may be NaN where F.linear gives +-Inf (as every W12 kernel's; `w12.matmul`'s doc).

Split-K: program (n, t, k) takes K steps [it0, it1) of its share; with SPLIT the fp32 partials go to ws[SPLIT_K, M,
N] and `w12_splitk_reduce_kernel` (kernels/tc.py) adds them in a fixed order with the bias and rounds once; with
FIXUP the share that finishes last adds them in the same order instead (a counter a tile, no second launch), so both
give the same bits whichever share is last. Without a split the program adds the bias and rounds once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .pk_decode import asm_text
from .tc import (_bits_to_f32, _decode_bits, _decode_bits_q8, _escape_rows, _program_block, _q8_base, _store_tile,
                 _to_out)

__all__ = ["w12_batch_kernel"]

# the packed decode of two pairs a call (pk_decode's register convention: outputs, then hi, lo, two row bases); the
# 8-bit view's base register is the view's row constant (tc._q8_base) in both 16-bit halves
_ASM_LO4 = tl.constexpr(asm_text("lo4", "bf16"))
_ASM_HI4 = tl.constexpr(asm_text("hi4", "bf16"))
_ASM_Q8 = tl.constexpr(asm_text("q8", "bf16"))


@triton.jit
def _pair_bits(v, HIGH: tl.constexpr, Q8: tl.constexpr, l, E):
    """The plain decode of pairs: v, l int32 [BN, P] holding two adjacent columns' hi bytes and lo bytes (the lower
    column in the low byte), E = e0 << 7 ([BN, 1]) -> the two columns' BF16 bits (int32), lower column first."""
    h0 = v & 0xFF
    h1 = (v >> 8) & 0xFF
    if Q8:
        E8 = _q8_base(E)
        b0 = _decode_bits_q8(h0, E8)
        b1 = _decode_bits_q8(h1, E8)
    else:
        s = 4 if HIGH else 0
        b0 = _decode_bits(h0, (l >> s) & 0xF, E, False)
        b1 = _decode_bits(h1, (l >> (8 + s)) & 0xF, E, False)
    return b0, b1


@triton.jit
def _half_weights(h16, lo16, E, E32, HIGH: tl.constexpr, Q8: tl.constexpr, F32: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """One half of a K step from its pairs: h16 and lo16 (int16 [BN, P], each element two adjacent columns' hi or
    lo bytes; lo16 unused for Q8), E = e0 << 7 ([BN, 1] int32) and E32 = E in both 16-bit halves -> the weights,
    bf16 (fp32 with F32) [BN, 2 P] in column order. HIGH: the half whose nibbles are the lo bytes' high ones. On a GPU
    (USE_ASM) a pair is one 32-bit result of the packed decode (two pairs a call), split into its two BF16 halves."""
    if USE_ASM:
        w32 = tl.inline_asm_elementwise(_ASM_Q8 if Q8 else _ASM_HI4 if HIGH else _ASM_LO4, "=r,=r,r,r,r,r",
                                        [h16, lo16, tl.where(E > 0, E32 + 0x80008, 0) if Q8 else E32], tl.int32,
                                        True, 2)
        b0 = w32 & 0xFFFF
        b1 = (w32 >> 16) & 0xFFFF
    else:
        b0, b1 = _pair_bits(h16.to(tl.int32) & 0xFFFF, HIGH, Q8, lo16.to(tl.int32) & 0xFFFF, E)
    if F32:
        w0 = _bits_to_f32(b0)
        w1 = _bits_to_f32(b1)
    else:
        w0 = b0.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w1 = b1.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(w0, w1), (w0.shape[0], 2 * w0.shape[1]))


@triton.jit
def _escapes(acc, rows, toks, row_ok, tok_ok, x_ptr, stride_xm, stride_xk, e0_ptr, rowptr_ptr, col_ptr, val_ptr,
             k_lo, k_hi, Q8: tl.constexpr):
    """acc [BN, BT] with each escape in columns [k_lo, k_hi) (this K share's: the share whose MMA added its dense
    value v0 takes it back) corrected, (acc - x v0) + x value, in fp32: step j takes escape j of every row of the
    program (rows with fewer, and escapes outside the range, are masked, so their x is not read)."""
    rp0, cnt, v0 = _escape_rows(rows, row_ok, e0_ptr, rowptr_ptr, Q8)
    x_row = x_ptr + toks.to(tl.int64)[None, :] * stride_xm  # [1, BT]
    for j in range(0, tl.max(cnt, axis=0)):
        has = (j < cnt) & row_ok
        col = tl.load(col_ptr + rp0 + j, mask=has, other=0)
        has = has & (col >= k_lo) & (col < k_hi)
        val = _bits_to_f32(tl.load(val_ptr + rp0 + j, mask=has, other=0).to(tl.int32))[:, None]  # [BN, 1]
        ok = has[:, None] & tok_ok[None, :]
        xv = tl.load(x_row + col.to(tl.int64)[:, None] * stride_xk, mask=ok, other=0.0).to(tl.float32)  # [BN, BT]
        # where, not a multiply by the mask: 0 * Inf would turn masked lanes into NaN
        acc = tl.where(ok, (acc - xv * v0) + xv * val, acc)
    return acc


@triton.jit
def _last_share_adds(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, cnt_ptr, bias_ptr, pid_k, M, N, SPLIT_K,
                     HAS_BIAS: tl.constexpr):
    """FIXUP: each K share stores its fp32 partial in ws[pid_k], then counts itself in the tile's counter; the share
    that counts last adds ws[0], ws[1], ... in that order (the split-K reduce kernel's order: the same bits), the
    bias, rounds once, stores the output and puts the counter back to 0 for the next launch."""
    offs = toks.to(tl.int64)[None, :] * N + rows[:, None]
    ok = row_ok[:, None] & tok_ok[None, :]
    MN = tl.cast(M, tl.int64) * N
    tl.store(ws_ptr + pid_k.to(tl.int64) * MN + offs, acc, mask=ok)
    tl.debug_barrier()  # every thread's partial stored before the count (released with it)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
        total = tl.zeros(acc.shape, tl.float32)
        for s in range(SPLIT_K):
            # .cg: from L2, where the other shares' released stores are (this SM's L1 is not coherent with them)
            total += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs, _to_out(total, out_ptr.dtype.element_ty), mask=ok)
        tl.store(cnt_ptr + tile, 0)


@triton.jit
def _mma(w, x, acc, F32: tl.constexpr):
    if F32:  # bf16 weights and fp16 x are both exact in tf32: exact products, fp32 sums
        acc = tl.dot(w, x.to(tl.float32), acc, input_precision="tf32")
    else:
        acc = tl.dot(w, x, acc)
    return acc


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def w12_batch_kernel(
    x_ptr, tiles_ptr, e0_ptr, rowptr_ptr, col_ptr, val_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KF, kr, NF, nr, SB, stride_xm, stride_xk, SPLIT_K,
    HAS_BIAS: tl.constexpr, Q8: tl.constexpr, X_F16: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr, USE_ASM: tl.constexpr,
    PDL: tl.constexpr = False, FIXUP: tl.constexpr = False, KT: tl.constexpr = False,
):
    """Program (n, t, k): weight rows BLOCK_N n .., rows of x BLOCK_T t .., K share k. GROUPS must divide KF (the
    main loop's loads carry no mask). PDL (launched with programmatic dependent launch): every program waits for the
    previous grid before its first load, then lets the next grid launch. FIXUP (with SPLIT): the last K share of a
    tile to finish adds the partials (cnt_ptr: one int32 counter a tile, zero between launches) instead of the
    split-K reduce kernel. KT: the k order in which a thread's pairs of a row are adjacent in the tile (module doc)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_k, rows, toks, row_ok, tok_ok = _program_block(M, N, BLOCK_N, BLOCK_T)
    # rows past N read row N - 1 (their results are not stored), so the weight loads need no mask
    rows_c = tl.minimum(rows, N - 1)
    blk = rows_c // 16
    r = rows_c % 16
    R = tl.where(blk < NF, 16, nr)  # rows of each row's block: the partial last block holds nr
    base = blk.to(tl.int64) * SB  # [BN] the row block's first byte
    tstep = (96 * R).to(tl.int64)  # [BN] bytes of one of the row block's tiles
    E = (tl.load(e0_ptr + rows_c).to(tl.int32) << 7)[:, None]  # [BN, 1]

    # The main loop reads the tiles as int16 pairs of adjacent columns. Pair qq of a half of a group (qq < 16) is
    # half a's columns 16 (qq // 4) + 2 (qq % 4) and + 1, hi bytes at int16 32 r + 8 (qq // 4) + qq % 4 of its tile
    # (half b's 4 further), lo bytes at int16 32 R + 16 r + qq.
    qq = tl.arange(0, 16)  # the pairs of one half of one group
    # the MMA's k in one group: half a's columns first, then half b's (k = 32 h + i: pair i // 2, its lower or upper
    # column); x is read in that order by one load a group, so that each copy of a row of x takes whole sectors
    kk = tl.arange(0, 64)
    if KT:
        # k = 32 h + 2 s + b (half h of the group's natural columns, slot pair s, column b of the pair) is column pair
        # 16 h + 4 (s % 4) + s // 4
        sp = (kk % 32) // 2
        col_k = tl.max_contiguous(tl.multiple_of(32 * (kk // 32) + 8 * (sp % 4) + 2 * (sp // 4) + kk % 2, 2), 2)
    else:
        col_k = tl.max_contiguous(tl.multiple_of(16 * ((kk % 32) // 8) + kk % 8 + 8 * (kk // 32), 8), 8)  # runs of 8
    n_it = KF // GROUPS
    per = tl.cdiv(n_it, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)
    gstep = tstep[:, None] // 2  # [BN, 1] int16 elements from one of a row block's tiles to the next
    step = GROUPS * gstep  # [BN, 1] int16 elements a row's pointers advance per K step
    t16 = tiles_ptr.to(tl.pointer_type(tl.int16))
    first = base[:, None] // 2 + it0 * step  # [BN, 1] the step's first tile
    if KT:
        # facts about the offsets (a tile is 48 R int16 elements, a row block SB bytes, both multiples of 16 bytes),
        # so that where the tiles buffer is 16-byte aligned the tile copies are 16-byte ones
        gstep = tl.multiple_of(gstep, [16, 16])
        first = tl.multiple_of(first, [8, 8])
    hi_p = t16 + first + (32 * r)[:, None] + tl.arange(0, 32)[None, :]  # [BN, 32] a row's 64 hi bytes
    lo_p = t16 + first + (32 * R + 16 * r)[:, None] + qq[None, :]
    x_p = x_ptr + toks.to(tl.int64)[None, :] * stride_xm + (it0 * 64 * GROUPS + col_k).to(tl.int64)[:, None] * stride_xk
    x_ok = tok_ok[None, :]
    E32 = E | (E << 16)

    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for _ in range(it0, it1):
        for g in tl.static_range(GROUPS):  # each group's tiles and x loaded apart: contiguous runs the copies keep
            # one load of the group's hi bytes (whole sectors; two interleaved loads of half of each would fetch
            # every sector twice), split into the halves in registers
            hg = tl.load(hi_p + g * gstep)
            if KT:  # int16 16 h + 4 c + j (natural pair) is half h's slot pair 4 j + c
                h = tl.reshape(tl.permute(tl.reshape(hg, (BLOCK_N, 2, 4, 4)), (0, 3, 2, 1)), (BLOCK_N, 16, 2))
            else:  # int16 8 a + 4 b + c is half b's pair 4 a + c
                h = tl.reshape(tl.permute(tl.reshape(hg, (BLOCK_N, 4, 2, 4)), (0, 1, 3, 2)), (BLOCK_N, 16, 2))
            h_a, h_b = tl.split(h)
            if Q8:  # the view decodes the hi bytes alone: the lo operand is not read
                l_a = h_a
                l_b = h_a
            elif KT:
                # slot pair 4 j + 2 c + n of half h (c, n < 2): nibble n (0 low, 1 high) of both bytes of lo int16
                # 8 h + 4 c + j, moved to the low nibbles, so that both halves decode as half a does
                lo = tl.load(lo_p + g * gstep).to(tl.int32)  # [BN, 16]
                lj = tl.reshape(tl.join(lo & 0x0F0F, (lo >> 4) & 0x0F0F), (BLOCK_N, 2, 2, 4, 2))  # [BN, h, c, j, n]
                l_a, l_b = tl.split(tl.reshape(tl.permute(lj, (0, 3, 2, 4, 1)), (BLOCK_N, 16, 2)))
                l_a = l_a.to(tl.int16)
                l_b = l_b.to(tl.int16)
            else:  # both halves read the same lo bytes, half b their high nibbles
                l_a = tl.load(lo_p + g * gstep)
                l_b = l_a
            xg = tl.load(x_p + 64 * g * stride_xk, mask=x_ok, other=0.0)  # [64, BT]
            w_a = _half_weights(h_a, l_a, E, E32, False, Q8, X_F16, USE_ASM)
            w_b = _half_weights(h_b, l_b, E, E32, not KT, Q8, X_F16, USE_ASM)
            w = tl.reshape(tl.permute(tl.join(w_a, w_b), (0, 2, 1)), (BLOCK_N, 64))  # [BN, 64] in k order
            acc = _mma(w, xg, acc, X_F16)
        hi_p += step
        lo_p += step
        x_p += 64 * GROUPS * stride_xk

    if kr > 0:
        if pid_k == SPLIT_K - 1:
            # the masked last group (the layout's tail): hi row-major, kr bytes a row, then the lo nibbles in column
            # order, ceil(kr / 2) bytes a row
            j = tl.arange(0, 64)
            tail = (base + KF * tstep)[:, None]
            ok = (j < kr)[None, :]
            h = tl.load(tiles_ptr + tail + (kr * r)[:, None] + j[None, :], mask=ok, other=0).to(tl.int32)
            if Q8:
                bits = _decode_bits_q8(h, _q8_base(E))
            else:
                lob = tl.load(tiles_ptr + tail + (R * kr + (kr + 1) // 2 * r)[:, None] + (j // 2)[None, :], mask=ok,
                              other=0).to(tl.int32)
                bits = _decode_bits(h, (lob >> (4 * (j % 2))[None, :]) & 0xF, E, False)
            w = _bits_to_f32(bits) if X_F16 else bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            x_cols = (64 * KF + j).to(tl.int64)[:, None] * stride_xk
            xt = tl.load(x_ptr + toks.to(tl.int64)[None, :] * stride_xm + x_cols, mask=(j < kr)[:, None] & x_ok,
                         other=0.0)  # [64, BT]
            acc = _mma(w, xt, acc, X_F16)

    # each K share corrects the escapes in its own columns (the last one's take the masked last group's too), so the
    # epilogue's gathers of x are spread over the shares instead of all on share 0
    # (shares past the last step, where the split does not divide the steps evenly, own no column, the last one but
    # its masked group)
    k_lo = tl.minimum(it0, n_it) * 64 * GROUPS
    k_hi = tl.where(pid_k == SPLIT_K - 1, K, tl.minimum(tl.maximum(it1, it0), n_it) * 64 * GROUPS)
    acc = _escapes(acc, rows, toks, row_ok, tok_ok, x_ptr, stride_xm, stride_xk, e0_ptr, rowptr_ptr, col_ptr, val_ptr,
                   k_lo, k_hi, Q8)
    if FIXUP:
        _last_share_adds(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, cnt_ptr, bias_ptr, pid_k, M, N, SPLIT_K,
                         HAS_BIAS)
    else:
        _store_tile(acc, rows, toks, row_ok, tok_ok, out_ptr, ws_ptr, bias_ptr, pid_k, M, N, SPLIT, HAS_BIAS)
