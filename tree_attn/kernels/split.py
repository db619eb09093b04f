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

With a plan (DEVICE false) both kernels trust it: slot indices were range-checked by tree_attn.plan, items
hold ranges inside the request's kv_indices, and every node sees itself (the tree block's row maximum is
finite). With DEVICE true (the one-call `tree_attention`) there is no plan: split program i derives work item
i of the schedule from qo_indptr / kv_indptr itself (the one `tree_attn.ops._schedule` builds on the host, with
at most WAVES waves of items; the grid is a bound from the shapes, item-major so that the programs past the
schedule's end come after every item, and they return), and writes its request's row of `req_table` for the
merge. The item reaches the key loop through global memory (stored, then loaded back after a CTA barrier):
loaded, the compiler keeps it in uniform registers as it does a plan's item; computed in registers, the key
loop's addressing took 13% more instructions and spilled (tests/test_sm90_codegen.py). Both kernels check the
metadata on the device and record the first problem in `status` (code, detail), which
`tree_attn.check_metadata` raises: bad indptr arrays run no item and every row is NaN; an item checks its slots
as its key steps load them, reads the cache's last slot in place of one outside it, and writes NaN rows; a node
whose mask word breaks the rules is NaN. Nothing is read out of bounds.
"""

import triton
import triton.language as tl


@triton.jit
def _slot_offsets(slot, PAGE: tl.constexpr, stride_page, stride_off, head_off):
    """Element offsets of token slots `slot` (in [0, slots): checked by the plan or the device checks), widened
    without their sign: a sign extension took a shift and a wider multiply per slot in the key loop."""
    slot = slot.to(tl.uint32, bitcast=True).to(tl.int64)
    if PAGE == 1:
        return slot * stride_page + head_off
    return (slot // PAGE) * stride_page + (slot % PAGE) * stride_off + head_off


@triton.jit
def _checked_slots(slot, top, slots):
    """The device build's slot check (two instructions a slot): `top` raised to the largest of `slot` read as
    unsigned (a negative slot is above any cache), and `slot` clamped to the cache's last slot, so that nothing is
    read out of bounds; the item writes NaN rows when `top` ends at or above `slots`."""
    slot = slot.to(tl.uint32, bitcast=True)
    return tl.minimum(slot, (slots - 1).to(tl.uint32)), tl.maximum(top, tl.max(slot, 0))


@triton.jit
def _prefix_step(q, m_i, l_i, acc, top, start, hi, slots, k_ptr, v_ptr, kv_indices, sm_scale_log2, stride_kp, stride_ko,
                 k_head, stride_vp, stride_vo, v_head, PAGE: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                 MASKED: tl.constexpr, CHECK: tl.constexpr):
    """One online-softmax step over the prefix keys kv_indices[start:start+BN] (those below `hi` when MASKED).
    CHECK: `top` keeps the largest slot read so far and a slot outside the cache is read as its last
    (`_checked_slots`)."""
    offs_n = start + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if MASKED:
        ok_n = offs_n < hi
        slot = tl.load(kv_indices + offs_n, mask=ok_n, other=0)
    else:
        slot = tl.load(kv_indices + offs_n)
    if CHECK:
        slot, top = _checked_slots(slot, top, slots)
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
    return m_new, l_i, acc, top


# --------------------------------------------------------------------------------------------
# The device schedule and checks (DEVICE true: the one-call path without a plan).
# --------------------------------------------------------------------------------------------

# codes of `status[0]`; tree_attn.ops.METADATA_PROBLEMS words them
BAD_QO_INDPTR = tl.constexpr(1)
BAD_KV_INDPTR = tl.constexpr(2)
TOO_MANY_NODES = tl.constexpr(3)
FEW_NODE_SLOTS = tl.constexpr(4)
BAD_SLOT = tl.constexpr(5)
BAD_MASK = tl.constexpr(6)
OVER_CAPACITY = tl.constexpr(7)


@triton.jit
def _record(status, code, detail):
    """Keep the first problem: status[0] = code (where it is 0), status[1] = its detail."""
    old = tl.atomic_cas(status, 0, code)
    if old == 0:
        tl.atomic_xchg(status + 1, detail)


@triton.jit
def _meta(qo_indptr, kv_indptr, B, NEW: tl.constexpr, BB: tl.constexpr):
    """Per request r < B (lanes of BB): qo_indptr[r], its nodes n, kv_indptr[r], its prefix keys L (its kv
    entries less its nodes' own slots when they are in the cache), and the lane mask."""
    r = tl.arange(0, BB)
    inb = r < B
    qo0 = tl.load(qo_indptr + r, mask=inb, other=0)
    n = tl.load(qo_indptr + r + 1, mask=inb, other=0) - qo0
    kv0 = tl.load(kv_indptr + r, mask=inb, other=0)
    L = tl.load(kv_indptr + r + 1, mask=inb, other=0) - kv0
    if not NEW:
        L = L - n
    return qo0, n, kv0, L, inb


@triton.jit
def _meta_problem(qo_indptr, kv_indptr, n, L, inb, B, T, NKV, NEW: tl.constexpr, BB: tl.constexpr,
                  MAXN: tl.constexpr):
    """(code, detail) of the first problem of the indptr arrays, in tree_attn.plan's order; (0, -1) if none.
    Detail: the request, or -1 where the problem is an end of the array. Unlike plan, kv_indptr may end before
    NKV, the length of kv_indices."""
    r = tl.arange(0, BB)
    none = BB
    qo_down = tl.min(tl.where(inb & (n < 0), r, none), 0)
    kv_entries = L if NEW else L + n
    kv_down = tl.min(tl.where(inb & (kv_entries < 0), r, none), 0)
    big = tl.min(tl.where(inb & (n > MAXN), r, none), 0)
    few = tl.min(tl.where(inb & (L < 0), r, none), 0)
    qo_bad = (tl.load(qo_indptr) != 0) | (qo_down < none) | (tl.load(qo_indptr + B) != T)
    # kv_indices may be longer than the step's slots (a fixed buffer under a CUDA graph): entries past the end unused
    kv_bad = (tl.load(kv_indptr) != 0) | (kv_down < none) | (tl.load(kv_indptr + B) > NKV)
    code = tl.where(qo_bad, BAD_QO_INDPTR, tl.where(kv_bad, BAD_KV_INDPTR, tl.where(
        big < none, TOO_MANY_NODES, tl.where(few < none, FEW_NODE_SLOTS, 0))))
    detail = tl.where(qo_bad, qo_down, tl.where(kv_bad, kv_down, tl.where(big < none, big, few)))
    return code, tl.where(detail < none, detail, -1)


@triton.jit
def _split_len(n, L, inb, target, item_cost, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               WAVES: tl.constexpr):
    """Prefix keys per split: tree_attn.ops._split_blocks (waves 1..WAVES) on the device, times BN."""
    tiles = tl.where(inb, (n * G + BM - 1) // BM, 0)
    blocks = tl.where(inb, (L + BN - 1) // BN, 0)
    total = tl.sum(tiles * blocks, 0)
    best_per = total * 0 + 1
    best_cost = total * 0 - 1  # none yet
    for w in tl.static_range(1, WAVES + 1):
        per = tl.maximum((total + w * target - 1) // (w * target), 1)
        items = tl.sum(tiles * ((blocks + per - 1) // per), 0)
        cost = (items + target - 1) // target * (per + item_cost)
        better = (best_cost < 0) | (cost < best_cost) | ((cost == best_cost) & (per > best_per))
        best_per = tl.where(better, per, best_per)
        best_cost = tl.where(better, cost, best_cost)
    return tl.where(total == 0, 1, best_per) * BN


@triton.jit
def _request_items(n, L, inb, split_len, G: tl.constexpr, BM: tl.constexpr):
    """Per request: row blocks, prefix splits, and work items (splits + the tree block, per row block)."""
    tiles = tl.where(inb, (n * G + BM - 1) // BM, 0)
    splits = tl.where(inb, (L + split_len - 1) // split_len, 0)
    return tiles, splits, tiles * (splits + 1)


@triton.jit
def _device_item(i, qo0, n, kv0, L, inb, tiles, splits, items, split_len, BB: tl.constexpr):
    """Work item i of the device schedule as tree_attn.ops._schedule lays it out (request-major, then split,
    then row block; a request's tree items after its splits), from the requests' lanes (`_meta`,
    `_request_items`): (request, row block, lo, hi, the request's first item, its splits + 1, its row blocks,
    its first node, its nodes)."""
    ends = tl.cumsum(items, 0)
    lane = tl.arange(0, BB)
    req = tl.sum(tl.where(inb & (ends <= i), 1, 0), 0)  # requests wholly before item i
    at = lane == req
    first = tl.sum(tl.where(at, ends - items, 0), 0)
    t_r = tl.sum(tl.where(at, tiles, 0), 0)
    s_r = tl.sum(tl.where(at, splits, 0), 0)
    kv_r = tl.sum(tl.where(at, kv0, 0), 0)
    end = kv_r + tl.sum(tl.where(at, L, 0), 0)
    local = i - first
    c = local // t_r
    lo = tl.where(c < s_r, kv_r + c * split_len, -1)
    hi = tl.where(c < s_r, tl.minimum(kv_r + (c + 1) * split_len, end), end)
    return req, local % t_r, lo, hi, first, s_r + 1, t_r, tl.sum(tl.where(at, qo0, 0), 0), tl.sum(tl.where(at, n, 0), 0)


@triton.jit
def _first_bad_slot(kv_indices, lo, hi, slots, CHUNK: tl.constexpr):
    """The first position in [lo, hi) of kv_indices whose slot is outside [0, slots), or hi if none: for the
    record of an item whose key steps saw one."""
    first = hi
    for start in range(lo, hi, CHUNK):
        at = start + tl.arange(0, CHUNK)
        slot = tl.load(kv_indices + at, mask=at < hi, other=0)
        first = tl.minimum(first, tl.min(tl.where((at < hi) & ((slot < 0) | (slot >= slots)), at, hi), 0))
    return first


# --------------------------------------------------------------------------------------------
# The kernels.
# --------------------------------------------------------------------------------------------


@triton.jit
def _split_item(item, hk, req, tile, lo, hi, q0, n, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, kv_indices, tree_mask, po_ptr,
                plse_ptr, status, sm_scale_log2, stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_vp,
                stride_vo, stride_vh, stride_knt, stride_knh, stride_vnt, stride_vnh, slots, HKV: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TN: tl.constexpr,
                PAGE: tl.constexpr, NEW: tl.constexpr, CHECK: tl.constexpr):
    """Work item `item` = (req, row block `tile`, [lo, hi)) of KV head hk, whose request's nodes are rows
    q0 .. q0 + n of q: its partial output and LSE. CHECK: the item's slots are checked as its steps read them
    (`_prefix_step`); with one outside the cache the item writes a NaN LSE, and row block 0 of KV head 0
    records the first such position in `status`."""
    offs_m = tile * BM + tl.arange(0, BM)
    node = offs_m // G
    row_ok = node < n
    offs_d = tl.arange(0, D)
    q_rows = (q0 + node).to(tl.int64) * stride_qt + (hk * G + offs_m % G) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    top = tl.zeros([], tl.uint32)  # CHECK: the largest slot the item read, unsigned (`_prefix_step`)
    if lo >= 0:
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        full = lo + (hi - lo) // BN * BN
        for start in range(lo, full, BN):  # whole key blocks: no masks
            m_i, l_i, acc, top = _prefix_step(q, m_i, l_i, acc, top, start, hi, slots, k_ptr, v_ptr, kv_indices,
                                              sm_scale_log2, stride_kp, stride_ko, hk * stride_kh, stride_vp,
                                              stride_vo, hk * stride_vh, PAGE, D, BN, False, CHECK)
        if full < hi:  # the ragged last block
            m_i, l_i, acc, top = _prefix_step(q, m_i, l_i, acc, top, full, hi, slots, k_ptr, v_ptr, kv_indices,
                                              sm_scale_log2, stride_kp, stride_ko, hk * stride_kh, stride_vp,
                                              stride_vo, hk * stride_vh, PAGE, D, BN, True, CHECK)
        first, end = lo, hi  # the item's positions in kv_indices
    else:
        offs_j = tl.arange(0, TN)
        ok_j = offs_j < n
        first, end = hi, hi
        if NEW:
            k_rows = (q0 + offs_j).to(tl.int64) * stride_knt + hk * stride_knh
            k = tl.load(kn_ptr + k_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
            v_rows = (q0 + offs_j).to(tl.int64) * stride_vnt + hk * stride_vnh
            v = tl.load(vn_ptr + v_rows[:, None] + offs_d[None, :], mask=ok_j[:, None], other=0.0)
        else:  # the nodes' own slots: the `hi` entries of kv_indices onward, in local node order
            end = hi + n
            slot = tl.load(kv_indices + hi + offs_j, mask=ok_j, other=0)
            if CHECK:
                slot, top = _checked_slots(slot, top, slots)
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
    lse = m_i + tl.log2(l_safe)
    if CHECK:
        keys_bad = top >= slots.to(tl.uint32)
        lse = tl.where(keys_bad, float("nan"), lse)
    # rows of real nodes only: the merge reads no other row, and a one-token step's 64-row tile holds G of them
    # (its padding rows would write about as many bytes as the item reads of K and V). The mask is formed here
    # from scalars, not row_ok's expression: kept live across the key loop, a [BM] mask made it spill.
    rows = tl.arange(0, BM)
    base = (item * HKV + hk) * BM + rows
    real = rows < n * G - tile * BM
    tl.store(po_ptr + base.to(tl.int64)[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=real[:, None])
    tl.store(plse_ptr + base, lse, mask=real)
    if CHECK:  # after the stores: little is live across the call
        if keys_bad & (hk == 0) & (tile == 0):
            _record(status, BAD_SLOT, _first_bad_slot(kv_indices, first, end, slots, 1024))


@triton.jit(do_not_specialize=["B", "T", "NKV", "slots", "target", "item_cost", "cap"])
def tree_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr,
    qo_indptr, kv_indices, tree_mask, items, po_ptr, plse_ptr,
    sm_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    kv_indptr, req_table, status, B, T, NKV, slots, target, item_cost, cap,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TN: tl.constexpr,
    PAGE: tl.constexpr, NEW: tl.constexpr, DEVICE: tl.constexpr = False, BB: tl.constexpr = 1,
    WAVES: tl.constexpr = 4,
):
    """One program per (work item, KV head). DEVICE false: the items come from the plan's `items` [grid, 4]; the
    arguments after stride_vnh are unused. DEVICE true: a grid of cap * HKV programs, item-major; program
    (i, hk) computes item i of the schedule for KV head hk (module docstring), `items` is scratch of
    [cap * HKV, 8] int32 and `cap` the bound on items."""
    pid = tl.program_id(0)
    if DEVICE:
        # items-major: every KV head of the schedule's items comes before the programs past its end
        i = pid // HKV
        hk = pid % HKV
        qo0, n, kv0, L, inb = _meta(qo_indptr, kv_indptr, B, NEW, BB)
        code, detail = _meta_problem(qo_indptr, kv_indptr, n, L, inb, B, T, NKV, NEW, BB, 64)
        split_len = _split_len(n, L, inb, target, item_cost, G, BM, BN, WAVES)
        tiles, splits, per_request = _request_items(n, L, inb, split_len, G, BM)
        count = tl.sum(per_request, 0)
        code = tl.where((code == 0) & (count > cap), OVER_CAPACITY, code)
        detail = tl.where(code == OVER_CAPACITY, count, detail)
        if (code != 0) & (pid == 0):
            _record(status, code, detail)
        count = tl.where(code != 0, 0, count)  # a call with bad indptr arrays runs no item: the merge writes NaN
        if i < count:
            req, tile, lo, hi, first, parts, t_r, q0, n_r = _device_item(i, qo0, n, kv0, L, inb, tiles, splits,
                                                                         per_request, split_len, BB)
            if (i == first) & (hk == 0):
                tl.store(req_table + req * 3, first)
                tl.store(req_table + req * 3 + 1, parts)
                tl.store(req_table + req * 3 + 2, t_r)
            # through memory, so that the compiler keeps the item uniform, as a plan's (module docstring)
            row = items + pid * 8
            tl.store(row, req)
            tl.store(row + 1, tile)
            tl.store(row + 2, lo)
            tl.store(row + 3, hi)
            tl.store(row + 4, q0)
            tl.store(row + 5, n_r)
            tl.debug_barrier()  # a scalar store is one thread's: the CTA's loads below must see it
            _split_item(i, hk, tl.load(row, volatile=True), tl.load(row + 1, volatile=True),
                        tl.load(row + 2, volatile=True), tl.load(row + 3, volatile=True),
                        tl.load(row + 4, volatile=True), tl.load(row + 5, volatile=True), q_ptr, k_ptr, v_ptr,
                        kn_ptr, vn_ptr, kv_indices, tree_mask, po_ptr, plse_ptr, status, sm_scale_log2, stride_qt,
                        stride_qh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_knt,
                        stride_knh, stride_vnt, stride_vnh, slots, HKV, G, D, BM, BN, TN, PAGE, NEW, True)
    else:
        hk = tl.program_id(1)
        req = tl.load(items + pid * 4)
        if req < 0:  # an unused slot of a fixed-capacity schedule
            return
        tile = tl.load(items + pid * 4 + 1)
        lo = tl.load(items + pid * 4 + 2)
        hi = tl.load(items + pid * 4 + 3)
        q0 = tl.load(qo_indptr + req)
        n = tl.load(qo_indptr + req + 1) - q0
        _split_item(pid, hk, req, tile, lo, hi, q0, n, q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, kv_indices, tree_mask,
                    po_ptr, plse_ptr, status, sm_scale_log2, stride_qt, stride_qh, stride_kp, stride_ko, stride_kh,
                    stride_vp, stride_vo, stride_vh, stride_knt, stride_knh, stride_vnt, stride_vnh, slots, HKV, G, D,
                    BM, BN, TN, PAGE, NEW, False)


@triton.jit
def _mask_problem(tree_mask, t, q0, n, MAXN: tl.constexpr):
    """Whether node t's mask word breaks tree_attn.plan's rules: a bit at or above its request's n nodes, no
    bit of its own, or a seen node whose own mask is not inside t's (not ancestor-closed)."""
    word = tl.load(tree_mask + t)
    j = tl.arange(0, MAXN)
    bit = ((word >> j.to(tl.int64)) & 1) != 0
    ok_j = j < n
    stray = tl.sum(tl.where(bit & ~ok_j, 1, 0), 0) > 0
    own = tl.sum(tl.where(bit & (j == t - q0), 1, 0), 0) == 0
    seen = tl.load(tree_mask + q0 + j, mask=bit & ok_j, other=0)
    open_ = tl.sum(tl.where((seen & ~word) != 0, 1, 0), 0) > 0
    return stray | own | open_


@triton.jit(do_not_specialize=["B", "T", "NKV"])
def tree_attn_merge_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr, node_req, qo_indptr, req_table,
    stride_ot, stride_oh,
    kv_indptr, tree_mask, status, B, T, NKV,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, WRITE_LSE: tl.constexpr,
    DEVICE: tl.constexpr = False, NEW: tl.constexpr = True, BB: tl.constexpr = 1,
):
    """DEVICE false: node_req and req_table come from the plan; kv_indptr .. NKV are unused. DEVICE true: the
    node's request is found in qo_indptr, req_table is the split kernel's, and a node whose call has bad indptr
    arrays or whose mask breaks the rules gets NaN (node_req is unused)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    if DEVICE:
        qo0, n, kv0, L, inb = _meta(qo_indptr, kv_indptr, B, NEW, BB)
        code, detail = _meta_problem(qo_indptr, kv_indptr, n, L, inb, B, T, NKV, NEW, BB, 64)
        req = tl.sum(tl.where(inb & (qo0 + n <= t), 1, 0), 0)
        sel = tl.arange(0, BB) == req
        q0 = tl.sum(tl.where(sel, qo0, 0), 0)
        # the request's row is read beside the mask check, not after it (req < B where the indptr arrays are good)
        first = tl.load(req_table + req * 3, mask=req < B, other=0)
        parts = tl.load(req_table + req * 3 + 1, mask=req < B, other=0)
        tiles = tl.load(req_table + req * 3 + 2, mask=req < B, other=1)
        good = code == 0
        if good:
            good = ~_mask_problem(tree_mask, t, q0, tl.sum(tl.where(sel, n, 0), 0), 64)
            if (~good) & (h == 0):
                _record(status, BAD_MASK, t)
        parts = tl.where(good, parts, 0)  # a bad node merges nothing: NaN
    else:
        req = tl.load(node_req + t)
        first = tl.load(req_table + req * 3)  # the request's first work item
        parts = tl.load(req_table + req * 3 + 1)  # prefix splits + the tree block, per row block
        tiles = tl.load(req_table + req * 3 + 2)  # row blocks; items run split-major, row block minor
        q0 = tl.load(qo_indptr + req)
    m = (t - q0) * G + h % G
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
        lse = (m_run + tl.log2(l_run)) * 0.6931471805599453
        if DEVICE:
            lse = tl.where(parts > 0, lse, float("nan"))
        tl.store(lse_ptr + t * (HKV * G) + h, lse)
