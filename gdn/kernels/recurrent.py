"""Baseline: per-node sequential recompute along the root path, rank-1 updates, no tensor cores.

One program per (node, value head, V block) walks its ancestors (ascending local index = root
first, since parents precede children) from the committed state. Each node reads only its own
root path, so a NaN/Inf in one node's inputs reaches its descendants and no other node.

Guards (gdn/guard.py): a state index outside [0, pool_rows) skips the node (its output row is not
written) and ORs VERIFY_STATE_INDEX (1) into err; a local index >= 64 (a plan built unvalidated) ORs
PLAN_NODES (128) and is skipped too; a gate g > 0 ORs POSITIVE_GATE (64).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["scale", "pool_rows"])
def gdn_tree_recurrent_kernel(
    q, k, v, g, beta, o, pool, state_idx, cu, anc, node_req, err,
    scale, pool_rows,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
):
    i_t, i_hv, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_r = tl.load(node_req + i_t)
    bos = tl.load(cu + i_r).to(tl.int64)
    loc = i_t - bos
    my_anc = tl.load(anc + i_t)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    idx = tl.load(state_idx + i_r).to(tl.int64)
    ok_idx = (idx >= 0) & (idx < pool_rows)
    ok = ok_idx & (loc < 64)  # one int64 ancestor bitmask per node: a deeper local index is a bad plan
    tl.atomic_or(err, tl.where(ok_idx, 0, 1) | tl.where(loc < 64, 0, 128), mask=(~ok) & (i_v == 0))
    b_S = tl.load(pool + tl.where(ok_idx, idx, 0) * s_pn + i_hv * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv,
                  mask=m_k[:, None] & m_v[None, :] & ok, other=0.)  # [BK, BV]
    for j in range(0, tl.where(ok, loc + 1, 0)):
        if ((my_anc >> j) & 1) != 0:
            tok = bos + j
            b_k = tl.load(k + tok * s_kt + i_h * s_kh + o_k, mask=m_k, other=0.).to(tl.float32)  # [BK]
            if USE_L2:
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
            b_v = tl.load(v + tok * s_vt + i_hv * s_vh + o_v, mask=m_v, other=0.).to(tl.float32)  # [BV]
            b_g = tl.load(g + tok * s_gt + i_hv * s_gh).to(tl.float32)
            tl.atomic_or(err, 64, mask=(b_g > 0) & (i_v == 0) & (j == loc))
            b_b = tl.load(beta + tok * s_bt + i_hv * s_bh).to(tl.float32)
            b_S = b_S * tl.exp(b_g)
            b_u = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))
            b_S = b_S + b_k[:, None] * b_u[None, :]
    b_q = tl.load(q + i_t * s_qt + i_h * s_qh + o_k, mask=m_k, other=0.).to(tl.float32)
    if USE_L2:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
    b_o = tl.sum(b_S * (b_q * scale)[:, None], 0)  # [BV]
    tl.store(o + i_t * s_ot + i_hv * s_oh + o_v, b_o.to(o.dtype.element_ty), mask=m_v & ok)
