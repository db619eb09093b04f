"""Tree verification in WY form: one program per (request, value head, V block).

The chain's strictly-lower causal mask becomes the proper-ancestor mask and the cumulative gate
the root-path sum G. With nodes topologically ordered, (I + A) stays unit lower triangular; it is
inverted level by level (all nodes of one depth at once, one tensor-core product per level), which
is forward substitution batched over siblings. On sm_90 every tl.dot lowers to wgmma, on sm_80 to
mma.sync (fp32 operands at DOT_PRECISION, "tf32x3" by default: about fp32 accuracy).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["scale"])
def gdn_tree_wy_kernel(
    q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth,
    scale,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, PREC: tl.constexpr,
):
    i_r, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_r).to(tl.int64)
    n = tl.load(cu + i_r + 1).to(tl.int64) - bos
    o_t = tl.arange(0, BT)
    m_t = o_t < n
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    rows = bos + o_t.to(tl.int64)

    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + rows[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + rows[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    if USE_L2:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_q = b_q * scale
    b_g = tl.load(g + rows * s_gt + i_hv * s_gh, mask=m_t, other=0.).to(tl.float32)  # [BT]
    b_b = tl.load(beta + rows * s_bt + i_hv * s_bh, mask=m_t, other=0.).to(tl.float32)  # [BT]
    b_anc = tl.load(anc + rows, mask=m_t, other=0)  # [BT] int64
    b_dep = tl.load(depth + rows, mask=m_t, other=-1)  # [BT]

    # [BT, BT] ancestor-or-self and proper-ancestor masks
    m_self = ((b_anc[:, None] >> o_t[None, :].to(tl.int64)) & 1) != 0
    m_strict = m_self & (o_t[:, None] != o_t[None, :])
    b_G = tl.sum(tl.where(m_self, b_g[None, :], 0.), 1)  # [BT] root-path gate sums
    # masked before exp: G_i - G_j is only bounded when j is an ancestor of i
    b_decay = tl.where(m_self, tl.exp(tl.where(m_self, b_G[:, None] - b_G[None, :], 0.)), 0.)  # [BT, BT]

    b_A = tl.dot(b_k, tl.trans(b_k), input_precision=PREC) * b_decay * b_b[:, None]
    b_A = tl.where(m_strict, b_A, 0.)  # [BT, BT]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    b_T = eye  # rows of depth d are final once all shallower rows are
    d_max = tl.load(max_depth + i_r)
    for d in range(1, d_max + 1):
        b_T = tl.where((b_dep == d)[:, None], eye - tl.dot(b_A, b_T, input_precision=PREC), b_T)

    idx = tl.load(state_idx + i_r).to(tl.int64)
    b_S = tl.load(pool + idx * s_pn + i_hv * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv,
                  mask=m_k[:, None] & m_v[None, :], other=0.)  # [BK, BV]
    b_v = tl.load(v + rows[:, None] * s_vt + i_hv * s_vh + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.).to(tl.float32)  # [BT, BV]
    b_eG = tl.exp(b_G)
    b_rhs = b_b[:, None] * (b_v - b_eG[:, None] * tl.dot(b_k, b_S, input_precision=PREC))
    b_u = tl.dot(b_T, b_rhs, input_precision=PREC)  # [BT, BV]
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * b_decay  # [BT, BT]
    b_o = b_eG[:, None] * tl.dot(b_q, b_S, input_precision=PREC) + tl.dot(b_qk, b_u, input_precision=PREC)
    tl.store(o + rows[:, None] * s_ot + i_hv * s_oh + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])
