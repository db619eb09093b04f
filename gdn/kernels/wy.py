"""Tree verification in WY form: one program per (request, value head, V block).

The chain's strictly-lower causal mask becomes the proper-ancestor mask and the cumulative gate
the root-path sum G. With nodes topologically ordered, A (proper-ancestor part) is nilpotent:
A^(d+1) = 0 for a tree of depth d. Ways to invert I + A (WYConfig.inverse; configs.wy_config picks
"split" on sm_90 for one wave of programs at <= 32 nodes, "square" otherwise):
* INV=1 "square": (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...; floor(log2(depth)) rounds of two
  [BT,BT] products each, independent of the node count (5 rounds at most for 64 nodes).
* INV=2 "loop": the same rounds as a runtime loop.
* INV=0 "levels": forward substitution batched over siblings, one product per depth level.
The doubling forms ("square", "loop", "fold", "split") fall back to "levels" when A's powers grow
(GROWTH_MAX below): their fp32 products cancel then.
* INV=3 "fold": the output needs T only as (q.k^T d) T, so that product N is built directly, with
  the power stacked under it: [qkd; A].A = [qkd.A; A^2], then per round [N; P].P = [N.P; P^2], and
  O = eG q S0 + N rhs. r + 2 products (M = 2BT for r + 1 of them) instead of the 2r + 2 of "square",
  and T is never formed.
* INV=4 "split": "fold" in two launches. gdn_tree_split_kernel, one program per (request, value
  head), builds N into a [B, HV, BT, BT] fp32 workspace; this kernel then does everything that
  needs no N (loads, state products, rhs) while that grid still runs, and with PDL waits on it
  only to read N. The inverse runs beside the state phase instead of after it, on other SMs.
  inverse_loop (ILOOP) runs the first launch's rounds as a runtime loop (_fold_rounds with LOOP): one copy of
  the round's code, ~5K SASS instructions instead of ~10-18K executed once per program (the sm_90
  default: B1-N32 524 vs 600 us on H200). handoff="flag" (gdn_tree_flag_kernel) puts
  both halves in one grid, handing N over through flags in TreePlan.sync: opt-in, measured slower.
"fold" does the same FMA work as "square" (its stacked products are twice as tall): on H200, with
PDL, 48 layers, it was slower at B1-N32 (600 vs 554 us) and chain32 (652 vs 597), a little faster
at chain8 (319 vs 325).

Precision. fp32 accuracy is the contract (the state is fp32). SPLIT=True (bf16 q/k): q.k^T and
k.k^T are bf16 tensor-core products of the raw inputs (exact products, fp32 sums) with the L2
norms and the scale applied afterwards; K.S0 and Q.S0 split the fp32 state into three bf16
pieces (8+8+8 mantissa bits), so every tensor-core product is exact. Small [BT,BT]/[BT,BV]
products (inverse, T.rhs, (q.k).U) run at PREC_S ("ieee": plain fp32 FMA, cheap at these sizes).
SPLIT=False (fp32 inputs): every product at PREC.

PREC_I is the precision of the inverse's rounds alone (PREC_S by default): "tf32x3" runs them on
tensor cores (three tf32 products, ~fp32 accuracy) while T.rhs and (q.k).U stay at PREC_S.
(The small products were also tried on the fp64 tensor cores, operands widened exactly and one
rounding to fp32: 32 DMMA instead of ~1800 FFMA per thread, yet slower on H200, B1-N32 739 vs 620 us
for fold with PDL in one run; not kept. Triton 3.6's fp64 mma.sync also asserts on operands with a bf16
origin, "fp64 don't support largeK MMA", unless a run-time branch ends their elementwise history.)

PDL=True (sm_90, launched with launch_pdl): griddepcontrol.wait before the first load (so every
input may come from the kernel just before), then launch_dependents, which lets the next kernel's
programs be placed while this one runs; it hides the launch gap only, no load moves before the wait.

SKIP (diagnostic only, wrong outputs; `WYConfig.skip`) removes phases to time them:
bit 1 the state products (and with them the state load), bit 2 the inverse's rounds, bit 4 the
T.rhs and (q.k).U products (and the inverse with them: nothing reads T then; with "split" the second
launch then neither waits on the first nor reads N, so the first leaves the critical path).

Orientation. TRANS=True computes everything transposed, [BV, BT] instead of [BT, BV]:
(K S0)^T = S0^T K^T is [BV, K] x [K, BT], so the big products have M = BV (64 on sm_90: one
wgmma warpgroup tile) however few nodes the tree has; likewise (Q S0)^T, U^T = rhs^T T^T and
O^T = (eG q S0)^T + U^T (q k^T d)^T. TRANS=False keeps M = BT (mma.sync unless BT >= 64).

Guards and NaN containment (gdn/guard.py). A state index outside [0, pool_rows) skips the program's
stores (the request's outputs are not written) and ORs VERIFY_STATE_INDEX (1) into err, a request with
more nodes than the node tile ORs PLAN_NODES (128) and is skipped too; a gate g > 0 ORs POSITIVE_GATE (64). The dense products multiply every node's row by every other's, and 0 x NaN is
NaN, so a non-finite input would reach nodes outside its subtree. So non-finite entries of q, k, v, g,
beta (and of the derived rows of A and rhs) are replaced by 0 by selection before any product, which
keeps every other node's result bitwise as without them (their rows meet that node's only through exact
zeros), and the outputs of the affected nodes are set to NaN by selection: a node whose own or an
ancestor's k, v, g, beta, A or rhs row held one, or whose own q did. A gate of -inf is non-finite too.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


# Guard of the doubling inverses ("square", "loop", "fold", "split"). Their powers A^(2^i) grow when
# the keys along a path are strongly correlated with large beta (A's row sums above 1): T's entries
# stay O(1) but the partial products cancel, and fp32 loses digits. A CPU sweep over K=128 chains
# (perf/results/cpu-gdn-inverse-stability.txt): at 32 nodes, key correlation 0.7 and beta 1, 6.0e-6
# relative error in T against 3.5e-8 for substitution; at 64 nodes and 0.9, 34 against 6.4e-8. While max |A^(2^i)| <= GROWTH_MAX
# the sweep stayed within 8x substitution's error (a few 1e-7); above it the program recomputes T by
# substitution, one product per depth level ("levels"). Without this guard the kernels' outputs were
# off by 12-27% on hostile inputs (tests test_wy_correlated_keys_stay_accurate, GPU
# test_verify_correlated_keys). The guard costs one reduction and a branch; on H200 the default
# split config went from 530 to 594 us at B1-N32 (different runs on one machine).
GROWTH_MAX = tl.constexpr(1.0)


@triton.jit
def _levels_T(b_A, b_dep, d_max, BT: tl.constexpr, PREC_I: tl.constexpr):
    # (I + A)^-1 by forward substitution batched over siblings: rows of depth d are final once all
    # shallower rows are (one product per depth level)
    o_t = tl.arange(0, BT)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    b_T = eye
    for d in range(1, d_max + 1):
        b_T = tl.where((b_dep == d)[:, None], eye - tl.dot(b_A, b_T, input_precision=PREC_I), b_T)
    return b_T


@triton.jit
def _finite(x):
    # x with its non-finite entries replaced by 0 (selection), and where they were
    fin = tl.abs(x.to(tl.float32)) < float("inf")
    return tl.where(fin, x, tl.zeros_like(x)), ~fin


@triton.jit
def _row_any(bad, AXIS: tl.constexpr):
    # [R, C] bool -> [R] (AXIS=1) or [C] (AXIS=0): whether any entry is set
    return tl.max(bad.to(tl.int32), AXIS) > 0


@triton.jit
def _split3(x):
    # fp32 [M, N] -> three bf16 pieces with x == hi + mid + lo to fp32 accuracy
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _stack(top, bot):
    # two [M, N] tiles -> [2M, N], top rows first
    M: tl.constexpr = top.shape[0]
    N: tl.constexpr = top.shape[1]
    return tl.reshape(tl.permute(tl.join(top, bot), (2, 0, 1)), [2 * M, N])


@triton.jit
def _unstack(x, M: tl.constexpr, N: tl.constexpr):
    # [2M, N] -> its top and bottom [M, N] halves
    return tl.split(tl.permute(tl.reshape(x, [2, M, N]), (1, 2, 0)))


@triton.jit
def _request_rows(cu, i_r, BT: tl.constexpr):
    # request i_r's first packed row, node count, node tile offsets, its mask and the packed rows
    bos = tl.load(cu + i_r).to(tl.int64)
    n = tl.load(cu + i_r + 1).to(tl.int64) - bos
    o_t = tl.arange(0, BT)
    return bos, n, o_t, o_t < n, bos + o_t.to(tl.int64)


@triton.jit
def _load_stacked(q, k, bos, n, i_h, s_qt, s_qh, s_kt, s_kh, o_k, m_k, BT: tl.constexpr):
    # q rows over k rows of one request and key head, [2BT, BK], in one load
    o_2 = tl.arange(0, 2 * BT)
    rows2 = bos + (o_2 % BT).to(tl.int64)
    m_2 = (o_2 % BT) < n
    p_qk = tl.where((o_2 < BT)[:, None], q + rows2[:, None] * s_qt + i_h * s_qh, k + rows2[:, None] * s_kt + i_h * s_kh)
    return tl.load(p_qk + o_k[None, :], mask=m_2[:, None] & m_k[None, :], other=0.)


@triton.jit
def _row_scales(b_q, b_k, scale, USE_L2: tl.constexpr, BT: tl.constexpr):
    # per-row scales applied after the products: l2 norms and the softmax-free q scale
    if USE_L2:
        qf = b_q.to(tl.float32)
        kf = b_k.to(tl.float32)
        r_q = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6) * scale  # [BT]
        r_k = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)  # [BT]
    else:
        r_q = tl.full([BT], 1., tl.float32) * scale
        r_k = tl.full([BT], 1., tl.float32)
    return r_q, r_k


@triton.jit
def _path_masks(b_anc, b_g, BT: tl.constexpr):
    # [BT, BT] ancestor-or-self and proper-ancestor masks from the plan's bitmasks, the root-path
    # gate sums G and the decays exp(G_i - G_j), masked before exp: only bounded for ancestors j of i
    o_t = tl.arange(0, BT)
    m_self = ((b_anc[:, None] >> o_t[None, :].to(tl.int64)) & 1) != 0
    m_strict = m_self & (o_t[:, None] != o_t[None, :])
    b_G = tl.sum(tl.where(m_self, b_g[None, :], 0.), 1)  # [BT]
    b_decay = tl.where(m_self, tl.exp(tl.where(m_self, b_G[:, None] - b_G[None, :], 0.)), 0.)  # [BT, BT]
    return m_self, m_strict, b_G, b_decay


@triton.jit
def _fold_rounds(b_qkd, b_A, b_dep, d_max, BT: tl.constexpr, PREC_I: tl.constexpr, LOOP: tl.constexpr = False):
    # N = qkd (I + A)^-1 = qkd (I - A)(I + A^2)(I + A^4)..., T never formed. [qkd; A].A gives qkd.A
    # and A^2 in one product; each round [N; P].P gives N.P and P^2 in one: r + 1 products of
    # M = 2BT, the rounds stopping at the request's depth (A^(2^i) = 0 once 2^i > depth); the last
    # round needs no next power, so it is N.P alone (M = BT).
    # LOOP: the stacked rounds as a runtime loop, one copy of the round's code instead of up to five
    # unrolled ones (each [2BT, BT] x [BT, BT] FMA product is ~500 straight-line instructions per
    # thread; the unrolled first launch is ~10-18K instructions, fetched once per program)
    b_y = tl.dot(_stack(b_qkd, b_A), b_A, input_precision=PREC_I)  # [2BT, BT]
    b_na, b_P = _unstack(b_y, BT, BT)
    b_N = b_qkd - b_na  # qkd (I - A)
    b_M = tl.abs(b_P)  # elementwise max of the powers' magnitudes (one reduction at the end)
    if LOOP:
        p2 = d_max * 0 + 4  # 2 << i for round i = 1
        while p2 <= d_max:  # another round follows: N (I + P) and P^2 together
            b_y = tl.dot(_stack(b_N, b_P), b_P, input_precision=PREC_I)
            b_np, b_P = _unstack(b_y, BT, BT)
            b_N = b_N + b_np
            b_M = tl.maximum(b_M, tl.abs(b_P))
            p2 = p2 * 2
        if p2 // 2 <= d_max:  # the last round: N (I + P) alone
            b_N = b_N + tl.dot(b_N, b_P, input_precision=PREC_I)
    else:
        for i in tl.static_range(1, 6):
            if (2 << i) <= d_max:  # another round follows: it needs P^2
                b_y = tl.dot(_stack(b_N, b_P), b_P, input_precision=PREC_I)
                b_np, b_P = _unstack(b_y, BT, BT)
                b_N = b_N + b_np  # N (I + A^(2^i))
                b_M = tl.maximum(b_M, tl.abs(b_P))
            elif (1 << i) <= d_max:
                b_N = b_N + tl.dot(b_N, b_P, input_precision=PREC_I)
    if tl.max(tl.maximum(b_M, tl.abs(b_A))) > GROWTH_MAX:
        b_N = tl.dot(b_qkd, _levels_T(b_A, b_dep, d_max, BT, PREC_I), input_precision=PREC_I)
    return b_N


@triton.jit
def _n_ptrs(nbuf, i_r, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    # the split inverse's workspace nbuf [B, HV, BT, BT] fp32: this (request, value head)'s N, row-major
    o_t = tl.arange(0, BT)
    return nbuf + ((i_r * HV + i_hv) * BT + o_t[:, None]).to(tl.int64) * BT + o_t[None, :]


@triton.jit
def _load_n(nbuf, flags, i_r, i_hv, HV: tl.constexpr, BT: tl.constexpr, SYNC: tl.constexpr):
    # INV=4: N [BT, BT] of this (request, value head), written by the program that built it. SYNC=1:
    # gdn_tree_split_kernel, the grid before (PDL: wait until it has finished and its stores are
    # visible); SYNC=2: a producer program of the same grid (gdn_tree_flag_kernel), which raises
    # flags[i_r, i_hv] to the number of consumers once N is stored. Thread 0 polls it with acquire
    # loads (the scalar atomic is one thread's, broadcast through a barrier), N is read past L1 (.cg),
    # and each consumer takes one off the flag, so the last leaves it at 0 for the next call.
    if SYNC == 1:
        gdc_wait()
    p_f = flags + i_r * HV + i_hv
    if SYNC == 2:
        ready = tl.atomic_add(p_f, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(p_f, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    b_N = tl.load(_n_ptrs(nbuf, i_r, i_hv, HV, BT), cache_modifier=".cg")
    if SYNC == 2:
        tl.atomic_add(p_f, -1, sem="relaxed", scope="gpu")
    return b_N


@triton.jit
def _build_n(q, k, g, beta, nbuf, cu, anc, depth, max_depth, scale, i_r, i_hv,
             s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
             USE_L2: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, PREC_I: tl.constexpr,
             STACK: tl.constexpr, SKIP: tl.constexpr, ILOOP: tl.constexpr):
    # N = (q.k^T d)(I + A)^-1 of one (request, value head) into nbuf, by the fold rounds (ILOOP: as a loop)
    i_h = i_hv // (HV // H)
    bos, n, o_t, m_t, rows = _request_rows(cu, i_r, BT)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q, _ = _finite(tl.load(q + rows[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_tk, other=0.))  # [BT, BK]
    b_k, _ = _finite(tl.load(k + rows[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.))  # [BT, BK]
    b_g, _ = _finite(tl.load(g + rows * s_gt + i_hv * s_gh, mask=m_t, other=0.).to(tl.float32))  # [BT]
    b_b, _ = _finite(tl.load(beta + rows * s_bt + i_hv * s_bh, mask=m_t, other=0.).to(tl.float32))  # [BT]
    b_anc = tl.load(anc + rows, mask=m_t, other=0)  # [BT] int64
    d_max = tl.load(max_depth + i_r)
    b_dep = tl.load(depth + rows, mask=m_t, other=-1)  # [BT]
    r_q, r_k = _row_scales(b_q, b_k, scale, USE_L2, BT)
    if SPLIT and STACK:  # q.k^T over k.k^T in one product, M = 2BT
        b_qk2, _ = _finite(_load_stacked(q, k, bos, n, i_h, s_qt, s_qh, s_kt, s_kh, o_k, o_k < K, BT))
        b_x = tl.dot(b_qk2, tl.trans(b_k))
        b_qk, b_kk = _unstack(b_x, BT, BT)
    elif SPLIT:  # raw bf16 operands: exact products on tensor cores, norms applied after
        b_kk = tl.dot(b_k, tl.trans(b_k))  # [BT, BT]
        b_qk = tl.dot(b_q, tl.trans(b_k))  # [BT, BT]
    else:
        kf = b_k.to(tl.float32)
        b_kk = tl.dot(kf, tl.trans(kf), input_precision=PREC)
        b_qk = tl.dot(b_q.to(tl.float32), tl.trans(kf), input_precision=PREC)
    m_self, m_strict, b_G, b_decay = _path_masks(b_anc, b_g, BT)
    b_A, _ = _finite(tl.where(m_strict, b_kk * (b_b * r_k)[:, None] * r_k[None, :] * b_decay, 0.))  # [BT, BT]
    b_qkd = tl.where(m_self, b_qk * r_q[:, None] * r_k[None, :] * b_decay, 0.)  # [BT, BT]
    if SKIP & 2:  # diagnostic (see SKIP below): no rounds
        b_N = b_qkd - b_A
    else:
        b_N = _fold_rounds(b_qkd, b_A, b_dep, d_max, BT, PREC_I, ILOOP)
    tl.store(_n_ptrs(nbuf, i_r, i_hv, HV, BT), b_N)


@triton.jit(do_not_specialize=["scale"])
def gdn_tree_split_kernel(
    q, k, g, beta, nbuf, cu, anc, depth, max_depth,
    scale,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_L2: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, PREC_I: tl.constexpr, PDL: tl.constexpr = False,
    STACK: tl.constexpr = False, SKIP: tl.constexpr = 0, ILOOP: tl.constexpr = False,
):
    """inverse="split", the first of two launches: N = (q.k^T d)(I + A)^-1 of one (request, value
    head), [BT, BT] fp32 into nbuf[B, HV, BT, BT], by the fold rounds. gdn_tree_wy_kernel (INV=4)
    runs next: its state products need no N, so it does them while this grid runs and waits on it
    only to read N for O = eG q S0 + N rhs. The inverse leaves the critical path of the state phase."""
    if PDL:
        gdc_wait()
        # only after the wait: the next grid reads this one's inputs (q, k, v, ..., the pool) before
        # its own wait, which is safe because the grid before this one has finished
        gdc_launch_dependents()
    _build_n(q, k, g, beta, nbuf, cu, anc, depth, max_depth, scale, tl.program_id(0), tl.program_id(1),
             s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh, H, HV, K, BT, BK, USE_L2, PREC, SPLIT, PREC_I, STACK, SKIP,
             ILOOP)


@triton.jit
def _wy_program(
    q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, flags, err, pool_rows, scale, i_r, i_hv,
    i_v, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh, s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, PREC: tl.constexpr, PREC_S: tl.constexpr, SPLIT: tl.constexpr, INV: tl.constexpr,
    TRANS: tl.constexpr, STACK: tl.constexpr, PREC_I: tl.constexpr, SYNC: tl.constexpr, SKIP: tl.constexpr,
):
    # one (request i_r, value head i_hv, V block i_v): the state products, the inverse (INV < 4) or N
    # from its producer (INV=4, read as SYNC says: see _load_n), and O
    i_h = i_hv // (HV // H)
    bos, n, o_t, m_t, rows = _request_rows(cu, i_r, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    m_tk = m_t[:, None] & m_k[None, :]
    b_q, nf_q = _finite(tl.load(q + rows[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_tk, other=0.))  # [BT, BK]
    b_k, nf_k = _finite(tl.load(k + rows[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.))  # [BT, BK]
    idx = tl.load(state_idx + i_r).to(tl.int64)
    ok_idx = (idx >= 0) & (idx < pool_rows)
    ok = ok_idx & (n <= BT)  # more nodes than the tile (a plan built with too small a max_nodes): skipped
    tl.atomic_or(err, tl.where(ok_idx, 0, 1) | tl.where(n <= BT, 0, 128), mask=(~ok) & (i_v == 0))
    p_S = pool + tl.where(ok_idx, idx, 0) * s_pn + i_hv * s_ph
    if TRANS:
        b_S = tl.load(p_S + o_v[:, None] * s_pv + o_k[None, :] * s_pk,
                      mask=m_v[:, None] & m_k[None, :] & ok, other=0.)  # [BV, BK] fp32 (S0^T)
    else:
        b_S = tl.load(p_S + o_k[:, None] * s_pk + o_v[None, :] * s_pv,
                      mask=m_k[:, None] & m_v[None, :] & ok, other=0.)  # [BK, BV] fp32
    b_g, nf_g = _finite(tl.load(g + rows * s_gt + i_hv * s_gh, mask=m_t, other=0.).to(tl.float32))  # [BT]
    b_b, nf_b = _finite(tl.load(beta + rows * s_bt + i_hv * s_bh, mask=m_t, other=0.).to(tl.float32))  # [BT]
    tl.atomic_or(err, 64, mask=(tl.max(b_g) > 0) & (i_v == 0))
    b_anc = tl.load(anc + rows, mask=m_t, other=0)  # [BT] int64
    d_max = tl.load(max_depth + i_r)
    b_dep = tl.load(depth + rows, mask=m_t, other=-1)  # [BT]
    if TRANS:
        b_v, nf_v = _finite(tl.load(v + rows[None, :] * s_vt + i_hv * s_vh + o_v[:, None],
                                    mask=m_v[:, None] & m_t[None, :], other=0.).to(tl.float32))  # [BV, BT]
        bad_v = _row_any(nf_v, 0)
    else:
        b_v, nf_v = _finite(tl.load(v + rows[:, None] * s_vt + i_hv * s_vh + o_v[None, :],
                                    mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32))  # [BT, BV]
        bad_v = _row_any(nf_v, 1)
    # rows whose own inputs held a non-finite entry: through the state (k, v, g, beta) or the query alone
    bad_s = _row_any(nf_k, 1) | bad_v | nf_g | nf_b  # [BT]
    bad_q = _row_any(nf_q, 1)  # [BT]

    r_q, r_k = _row_scales(b_q, b_k, scale, USE_L2, BT)
    # (The state products after the inverse were tried, to keep the state's load in flight
    # during it: slower on H200, B1-N32 593 vs 580 us and B24-N8 3115 vs 2966, the state tile
    # staying live in registers across the inverse.)
    if SPLIT and STACK and not TRANS:
        # q rows over k rows, [2BT, BK]: one set of products with M = 2BT (64 at 32 nodes)
        b_qk2, _ = _finite(_load_stacked(q, k, bos, n, i_h, s_qt, s_qh, s_kt, s_kh, o_k, m_k, BT))  # [2BT, BK]
        s_hi, s_mid, s_lo = _split3(b_S)
        b_x = tl.dot(b_qk2, tl.trans(b_k))  # [2BT, BT]: q.k^T over k.k^T
        b_qk, b_kk = _unstack(b_x, BT, BT)
        b_y = tl.dot(b_qk2, s_hi) + tl.dot(b_qk2, s_mid) + tl.dot(b_qk2, s_lo)  # [2BT, BV]
        b_qS, b_kS = _unstack(b_y, BT, BV)
    elif SPLIT:
        # raw bf16 operands: exact products on tensor cores
        b_kk = tl.dot(b_k, tl.trans(b_k))  # [BT, BT]
        b_qk = tl.dot(b_q, tl.trans(b_k))  # [BT, BT]
        s_hi, s_mid, s_lo = _split3(b_S)
        if TRANS:
            b_kT = tl.trans(b_k)  # [BK, BT]
            b_qT = tl.trans(b_q)  # [BK, BT]
            b_kS = tl.dot(s_hi, b_kT) + tl.dot(s_mid, b_kT) + tl.dot(s_lo, b_kT)  # [BV, BT]
            b_qS = tl.dot(s_hi, b_qT) + tl.dot(s_mid, b_qT) + tl.dot(s_lo, b_qT)  # [BV, BT]
        elif BT >= 64 and BV < BT:
            # as (S0^T K^T)^T, M = BV: Triton 3.6's sm_90 lowering gives wrong results (or an illegal address)
            # when one program holds wgmma products of two widths, here N = BT for q.k^T / k.k^T and N = BV for
            # the state products (docs/gdn.md); with M = BV < 64 these are mma.sync, and the wgmma are one width
            b_kT = tl.trans(b_k)  # [BK, BT]
            b_qT = tl.trans(b_q)  # [BK, BT]
            t_hi, t_mid, t_lo = tl.trans(s_hi), tl.trans(s_mid), tl.trans(s_lo)  # [BV, BK]
            b_kS = tl.trans(tl.dot(t_hi, b_kT) + tl.dot(t_mid, b_kT) + tl.dot(t_lo, b_kT))  # [BT, BV]
            b_qS = tl.trans(tl.dot(t_hi, b_qT) + tl.dot(t_mid, b_qT) + tl.dot(t_lo, b_qT))  # [BT, BV]
        else:
            b_kS = tl.dot(b_k, s_hi) + tl.dot(b_k, s_mid) + tl.dot(b_k, s_lo)  # [BT, BV]
            b_qS = tl.dot(b_q, s_hi) + tl.dot(b_q, s_mid) + tl.dot(b_q, s_lo)  # [BT, BV]
    else:
        qf = b_q.to(tl.float32)
        kf = b_k.to(tl.float32)
        b_kk = tl.dot(kf, tl.trans(kf), input_precision=PREC)
        b_qk = tl.dot(qf, tl.trans(kf), input_precision=PREC)
        if TRANS:
            b_kS = tl.dot(b_S, tl.trans(kf), input_precision=PREC)  # [BV, BT]
            b_qS = tl.dot(b_S, tl.trans(qf), input_precision=PREC)  # [BV, BT]
        else:
            b_kS = tl.dot(kf, b_S, input_precision=PREC)  # [BT, BV]
            b_qS = tl.dot(qf, b_S, input_precision=PREC)  # [BT, BV]

    if SKIP & 1:
        b_kS = tl.zeros_like(b_v)
        b_qS = tl.zeros_like(b_v)

    m_self, m_strict, b_G, b_decay = _path_masks(b_anc, b_g, BT)
    b_A, nf_A = _finite(tl.where(m_strict, b_kk * (b_b * r_k)[:, None] * r_k[None, :] * b_decay, 0.))  # [BT, BT]
    bad_s = bad_s | _row_any(nf_A, 1)

    # q.k^T d: before the inverse for "fold" (which starts from it), after it otherwise. One place for
    # all changes the measured kernels' code (sm_90 SASS differs; B24 config spills 808 vs 760 bytes)
    if INV == 3:
        b_qkd = tl.where(m_self, b_qk * r_q[:, None] * r_k[None, :] * b_decay, 0.)  # [BT, BT]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    if SKIP & 2:
        b_T = eye - b_A
        if INV == 3:
            b_N = b_qkd
    elif INV == 3:
        b_N = _fold_rounds(b_qkd, b_A, b_dep, d_max, BT, PREC_I)  # fold: N = qkd.T with T never formed
    elif INV == 4:
        b_T = eye  # unused: N comes from nbuf (the products above that only fed A are dead code)
    elif INV == 1:
        b_T = eye - b_A
        b_P = b_A
        b_M = tl.abs(b_A)
        for i in tl.static_range(1, 6):  # A^(2^i) = 0 once 2^i > depth
            if (1 << i) <= d_max:
                b_P = tl.dot(b_P, b_P, input_precision=PREC_I)
                b_T = b_T + tl.dot(b_T, b_P, input_precision=PREC_I)
                b_M = tl.maximum(b_M, tl.abs(b_P))
        if tl.max(b_M) > GROWTH_MAX:
            b_T = _levels_T(b_A, b_dep, d_max, BT, PREC_I)
    elif INV == 2:
        # the same rounds as a runtime loop: one copy of the two products in the code
        b_T = eye - b_A
        b_P = b_A
        b_M = tl.abs(b_A)
        p2 = d_max * 0 + 2
        while p2 <= d_max:
            b_P = tl.dot(b_P, b_P, input_precision=PREC_I)
            b_T = b_T + tl.dot(b_T, b_P, input_precision=PREC_I)
            b_M = tl.maximum(b_M, tl.abs(b_P))
            p2 = p2 * 2
        if tl.max(b_M) > GROWTH_MAX:
            b_T = _levels_T(b_A, b_dep, d_max, BT, PREC_I)
    else:
        b_T = _levels_T(b_A, b_dep, d_max, BT, PREC_I)

    b_eG = tl.exp(b_G)
    if INV < 3:
        b_qkd = tl.where(m_self, b_qk * r_q[:, None] * r_k[None, :] * b_decay, 0.)  # [BT, BT]
    if TRANS:
        b_rhs, nf_r = _finite(b_b[None, :] * (b_v - (b_eG * r_k)[None, :] * b_kS))  # [BV, BT]
        bad_s = bad_s | _row_any(nf_r, 0)
        # [BT]: a node whose own q, or whose own or an ancestor's state inputs, held a non-finite entry
        poison = bad_q | _row_any(m_self & bad_s[None, :], 1)
        if SKIP & 4:
            b_o = (b_eG * r_q)[None, :] * b_qS + b_rhs
        elif INV >= 3:
            if INV == 4:
                b_N = _load_n(nbuf, flags, i_r, i_hv, HV, BT, SYNC)
            b_o = (b_eG * r_q)[None, :] * b_qS + tl.dot(b_rhs, tl.trans(b_N), input_precision=PREC_S)  # [BV, BT]
        else:
            b_u, _ = _finite(tl.dot(b_rhs, tl.trans(b_T), input_precision=PREC_S))  # [BV, BT]
            b_o = (b_eG * r_q)[None, :] * b_qS + tl.dot(b_u, tl.trans(b_qkd), input_precision=PREC_S)  # [BV, BT]
        b_o = tl.where(poison[None, :], float("nan"), b_o)
        tl.store(o + rows[None, :] * s_ot + i_hv * s_oh + o_v[:, None], b_o.to(o.dtype.element_ty),
                 mask=m_v[:, None] & m_t[None, :] & ok)
    else:
        b_rhs, nf_r = _finite(b_b[:, None] * (b_v - (b_eG * r_k)[:, None] * b_kS))  # [BT, BV]
        bad_s = bad_s | _row_any(nf_r, 1)
        poison = bad_q | _row_any(m_self & bad_s[None, :], 1)  # [BT]
        if SKIP & 4:
            b_o = (b_eG * r_q)[:, None] * b_qS + b_rhs
        elif INV >= 3:
            if INV == 4:
                b_N = _load_n(nbuf, flags, i_r, i_hv, HV, BT, SYNC)
            b_o = (b_eG * r_q)[:, None] * b_qS + tl.dot(b_N, b_rhs, input_precision=PREC_S)  # [BT, BV]
        else:
            b_u, _ = _finite(tl.dot(b_T, b_rhs, input_precision=PREC_S))  # [BT, BV]
            b_o = (b_eG * r_q)[:, None] * b_qS + tl.dot(b_qkd, b_u, input_precision=PREC_S)
        b_o = tl.where(poison[:, None], float("nan"), b_o)
        tl.store(o + rows[:, None] * s_ot + i_hv * s_oh + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :] & ok)


@triton.jit(do_not_specialize=["scale", "pool_rows"])
def gdn_tree_wy_kernel(
    q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, err,
    scale, pool_rows,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, PREC: tl.constexpr, PREC_S: tl.constexpr, SPLIT: tl.constexpr, INV: tl.constexpr,
    TRANS: tl.constexpr = False, STACK: tl.constexpr = False, PREC_I: tl.constexpr = "ieee", PDL: tl.constexpr = False,
    SKIP: tl.constexpr = 0,
):
    if PDL:
        if INV != 4:
            gdc_wait()
        # INV=4: no wait here. gdn_tree_split_kernel, launched just before, waited on the previous
        # grid before it let this one start, so every input but nbuf is final; nbuf is read after
        # the wait below
        gdc_launch_dependents()
    _wy_program(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, nbuf, err, pool_rows, scale,
                tl.program_id(0), tl.program_id(1), tl.program_id(2),
                s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh, s_pn, s_ph, s_pk, s_pv,
                H, HV, K, V, BT, BK, BV, USE_L2, PREC, PREC_S, SPLIT, INV, TRANS, STACK, PREC_I, PDL, SKIP)


@triton.jit(do_not_specialize=["scale", "n_prod", "pool_rows"])
def gdn_tree_flag_kernel(
    q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, flags, err,
    scale, n_prod, pool_rows,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, PREC: tl.constexpr, PREC_S: tl.constexpr, SPLIT: tl.constexpr,
    STACK: tl.constexpr = False, ISTACK: tl.constexpr = False, PREC_I: tl.constexpr = "ieee",
    PDL: tl.constexpr = False, SKIP: tl.constexpr = 0, ILOOP: tl.constexpr = False,
):
    """inverse="split" in one launch (WYConfig.handoff="flag"): the first n_prod = B * HV programs
    build N as gdn_tree_split_kernel does and raise flags[i_r, i_hv]; the rest are gdn_tree_wy_kernel's
    (request, value head, V block) programs, which do their state products and then wait on that flag
    alone instead of on a whole grid. No grid boundary between the two halves.

    Forward progress: consumers spin, producers never wait. The producers have the lowest program
    ids, so they are placed first, and the launcher (gdn/ops.py) uses this kernel only when the whole
    grid fits on the GPU at once (all programs resident), otherwise the two-launch form. That check
    assumes the GPU to itself: with other kernels beside it (other streams, MPS) progress rests on the
    producers being dispatched first, which hardware does in id order but CUDA does not promise. One
    reason the config is opt-in (the other: on H200 it measured slower, docs/gdn.md)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    if pid < n_prod:
        _build_n(q, k, g, beta, nbuf, cu, anc, depth, max_depth, scale, pid // HV, pid % HV,
                 s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh, H, HV, K, BT, BK, USE_L2, PREC, SPLIT, PREC_I,
                 ISTACK, SKIP, ILOOP)
        if not (SKIP & 4):  # (SKIP & 4: the consumers read no N, so nothing would take the flag back)
            tl.debug_barrier()  # every thread's part of N is stored before thread 0 publishes it
            tl.atomic_xchg(flags + pid, NV, sem="release", scope="gpu")
    else:
        c = pid - n_prod
        i_r = c // (HV * NV)
        i_hv = (c // NV) % HV
        i_v = c % NV
        _wy_program(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, flags, err, pool_rows, scale,
                    i_r, i_hv, i_v, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh, s_pn, s_ph, s_pk, s_pv,
                    H, HV, K, V, BT, BK, BV, USE_L2, PREC, PREC_S, SPLIT, 4, False, STACK, PREC_I, 2, SKIP)
