"""Split-KV tree attention in two launches (both Triton variants: tl.dot is wgmma on sm_90 at 64-row
tiles, mma.sync elsewhere and at 32-row tiles).

`tree_attn_split_kernel`: one program per (work item, KV head). A work item is a block of BM rows of
one request, rows being (tree node, query head of the GQA group) pairs packed node-major, so the
group's heads and the tree's nodes share the MMA M dimension and each K/V row is read once per KV
head and row block. The item covers either a range [lo, hi) of the request's prefix slots in
`kv_indices` (online softmax over BN keys per step) or, when lo < 0, the tree block: the request's
own nodes as keys under the ancestor mask. Each item writes its normalised partial output and its
base-2 log-sum-exp to the workspace.

`tree_attn_merge_kernel`: one program per (node, query head); combines the request's partials by
log-sum-exp into the output (and the natural-log LSE).

Trusts the plan: slot indices were range-checked by tree_attn.plan, items hold ranges inside the
request's kv_indices, and every node sees itself (the tree block's row maximum is finite).
"""

import triton
import triton.language as tl


@triton.jit
def _slot_offsets(slot, PAGE: tl.constexpr, stride_page, stride_off, head_off):
    slot = slot.to(tl.int64)
    if PAGE == 1:
        return slot * stride_page + head_off
    return (slot // PAGE) * stride_page + (slot % PAGE) * stride_off + head_off


@triton.jit
def _prefix_step(q, m_i, l_i, acc, start, hi, k_ptr, v_ptr, kv_indices, sm_scale_log2, stride_kp, stride_ko, k_head,
                 stride_vp, stride_vo, v_head, PAGE: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                 MASKED: tl.constexpr):
    """One online-softmax step over the prefix keys kv_indices[start:start+BN] (those below `hi` when MASKED)."""
    offs_n = start + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if MASKED:
        ok_n = offs_n < hi
        slot = tl.load(kv_indices + offs_n, mask=ok_n, other=0)
    else:
        slot = tl.load(kv_indices + offs_n)
    k_rows = _slot_offsets(slot, PAGE, stride_kp, stride_ko, k_head)
    v_rows = _slot_offsets(slot, PAGE, stride_vp, stride_vo, v_head)
    if MASKED:
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=ok_n[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :])
    s = tl.dot(q, tl.trans(k)) * sm_scale_log2
    if MASKED:
        s = tl.where(ok_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=ok_n[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def tree_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr,
    qo_indptr, kv_indices, tree_mask, items, po_ptr, plse_ptr,
    sm_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TN: tl.constexpr,
    PAGE: tl.constexpr, NEW: tl.constexpr,
):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    req = tl.load(items + pid * 4)
    if req < 0:  # an unused slot of a fixed-capacity schedule
        return
    tile = tl.load(items + pid * 4 + 1)
    lo = tl.load(items + pid * 4 + 2)
    hi = tl.load(items + pid * 4 + 3)
    q0 = tl.load(qo_indptr + req)
    n = tl.load(qo_indptr + req + 1) - q0

    offs_m = tile * BM + tl.arange(0, BM)
    node = offs_m // G
    row_ok = node < n
    offs_d = tl.arange(0, D)
    q_rows = (q0 + node).to(tl.int64) * stride_qt + (hk * G + offs_m % G) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    if lo >= 0:
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        full = lo + (hi - lo) // BN * BN
        for start in range(lo, full, BN):  # whole key blocks: no masks
            m_i, l_i, acc = _prefix_step(q, m_i, l_i, acc, start, hi, k_ptr, v_ptr, kv_indices, sm_scale_log2,
                                         stride_kp, stride_ko, hk * stride_kh, stride_vp, stride_vo, hk * stride_vh,
                                         PAGE, D, BN, False)
        if full < hi:  # the ragged last block
            m_i, l_i, acc = _prefix_step(q, m_i, l_i, acc, full, hi, k_ptr, v_ptr, kv_indices, sm_scale_log2,
                                         stride_kp, stride_ko, hk * stride_kh, stride_vp, stride_vo, hk * stride_vh,
                                         PAGE, D, BN, True)
    else:
        offs_j = tl.arange(0, TN)
        ok_j = offs_j < n
        if NEW:
            k_rows = (q0 + offs_j).to(tl.int64) * stride_knt + hk * stride_knh
            k = tl.load(kn_ptr + k_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
            v_rows = (q0 + offs_j).to(tl.int64) * stride_vnt + hk * stride_vnh
            v = tl.load(vn_ptr + v_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
        else:  # the nodes' own slots: the `hi` entries of kv_indices onward, in local node order
            slot = tl.load(kv_indices + hi + offs_j, mask=ok_j, other=0)
            k_rows = _slot_offsets(slot, PAGE, stride_kp, stride_ko, hk * stride_kh)
            k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
            v_rows = _slot_offsets(slot, PAGE, stride_vp, stride_vo, hk * stride_vh)
            v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
        bits = tl.load(tree_mask + q0 + node, mask=row_ok, other=0)
        seen = ((bits[:, None] >> offs_j[None, :].to(tl.int64)) & 1) != 0
        s = tl.dot(q, tl.trans(k)) * sm_scale_log2
        s = tl.where(seen & ok_j[None, :], s, float("-inf"))
        m_i = tl.max(s, 1)
        m_i = tl.where(row_ok, m_i, 0.0)  # padding rows see nothing: keep them finite
        p = tl.exp2(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    base = (pid * HKV + hk) * BM + tl.arange(0, BM)
    tl.store(po_ptr + base.to(tl.int64)[:, None] * D + offs_d[None, :], acc / l_safe[:, None])
    tl.store(plse_ptr + base, m_i + tl.log2(l_safe))


@triton.jit
def tree_attn_merge_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr, node_req, qo_indptr, req_table,
    stride_ot, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    req = tl.load(node_req + t)
    first = tl.load(req_table + req * 3)  # the request's first work item
    parts = tl.load(req_table + req * 3 + 1)  # prefix splits + the tree block, per row block
    tiles = tl.load(req_table + req * 3 + 2)  # row blocks; items run split-major, row block minor
    m = (t - tl.load(qo_indptr + req)) * G + h % G
    tile = m // BM
    row = m % BM
    offs_d = tl.arange(0, D)
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, parts, BP):  # BP partials at a time: their loads are independent
        c = c0 + tl.arange(0, BP)
        ok = c < parts
        at = ((first + c * tiles + tile) * HKV + hk) * BM + row
        lse_c = tl.load(plse_ptr + at, mask=ok, other=float("-inf"))
        # a partial of LSE -inf (a slot the "ws" kernel's halves items leave empty) has weight 0: not read
        live = ok & (lse_c > float("-inf"))
        o_c = tl.load(po_ptr + at.to(tl.int64)[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse_c, 0))
        w = tl.exp2(lse_c - m_new)
        scale_old = tl.exp2(m_run - m_new)
        acc = acc * scale_old + tl.sum(o_c * w[:, None], 0)
        l_run = l_run * scale_old + tl.sum(w, 0)
        m_run = m_new
    o = acc / l_run
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        tl.store(lse_ptr + t * (HKV * G) + h, (m_run + tl.log2(l_run)) * 0.6931471805599453)
