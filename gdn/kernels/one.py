"""Verify at one node per request (the engine's autoregressive step): two products with the committed state and a
rank-one correction, no gram, no solve.

For value head h of request r, with S the committed state [K, V] (fp32), e = exp(g), q and k of the key head
h // (HV // H) (l2-normalised when USE_L2; q times `scale`):

    u = beta (v - e S^T k),   o = e S^T q + u (k . q)

which is gdn/reference.py's one step, S' = e S + k u^T and o = S'^T q, without forming S'. One program per (V
block of BV columns, value head, request) reads its [K, BV] block of the state once.

PDL=True (sm_90, launched with launch_pdl): griddepcontrol.wait before the step's inputs (q, k, v, g, beta) are read;
the next grid may launch once the wait has passed. EARLY=True: cu, state_indices and the state block are read
before the wait (with PDL, while the kernel before this one still runs), so that kernel must not write the state
pool, cu or state_indices after letting its dependents launch: in this library only `gdn.commit` writes the pool,
and it lets nothing launch early.

Guards (gdn/guard.py): a state index outside [0, pool_rows) skips the request (its outputs are not written) and ORs
VERIFY_STATE_INDEX (1) into err; a request whose tree has more than one node ORs PLAN_NODES (128) and is skipped
(the launcher takes this kernel only for plans of one node a request); a gate g > 0 ORs POSITIVE_GATE (64). A
non-finite input makes its request's outputs NaN (or Inf), as the sequential step would.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["scale", "pool_rows"])
def gdn_one_kernel(
    q, k, v, g, beta, o, pool, state_idx, cu, err,
    scale, pool_rows,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_pn, s_ph, s_pk, s_pv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    i_v, i_hv, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_h = i_hv // (HV // H)
    if PDL and not EARLY:
        gdc_wait()
        gdc_launch_dependents()
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    tok = tl.load(cu + i_r).to(tl.int64)
    n = tl.load(cu + i_r + 1).to(tl.int64) - tok
    idx = tl.load(state_idx + i_r).to(tl.int64)
    ok_idx = (idx >= 0) & (idx < pool_rows)
    ok = ok_idx & (n == 1)
    s_ptr = pool + tl.where(ok, idx, 0) * s_pn + i_hv * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    s_mask = m_k[:, None] & m_v[None, :] & ok
    if EARLY:
        b_S = tl.load(s_ptr, mask=s_mask, other=0.)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
    else:
        b_S = tl.load(s_ptr, mask=s_mask, other=0.)
    tl.atomic_or(err, tl.where(ok_idx, 0, 1) | tl.where(n == 1, 0, 128), mask=(~ok) & (n > 0) & (i_v == 0))
    b_k = tl.load(k + tok * s_kt + i_h * s_kh + o_k, mask=m_k & ok, other=0.).to(tl.float32)
    b_q = tl.load(q + tok * s_qt + i_h * s_qh + o_k, mask=m_k & ok, other=0.).to(tl.float32)
    if USE_L2:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
    b_q = b_q * scale
    b_v = tl.load(v + tok * s_vt + i_hv * s_vh + o_v, mask=m_v & ok, other=0.).to(tl.float32)
    b_g = tl.load(g + tok * s_gt + i_hv * s_gh, mask=ok, other=0.).to(tl.float32)
    b_b = tl.load(beta + tok * s_bt + i_hv * s_bh, mask=ok, other=0.).to(tl.float32)
    tl.atomic_or(err, 64, mask=(b_g > 0) & (i_v == 0) & ok)
    e = tl.exp(b_g)
    b_S = b_S * e
    b_u = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))  # [BV]
    b_o = tl.sum(b_S * b_q[:, None], 0) + b_u * tl.sum(b_k * b_q)
    tl.store(o + tok * s_ot + i_hv * s_oh + o_v, b_o.to(o.dtype.element_ty), mask=m_v & ok)
