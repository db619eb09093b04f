"""The certified head's Triton kernels (all variants; tl.dot lowers to wgmma or mma.sync by tile shape).

1. `lmhead_screen_kernel`: one program per BV vocabulary rows, all M hidden rows. Reads the cheap copy
   (INT8 codes with BF16 group scales, or the W12 8-bit view: `hi` bytes with the row's exponent base),
   forms the screen logit and the radius of its interval (docs/lmhead.md), writes the bounds L and U,
   and raises each row's best lower bound (atomic max).
2. `lmhead_select_kernel`: one program per (BV rows, hidden row): the tokens whose U reaches the
   row's threshold are appended to the row's survivor list (atomic counter, `CAP` slots).
3. `lmhead_exact_kernel`: the exact logits of listed rows (survivors, or every row), fp32 in one
   fixed order; for argmax it folds (logit, token id) into one int64 key and takes the atomic max.
   Rows whose survivors overflowed (or whose hidden state is not finite) are redone over the whole
   vocabulary by the same code (`FULL`), in the same launch sequence; the survivors pass skips them.
4. `lmhead_policy_kernel`: the early fallback of one row count (docs/lmhead.md), one program. At the start
   of a call it decides whether the call skips the screen and writes the flag that the screen, selection
   and survivors kernels read to return at once (the full pass then takes every row); after the selection
   it lengthens or resets the run of skipped calls.

The key: the logit's bits mapped to a signed integer in float order (+0 and -0 equal; NaN above +Inf),
shifted up 32 bits, and (2^32 - 1 - id) below, so the maximum key is the largest logit with the lowest
id among equals.
"""

import triton
import triton.language as tl


@triton.jit
def _view_w12(hi, e0):
    """The W12 8-bit view of `hi` bytes (uint8 as int32) with row exponent bases `e0` (int32), as BF16:
    the midpoint of the 16 BF16 values sharing the byte, the lowest of them where e0 = 0 (docs/w12-format.md)."""
    bits = (((hi & 0x7F) << 4) + tl.where(e0 > 0, (e0 << 7) + 8, 0)) | ((hi & 0x80) << 8)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _code_w12(hi, nib, e0):
    """BF16 weights from W12 codes (hi byte, low nibble) and row bases: code 0 is +0.0 (escapes too)."""
    c = (hi << 4) | nib
    bits = ((c & 0x7FF) + (e0 << 7)) | ((c & 0x800) << 4)
    return tl.where(c == 0, 0, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def lmhead_screen_kernel(h_ptr, hq_ptr, w_ptr, sc_ptr, err_ptr, n1_ptr, rq_ptr, rw_ptr, dw_ptr, a_ptr, sh_ptr,
                         eh_ptr, dh_ptr, hqn_ptr, hn_ptr, bad_ptr, lo_ptr, up_ptr, best_ptr, skip_ptr, M, V, H, G,
                         stride_hm, stride_wv, stride_tv,
                         gamma_q, gamma_w, eta,
                         MP: tl.constexpr, BV: tl.constexpr, GROUP: tl.constexpr, W12: tl.constexpr,
                         INT4: tl.constexpr = False, SPLIT: tl.constexpr = False):
    """Screen logits and their intervals for BV vocabulary rows and M (<= MP) hidden rows.

    INT8 (W12 False): the hidden states are quantised per group too (hq, scales sh, errors eh), so each
    group's dot is an exact int8 tensor-core product: acc = sum_g sc[v,g] sh[m,g] (q_v . hq_m)_g. INT4: the same
    with codes in [-7, 7] packed two to a byte (lmhead.ops._pack4: byte j of a group holds columns j and
    GROUP / 2 + j), unpacked to int8 in registers, each group two exact int8 products of GROUP / 2 columns.
    W12: the 8-bit view decoded to BF16 (exact), times the BF16 hidden states, fp32 accumulation.
    Radius: min(sum_g err[v,g] a[m,g], dw[v] hn[m]) (+ min(sum_g n1[v,g] eh[m,g], rq[v] dh[m]) for INT8)
    + gamma_q rq[v] hqn[m] + gamma_w rw[v] hn[m] + eta (docs/lmhead.md).
    SPLIT (INT8 and INT4, 2 M <= MP): the hidden states come in two int8 parts, hq and sh [2 M, ...] with row
    M + m the first part's rounding of row m quantised again; the tile's rows MP / 2 + m hold the second parts,
    accumulated like the first and added to them once after the loop (eh, dh: the rounding left after both).
    skip_ptr (int32, or None): nonzero when the policy skips this call's screen; nothing is written then."""
    if skip_ptr is not None:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    offs_v = pid * BV + tl.arange(0, BV)
    ok_v = offs_v < V
    MH: tl.constexpr = MP // 2 if SPLIT else MP  # hidden rows of the bound's tiles
    offs_m = tl.arange(0, MH)
    ok_m = offs_m < M
    # rows of the dot's tile: hidden row r % MH, its part r // MH (0 without SPLIT), at row part M + r % MH of hq
    offs_r = tl.arange(0, MP)
    ok_r = (offs_r % MH) < M
    row_r = (offs_r // MH) * M + offs_r % MH
    acc = tl.zeros([MP, BV], tl.float32)
    ew = tl.zeros([MH, BV], tl.float32)  # Hölder per group: the weights' rounding against |h|
    eh_b = tl.zeros([MH, BV], tl.float32)  # the same for the hidden states' rounding (INT8)
    if W12:
        e0 = tl.load(sc_ptr + offs_v, mask=ok_v, other=0).to(tl.int32)
    for g in range(0, G):
        offs_k = g * GROUP + tl.arange(0, GROUP)
        ok_k = offs_k < H
        okh = ok_m[:, None] & ok_k[None, :]
        if not INT4:
            c = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * stride_wv + offs_k[None, :],
                        mask=ok_v[:, None] & ok_k[None, :], other=0)
        if W12:
            h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], mask=okh, other=0.0)
            wq = _view_w12(c.to(tl.int32), e0[:, None])
            acc += tl.dot(h, tl.trans(wq))
        else:
            s = tl.load(sc_ptr + offs_v * stride_tv + g, mask=ok_v, other=0.0).to(tl.float32)
            sh = tl.load(sh_ptr + row_r * G + g, mask=ok_r, other=0.0)
            if INT4:
                j = tl.arange(0, GROUP // 2)
                ka = g * GROUP + j
                kb = ka + GROUP // 2
                b = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * stride_wv + (g * (GROUP // 2) + j)[None, :],
                            mask=ok_v[:, None], other=0).to(tl.int32)
                ca = (((b & 0xF) ^ 8) - 8).to(tl.int8)
                cb = ((((b >> 4) & 0xF) ^ 8) - 8).to(tl.int8)
                hqa = tl.load(hq_ptr + row_r[:, None] * H + ka[None, :], mask=ok_r[:, None] & (ka < H)[None, :],
                              other=0)
                hqb = tl.load(hq_ptr + row_r[:, None] * H + kb[None, :], mask=ok_r[:, None] & (kb < H)[None, :],
                              other=0)
                dot = tl.dot(hqa, tl.trans(ca)) + tl.dot(hqb, tl.trans(cb))  # exact in int32
            else:
                hq = tl.load(hq_ptr + row_r[:, None] * H + offs_k[None, :], mask=ok_r[:, None] & ok_k[None, :], other=0)
                dot = tl.dot(hq, tl.trans(c))
            acc += dot.to(tl.float32) * (sh[:, None] * s[None, :])
            n1 = tl.load(n1_ptr + offs_v * stride_tv + g, mask=ok_v, other=0.0).to(tl.float32)
            eh = tl.load(eh_ptr + offs_m * G + g, mask=ok_m, other=0.0)
            eh_b += eh[:, None] * n1[None, :]
        e = tl.load(err_ptr + offs_v * stride_tv + g, mask=ok_v, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + offs_m * G + g, mask=ok_m, other=0.0)
        ew += a[:, None] * e[None, :]
    if SPLIT:  # each hidden row's two parts: one fp32 addition (within the gamma_q term's count)
        acc = tl.sum(tl.reshape(acc, [2, MH, BV]), 0)
    rq = tl.load(rq_ptr + offs_v, mask=ok_v, other=0.0)
    rw = tl.load(rw_ptr + offs_v, mask=ok_v, other=0.0)
    hqn = tl.load(hqn_ptr + offs_m, mask=ok_m, other=0.0)
    hn = tl.load(hn_ptr + offs_m, mask=ok_m, other=0.0)
    # each rounding term: the smaller of Hölder per group and Cauchy-Schwarz over the row (both rigorous;
    # the first wins for outlier-heavy hidden states, the second for spread ones)
    dw = tl.load(dw_ptr + offs_v, mask=ok_v, other=0.0)
    dh = tl.load(dh_ptr + offs_m, mask=ok_m, other=0.0)
    ew = tl.minimum(ew, hn[:, None] * dw[None, :])
    if not W12:
        ew += tl.minimum(eh_b, dh[:, None] * rq[None, :])
    r = ew + gamma_q * hqn[:, None] * rq[None, :] + gamma_w * hn[:, None] * rw[None, :] + eta
    r = r * 1.00006103515625  # (1 + 2^-14): the radius's own fp32 sums (at most 2G + 4 terms, G <= 512)
    r = r + (tl.abs(acc) + r) * 2.384185791015625e-07  # 2^-22: so that acc -/+ r rounds outside [L, U]
    # no bound where a sum could leave fp32's range: ||W|| ||h|| (and ||ŵ|| ||ĥ||) bound every partial sum of
    # the exact (and the screen's) dot; a row with a non-finite weight has rw = inf: these always survive
    safe = (hn[:, None] * rw[None, :] < 8.507059173023462e+37) & (hqn[:, None] * rq[None, :] < 8.507059173023462e+37)
    safe = safe & (r < float("inf")) & (tl.abs(acc) < float("inf"))  # (NaN compares false)
    lo = tl.where(safe, acc - r, float("-inf"))
    up = tl.where(safe, acc + r, float("inf"))
    at = offs_m[:, None] * V + offs_v[None, :]
    ok = ok_m[:, None] & ok_v[None, :]
    if lo_ptr is not None:  # argmax needs only U and the best L
        tl.store(lo_ptr + at, lo, mask=ok)
    tl.store(up_ptr + at, up, mask=ok)
    bad = tl.load(bad_ptr + offs_m, mask=ok_m, other=1)
    best = tl.max(tl.where(ok_v[None, :], lo, float("-inf")), 1)
    tl.atomic_max(best_ptr + offs_m, best, mask=ok_m & (bad == 0))


@triton.jit
def lmhead_select_kernel(up_ptr, thr_ptr, bad_ptr, count_ptr, surv_ptr, skip_ptr, V, CAP, BV: tl.constexpr):
    if skip_ptr is not None:  # a skipped screen wrote no bounds: every count stays 0
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    m = tl.program_id(1)
    if tl.load(bad_ptr + m) != 0:  # non-finite hidden state: the full exact path takes this row
        return
    offs = pid * BV + tl.arange(0, BV)
    ok = offs < V
    u = tl.load(up_ptr + m * V + offs, mask=ok, other=float("-inf"))
    keep = ok & (u >= tl.load(thr_ptr + m))
    n = tl.sum(keep.to(tl.int32), 0)
    if n > 0:
        base = tl.atomic_add(count_ptr + m, n)
        pos = base + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(surv_ptr + m * CAP + pos, offs, mask=keep & (pos < CAP))


@triton.jit
def _key(x, ids):
    x = tl.where(x == 0.0, 0.0, x)  # -0 == +0: equal logits tie on the id
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    o = tl.where(x != x, 0x7FFFFFFF, o)  # NaN: the largest (torch.argmax's convention)
    return (o.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


@triton.jit
def _exact_tile(h_ptr, stride_hm, rows_m, ok_m, w_ptr, lo_ptr, e0_ptr, rowptr_ptr, ecol_ptr, eval_ptr, stride_wv,
                stride_lv, ids, ok, H, MP: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, W12: tl.constexpr,
                ASM_LO: tl.constexpr = None, ASM_HI: tl.constexpr = None):
    """fp32 logits [MP, BS] of hidden rows `rows_m` against head rows `ids`, in the one order every exact
    logit of the head has: BK-column blocks in turn on the tensor cores (BF16 products, fp32 accumulation;
    a W12 head: 32-column halves of each 64-column group, decoded from the W12 codes), then, for a W12
    head, the row's escapes in column order (an escape's dense code decodes to +0.0).
    A logit depends only on its own hidden row and head row, so survivors and full passes agree bit for bit.
    ASM_LO / ASM_HI (a W12 head on a GPU): the PTX of `w12.kernels.pk_decode.asm_text("lo0" / "hi0", "bf16")`,
    the same bits two weights per 32-bit op (the plain decode spent ~12 integer ops a weight and bound the full pass:
    1.21 ms on the H200 against 0.60 for a BF16 head); None: the plain decode (`_code_w12`)."""
    acc = tl.zeros([MP, BS], tl.float32)
    rows = ids[:, None].to(tl.int64)
    okm = ok_m[:, None]
    if W12:
        # each 64-column group: its low-nibble byte row serves columns j and 32 + j; the two halves are
        # two K = 32 products, in this order, for every logit
        e0 = tl.load(e0_ptr + ids, mask=ok, other=0).to(tl.int32)[:, None]
        j = tl.arange(0, 32)
        for k0 in range(0, H, 64):
            ka = k0 + j
            kb = ka + 32
            oka = ok[:, None] & (ka < H)[None, :]
            okb = ok[:, None] & (kb < H)[None, :]
            lo = tl.load(lo_ptr + rows * stride_lv + (k0 // 2 + j)[None, :], mask=oka, other=0)
            hia = tl.load(w_ptr + rows * stride_wv + ka[None, :], mask=oka, other=0)
            hib = tl.load(w_ptr + rows * stride_wv + kb[None, :], mask=okb, other=0)
            ha = tl.load(h_ptr + rows_m[:, None] * stride_hm + ka[None, :], mask=okm & (ka < H)[None, :], other=0.0)
            hb = tl.load(h_ptr + rows_m[:, None] * stride_hm + kb[None, :], mask=okm & (kb < H)[None, :], other=0.0)
            if ASM_LO is not None:
                e16 = (e0 << 7).to(tl.int16)
                wa = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r,r,r,r", [hia, lo, e16], tl.bfloat16, True, 4)
                wb = tl.inline_asm_elementwise(ASM_HI, "=r,=r,r,r,r,r", [hib, lo, e16], tl.bfloat16, True, 4)
            else:
                lo32 = lo.to(tl.int32)
                wa = _code_w12(hia.to(tl.int32), lo32 & 0xF, e0)
                wb = _code_w12(hib.to(tl.int32), (lo32 >> 4) & 0xF, e0)
            acc = tl.dot(ha, tl.trans(wa), acc)
            acc = tl.dot(hb, tl.trans(wb), acc)
    else:
        for k0 in range(0, H, BK):
            offs_k = k0 + tl.arange(0, BK)
            ok_k = offs_k < H
            w = tl.load(w_ptr + rows * stride_wv + offs_k[None, :], mask=ok[:, None] & ok_k[None, :], other=0.0)
            h = tl.load(h_ptr + rows_m[:, None] * stride_hm + offs_k[None, :], mask=okm & ok_k[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
    if W12:
        first = tl.load(rowptr_ptr + ids, mask=ok, other=0)
        n_esc = tl.load(rowptr_ptr + ids + 1, mask=ok, other=0) - first
        for j in range(0, tl.max(n_esc, 0)):
            okj = ok & (j < n_esc)
            col = tl.load(ecol_ptr + first + j, mask=okj, other=0)
            val = tl.load(eval_ptr + first + j, mask=okj, other=0).to(tl.int32)
            wv = ((val & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            hv = tl.load(h_ptr + rows_m[:, None] * stride_hm + col[None, :], mask=ok_m[:, None] & okj[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.where(okj[None, :], wv[None, :] * hv, 0.0)
    return acc


@triton.jit
def lmhead_exact_kernel(h_ptr, w_ptr, lo_ptr, e0_ptr, rowptr_ptr, ecol_ptr, eval_ptr, ids_ptr, count_ptr, bad_ptr,
                        fb_ptr, skip_ptr, out_ptr, key_ptr, M, V, H, CAP, stride_hm, stride_wv, stride_lv,
                        MP: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, W12: tl.constexpr, FULL: tl.constexpr,
                        KEYS: tl.constexpr, ALL: tl.constexpr, ASM_LO: tl.constexpr = None,
                        ASM_HI: tl.constexpr = None):
    """FULL: BS vocabulary rows against all M (<= MP) hidden rows (grid V / BS). Flagged rows are those
    whose survivors overflowed CAP or whose hidden state is not finite (ALL: every row); the program does
    nothing unless one is flagged, writes the logits of every row to out ([M, V]) when given, and the keys
    of flagged rows; program 0 adds the flagged rows to the fallback counter fb. Where the policy skipped
    the screen (skip_ptr nonzero) every row is flagged and none is counted. Otherwise: BS listed
    survivors of hidden row r (grid CAP / BS, M), the first `count`, computed on the very tile of
    hidden rows the full pass uses (the launch's M rows), so every logit comes out of the same products;
    out ([M, CAP]) gets -inf past the count. A row over CAP (the full pass takes it) and a skipped call
    compute nothing and write nothing. ASM_LO / ASM_HI: a W12 head's packed decode (`_exact_tile`)."""
    pid = tl.program_id(0)
    if FULL:
        offs_m = tl.arange(0, MP)
        ok_m = offs_m < M
        if ALL:
            flag = ok_m.to(tl.int32)
        else:
            cnt = tl.load(count_ptr + offs_m, mask=ok_m, other=0)
            flag = (ok_m & ((cnt > CAP) | (tl.load(bad_ptr + offs_m, mask=ok_m, other=0) != 0))).to(tl.int32)
        fell = flag
        if skip_ptr is not None:  # a skipped screen: the plain exact head for every row, no fallback counted
            skip = tl.load(skip_ptr)
            fell = tl.where(skip != 0, 0, flag)
            flag = tl.where(skip != 0, ok_m.to(tl.int32), flag)
        if tl.max(flag, 0) == 0:
            return
        if fb_ptr is not None:
            if pid == 0:
                tl.atomic_add(fb_ptr, tl.sum(fell, 0).to(tl.int64))
        offs = pid * BS + tl.arange(0, BS)
        ok = offs < V
        x = _exact_tile(h_ptr, stride_hm, offs_m, ok_m, w_ptr, lo_ptr, e0_ptr, rowptr_ptr, ecol_ptr, eval_ptr,
                        stride_wv, stride_lv, offs, ok, H, MP, BS, BK, W12, ASM_LO, ASM_HI)
        if out_ptr is not None:
            tl.store(out_ptr + offs_m[:, None] * V + offs[None, :], x, mask=ok_m[:, None] & ok[None, :])
        if KEYS:
            k = tl.where(ok[None, :], _key(x, offs[None, :]), -9223372036854775807)
            tl.atomic_max(key_ptr + offs_m, tl.max(k, 1), mask=ok_m & (flag != 0))
    else:
        r = tl.program_id(1)  # hidden row r of this launch's rows (the full pass's tile of rows)
        if skip_ptr is not None:
            if tl.load(skip_ptr) != 0:
                return
        n = tl.load(count_ptr + r)
        if (n > CAP) | (pid * BS >= n):  # over CAP: the full pass recomputes the whole row anyway
            return
        slot = pid * BS + tl.arange(0, BS)
        ok = slot < n
        ids = tl.load(ids_ptr + r * CAP + slot, mask=ok, other=0)
        offs_m = tl.arange(0, MP)
        tile = _exact_tile(h_ptr, stride_hm, offs_m, offs_m < M, w_ptr, lo_ptr, e0_ptr, rowptr_ptr, ecol_ptr, eval_ptr,
                           stride_wv, stride_lv, ids, ok, H, MP, BS, BK, W12, ASM_LO, ASM_HI)
        x = tl.sum(tl.where(offs_m[:, None] == r, tile, -0.0), 0)  # row r exactly: x + (-0) == x, -0 and NaN kept
        if out_ptr is not None:
            tl.store(out_ptr + r * CAP + slot, tl.where(ok, x, float("-inf")), mask=slot < CAP)
        if KEYS:
            tl.atomic_max(key_ptr + r, tl.max(tl.where(ok, _key(x, ids), -9223372036854775807), 0))


@triton.jit
def _norm_up(ss, amax, row_up):
    """An upper bound of ||x||_2 from ss = the sum of (x / amax)^2: sqrt_rn and the two products one rounding each,
    covered by (1 + 2^-20); + 2^-149 for a result below fp32's normal range, which rounds by up to 2^-150."""
    return tl.sqrt_rn(ss * row_up) * amax * 1.00000095367431640625 + 1.401298464324817e-45


@triton.jit
def _scale16(amax):
    """A group's int8 scale: amax / 127 rounded up to 16 significant bits (1 for amax = 0). 16 bits keep s q exact in
    fp32 for |q| <= 127, and so the rounding x - s q as well."""
    s = tl.where(amax > 0, amax / 127.0 * 1.0000002384185791, 1.0)  # (1 + 2^-22): at least amax / 127
    b = s.to(tl.int32, bitcast=True)
    return ((b + 0xFF) & -256).to(tl.float32, bitcast=True)


@triton.jit
def _int8_part(x):
    """One int8 part of x [GP, GROUP] (a group a row): (s, q, x - s q) with s = `_scale16`(max|x|) and q = round(x /
    s) in [-127, 127]. The rounding x - s q is exact: s q has 16 + 7 significant bits, and q = 0 or s q lies within
    x / 2 of x (Sterbenz)."""
    s = _scale16(tl.max(tl.abs(x), 1))
    q = tl.minimum(tl.maximum(tl.floor(x / s[:, None] + 0.5), -127.0), 127.0)
    return s, q, x - s[:, None] * q


@triton.jit
def lmhead_prep_kernel(h_ptr, a_ptr, hn_ptr, bad_ptr, hq_ptr, sh_ptr, eh_ptr, dh_ptr, hqn_ptr, best_ptr, count_ptr,
                       key_ptr, M, H,
                       G, stride_hm, row_up, GP: tl.constexpr, GROUP: tl.constexpr, INT8: tl.constexpr,
                       SPLIT: tl.constexpr = False):
    """Per hidden row m (one program, the row as one [GP, GROUP] tile): bad = any non-finite entry (read
    as 0 below); a[m, g] = ||h_g||_1 and hn = ||h||_2 rounded up; INT8: hq = round(h / sh) in
    [-127, 127] with sh = max|h_g| / 127 (slightly above), eh[m, g] >= max |h - sh hq|, hqn >= ||sh hq||_2,
    dh >= ||h - sh hq||_2.
    Scales have 16 significant bits (`_scale16`), so every rounding h - sh hq is exact in fp32: eh is its maximum.
    SPLIT (INT8): a second part too, rows M + m of hq and sh: the first part's rounding quantised the same way;
    eh, dh the rounding left after both (exact too); hqn >= ||sh hq||_2 + ||sh2 hq2||_2 (what the screen's
    rounding term needs: the sum of its terms' magnitudes is at most ||screen row|| times that).
    Also resets the call's per-row state: best = -inf, count = 0, key = the least key.
    Rounding up: a sum of n >= 0 fp32 terms is within (n - 1) 2^-24 of its value (relative), covered by
    (1 + 2^-16) for the 128-term groups and `row_up` = 1 + (H + 8) 2^-23 for the row (the scaling by
    1 / max|x|, which keeps squares from overflowing or underflowing, adds a few roundings per term)."""
    m = tl.program_id(0)
    gi = tl.arange(0, GP)
    offs = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = offs < H
    xb = tl.load(h_ptr + m * stride_hm + offs, mask=ok, other=0.0)
    # BF16 -> fp32 by its bits (exact; Triton's interpreter converts BF16 subnormals wrongly)
    x = (xb.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    fin = tl.abs(x) < float("inf")
    nonfin = tl.sum(tl.sum((~fin).to(tl.int32), 1), 0)
    x = tl.where(fin, x, 0.0)
    ax = tl.abs(x)
    okg = gi < G
    # (1 + 2^-16) for the sum's roundings; + GROUP 2^-149 where its additions fall below fp32's normal range
    tl.store(a_ptr + m * G + gi, tl.sum(ax, 1) * 1.0000152587890625 + GROUP * 1.401298464324817e-45, mask=okg)
    amax_g = tl.max(ax, 1)
    amax_row = tl.max(amax_g, 0)
    inv = tl.where(amax_row > 0, 1.0 / amax_row, 0.0)
    xs = x * inv
    ss = tl.sum(tl.sum(xs * xs, 1), 0)
    tl.store(hn_ptr + m, _norm_up(ss, amax_row, row_up))
    tl.store(bad_ptr + m, (nonfin > 0).to(tl.int32))
    tl.store(best_ptr + m, float("-inf"))
    tl.store(count_ptr + m, 0)
    tl.store(key_ptr + m, -9223372036854775807 - 1)
    if INT8:
        s, q, rho = _int8_part(x)
        tl.store(hq_ptr + m * H + offs, q.to(tl.int8), mask=ok)
        tl.store(sh_ptr + m * G + gi, s, mask=okg)
        xq = s[:, None] * q * inv
        ssq = tl.sum(tl.sum(xq * xq, 1), 0)
        hqn = _norm_up(ssq, amax_row, row_up)
        if SPLIT:
            s2, q2, rho = _int8_part(rho)  # what the first part left
            tl.store(hq_ptr + (M + m) * H + offs, q2.to(tl.int8), mask=ok)
            tl.store(sh_ptr + (M + m) * G + gi, s2, mask=okg)
            xq2 = s2[:, None] * q2 * inv
            ssq2 = tl.sum(tl.sum(xq2 * xq2, 1), 0)
            hqn = (hqn + _norm_up(ssq2, amax_row, row_up)) * 1.00000011920928955078125
        r = tl.abs(rho)
        tl.store(hqn_ptr + m, hqn)
        tl.store(eh_ptr + m * G + gi, tl.max(r, 1), mask=okg)
        rs = r * 1.0000002384185791 * inv  # |h - ĥ| rounded up, scaled
        sr = tl.sum(tl.sum(rs * rs, 1), 0)
        tl.store(dh_ptr + m, _norm_up(sr, amax_row, row_up))


@triton.jit
def lmhead_policy_kernel(state_ptr, count_ptr, M, CAP, MAX_SKIP: tl.constexpr, BM: tl.constexpr, END: tl.constexpr):
    """The early fallback of one row count, one program. state (int32): [0] skip this call's screen,
    [1] calls left to skip, [2] the run a failed screen starts (1, 2, 4, ..., MAX_SKIP), [3] calls,
    [4] calls skipped.
    Start (END False): skip while calls are left, counting them down.
    End (END True, after the selection, count [M] the survivors per row): a screened call with a row over CAP
    skips the next `run` calls and doubles the run (at most MAX_SKIP); a screened call without one resets
    the run to 1; a skipped call changes nothing."""
    if END:
        over = tl.zeros([BM], tl.int32)
        for m0 in range(0, M, BM):
            offs = m0 + tl.arange(0, BM)
            over = over | (tl.load(count_ptr + offs, mask=offs < M, other=0) > CAP).to(tl.int32)
        screened = tl.load(state_ptr) == 0
        failed = screened & (tl.max(over, 0) != 0)
        left = tl.load(state_ptr + 1)
        run = tl.load(state_ptr + 2)
        tl.store(state_ptr + 1, tl.where(failed, run, left))
        tl.store(state_ptr + 2, tl.where(failed, tl.minimum(2 * run, MAX_SKIP), tl.where(screened, 1, run)))
    else:
        left = tl.load(state_ptr + 1)
        skip = (left > 0).to(tl.int32)
        tl.store(state_ptr, skip)
        tl.store(state_ptr + 1, left - skip)
        tl.store(state_ptr + 3, tl.load(state_ptr + 3) + 1)
        tl.store(state_ptr + 4, tl.load(state_ptr + 4) + skip)
