"""Tree-aware causal depthwise conv: each node convolves itself and its nearest ancestors, then
the committed conv-state columns once the walk passes the root.

Guard (gdn/guard.py): a conv state index outside [0, pool_rows) skips the node (its output row is not
written) and ORs CONV_STATE_INDEX (2) into err.

PDL=True (sm_90, launched with launch_pdl): griddepcontrol.wait before the first load, then the next grid may
launch; what it reads before its own wait this kernel does not write."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gdn_tree_conv_kernel(
    x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, pool_rows,
    s_xt, s_ot, s_wd, s_ww, s_cn, s_cd, s_cw,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # launched with launch_pdl: the grid before may still run until this wait
        gdc_wait()
        gdc_launch_dependents()
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    i_r = tl.load(node_req + i_t)
    sidx = tl.load(cidx + i_r).to(tl.int64)
    ok = (sidx >= 0) & (sidx < pool_rows)
    tl.atomic_or(err, 2, mask=(~ok) & (i_d == 0))
    sidx = tl.where(ok, sidx, 0)
    dep = tl.load(depth + i_t)
    acc = tl.zeros([BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    cur = i_t
    for m in tl.static_range(W):
        in_tree = m <= dep
        b_w = tl.load(weight + o_d * s_wd + (W - 1 - m) * s_ww, mask=m_d, other=0.).to(tl.float32)  # [BD]
        b_x = tl.load(x + cur * s_xt + o_d, mask=m_d & in_tree, other=0.).to(tl.float32)
        # past the root: committed column W-1-(m-dep), last column = most recent token
        b_c = tl.load(cstate + sidx * s_cn + o_d * s_cd + (W - 1 - m + dep) * s_cw, mask=m_d & (~in_tree) & ok,
                      other=0.).to(tl.float32)
        acc += b_w * (b_x + b_c)
        if m + 1 < W:
            cur = tl.maximum(tl.load(parent + cur, mask=in_tree, other=0).to(tl.int64), 0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + i_t * s_ot + o_d, acc.to(out.dtype.element_ty), mask=m_d & ok)
