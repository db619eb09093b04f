"""Commit: advance each request's recurrent and conv state along its accepted root path, for all
layers in one launch each. Recomputes from the committed state (no per-node snapshots).

Guards (gdn/guard.py): every program checks its request's pool row and accepted path (accepted_len in
[0, max_len], each node inside the request, each node the child of the one before, the first a root);
a request that fails is skipped (its states are not written) and the failure's bits are OR-ed into err."""

import triton
import triton.language as tl


@triton.jit
def _accepted_bits(accepted, par, i_r, s_ab, bos, n, n_acc, max_len):
    # error bits of request i_r's accepted list (0: a root path of its tree); 32 length, 8 node, 16 path
    bad_len = (n_acc < 0) | (n_acc > max_len)
    bits = tl.where(bad_len, 32, 0)
    prev = (n_acc * 0 - 1).to(tl.int64)
    for m in range(0, tl.where(bad_len, 0, n_acc)):
        node = tl.load(accepted + i_r * s_ab + m).to(tl.int64)
        inside = (node >= 0) & (node < n)
        p = tl.load(par + bos + tl.where(inside, node, 0), mask=inside, other=-3).to(tl.int64)
        bits = bits | tl.where(inside, 0, 8) | tl.where(inside & (p != prev), 16, 0)
        prev = tl.where(inside, node, -2)
    return bits


@triton.jit
def _guard_request(cu, acc_len, rows, accepted, par, err, i_r, s_ab, pool_rows, max_len):
    """Request i_r's first node, the accepted length to run (0 when it is skipped), its pool row, whether that
    row is in [0, pool_rows), and whether the request runs; a failure ORs its bits into err."""
    bos = tl.load(cu + i_r).to(tl.int64)
    n = tl.load(cu + i_r + 1).to(tl.int64) - bos
    n_acc = tl.load(acc_len + i_r)
    idx = tl.load(rows + i_r).to(tl.int64)
    ok_idx = (idx >= 0) & (idx < pool_rows)
    bits = _accepted_bits(accepted, par, i_r, s_ab, bos, n, n_acc, max_len) | tl.where(ok_idx, 0, 4)
    tl.atomic_or(err, bits, mask=bits != 0)
    ok = bits == 0
    return bos, tl.where(ok, n_acc, 0), idx, ok_idx, ok


@triton.jit
def gdn_commit_state_kernel(
    k, v, g, beta, pool, state_idx, cu, accepted, acc_len, par, err, pool_rows, max_len,
    s_kl, s_kt, s_kh, s_vl, s_vt, s_vh, s_gl, s_gt, s_gh, s_bl, s_bt, s_bh,
    s_pl, s_pn, s_ph, s_pk, s_pv, s_ab,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
):
    i_r, i_lh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = (i_lh // HV).to(tl.int64)
    i_hv = i_lh % HV
    i_h = i_hv // (HV // H)
    bos, n_run, idx, ok_idx, ok = _guard_request(cu, acc_len, state_idx, accepted, par, err, i_r, s_ab, pool_rows,
                                                 max_len)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_S = pool + i_l * s_pl + tl.where(ok_idx, idx, 0) * s_pn + i_hv * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    m_S = m_k[:, None] & m_v[None, :] & ok
    b_S = tl.load(p_S, mask=m_S, other=0.)  # [BK, BV]
    for m in range(0, n_run):
        tok = bos + tl.load(accepted + i_r * s_ab + m).to(tl.int64)
        b_k = tl.load(k + i_l * s_kl + tok * s_kt + i_h * s_kh + o_k, mask=m_k, other=0.).to(tl.float32)
        if USE_L2:
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_v = tl.load(v + i_l * s_vl + tok * s_vt + i_hv * s_vh + o_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(g + i_l * s_gl + tok * s_gt + i_hv * s_gh).to(tl.float32)
        b_b = tl.load(beta + i_l * s_bl + tok * s_bt + i_hv * s_bh).to(tl.float32)
        b_S = b_S * tl.exp(b_g)
        b_u = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))
        b_S = b_S + b_k[:, None] * b_u[None, :]
    tl.store(p_S, b_S, mask=m_S)


@triton.jit
def gdn_commit_conv_kernel(
    x, cstate, cidx, cu, accepted, acc_len, par, err, pool_rows, max_len,
    s_xl, s_xt, s_cl, s_cn, s_cd, s_cw, s_ab,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
):
    i_r, i_l, i_d = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_c = tl.arange(0, BW)
    m_c = o_c < W - 1
    bos, n_run, sidx, ok_idx, ok = _guard_request(cu, acc_len, cidx, accepted, par, err, i_r, s_ab, pool_rows, max_len)
    # new column c = (old columns ++ accepted tokens)[n_acc + c]
    src = n_run + o_c  # [BW]
    from_old = src < W - 1
    base = cstate + i_l * s_cl + tl.where(ok_idx, sidx, 0) * s_cn + o_d[:, None] * s_cd
    b_old = tl.load(base + src[None, :] * s_cw, mask=m_d[:, None] & (m_c & from_old)[None, :] & ok, other=0.)
    loc = tl.load(accepted + i_r * s_ab + (src - (W - 1)), mask=m_c & (~from_old) & ok, other=0).to(tl.int64)
    b_new = tl.load(x + i_l * s_xl + (bos + loc)[None, :] * s_xt + o_d[:, None],
                    mask=m_d[:, None] & (m_c & (~from_old))[None, :] & ok, other=0.)
    b_c = tl.where(from_old[None, :], b_old, b_new.to(b_old.dtype))  # [BD, BW], all loads before the store
    tl.store(base + o_c[None, :] * s_cw, b_c, mask=m_d[:, None] & m_c[None, :] & ok)
