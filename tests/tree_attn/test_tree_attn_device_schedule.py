"""The one-call path's device schedule: the Triton kernels derive their work items from qo_indptr / kv_indptr
(tree_attn/kernels/split.py `_split_len`, `_device_item`) instead of reading a host plan's.

* the items equal the host's `tree_attn.ops._schedule` at the same waves, on random batches (interpreter);
* the scratch bound the one-call path sizes from the shapes holds every such schedule;
* a call equals plan + run bit for bit where the two schedules agree, and checks against the reference on
  ragged batches of both cache layouts, nodes in the cache or not;
* a bad slot poisons only the rows whose keys it names (other requests stay exact);
* (tests/test_sm90_codegen.py: the kernels build with the device schedule for sm_90, on wgmma, and sm_80.)
"""

import random

import pytest
import torch
import triton
import triton.language as tl

import tree_attn
from specpilot.testing import assert_bitwise_equal
from tree_attn import ops
from tree_attn.configs import SplitConfig
from tree_attn.kernels.split import _device_item, _meta, _request_items, _split_len


@triton.jit
def _schedule_probe(qo_indptr, kv_indptr, B, target, item_cost, out, table, count_out, G: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, NEW: tl.constexpr, BB: tl.constexpr, WAVES: tl.constexpr,
                    CAP: tl.constexpr):
    """Every item of the device schedule, as the split kernel's programs compute them, one after another."""
    qo0, n, kv0, L, inb = _meta(qo_indptr, kv_indptr, B, NEW, BB)
    split_len = _split_len(n, L, inb, target, item_cost, G, BM, BN, WAVES)
    tiles_r, splits, per_request = _request_items(n, L, inb, split_len, G, BM)
    count = tl.sum(per_request, 0)
    tl.store(count_out, count)
    tl.store(count_out + 1, split_len)
    for i in range(0, tl.minimum(count, CAP)):
        req, tile, lo, hi, first, parts, tiles, q0, nodes = _device_item(i, qo0, n, kv0, L, inb, tiles_r, splits,
                                                                         per_request, split_len, BB)
        same = (q0 == tl.load(qo_indptr + req)) & (nodes == tl.load(qo_indptr + req + 1) - q0)
        tl.store(out + i * 4, tl.where(same, req, -1))  # the item carries its request's nodes
        tl.store(out + i * 4 + 1, tile)
        tl.store(out + i * 4 + 2, lo)
        tl.store(out + i * 4 + 3, hi)
        if i == first:
            tl.store(table + req * 3, first)
            tl.store(table + req * 3 + 1, parts)
            tl.store(table + req * 3 + 2, tiles)


def _random_step(rng, B):
    ns = [rng.choice([0, 1, 3, 8, 17, 32, 64, rng.randrange(65)]) for _ in range(B)]
    lens = [rng.choice([0, 1, 31, 64, 1000, rng.randrange(20000)]) for _ in range(B)]
    return ns, lens


@pytest.mark.parametrize("seed", range(6))
def test_device_items_equal_the_host_schedule(seed):
    rng = random.Random(seed)
    cap = 4096
    for _ in range(6):
        B = rng.choice([1, 2, 5, 24, 40])
        ns, lens = _random_step(rng, B)
        nic = rng.random() < 0.5
        G = rng.choice([1, 4, 6, 8])
        cfg = SplitConfig(block_m=rng.choice([32, 64]), block_n=rng.choice([32, 64]), num_warps=4, num_stages=2,
                          programs_per_sm=2.0, merge_warps=2, merge_parts=16, item_cost=rng.choice([0, 8, 32]))
        target = rng.choice([1, 7, 66, 264])
        qo, kv = [0], [0]
        for n, L in zip(ns, lens):
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + L + (n if nic else 0))
        items, table, _, split_len, used = ops._schedule("t", qo, kv, nic, G, cfg, target, None,
                                                         waves=ops.DEVICE_WAVES)
        got = torch.full((cap, 4), -7, dtype=torch.int32)
        got_table = torch.zeros(B, 3, dtype=torch.int32)
        count = torch.zeros(2, dtype=torch.int32)
        _schedule_probe[(1,)](torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), B, target,
                              cfg.item_cost, got, got_table, count, G=G, BM=cfg.block_m, BN=cfg.block_n, NEW=not nic,
                              BB=ops._lanes(B), WAVES=ops.DEVICE_WAVES, CAP=cap)
        assert used <= cap
        assert count.tolist() == [used, split_len], (ns, lens, nic, G, cfg, target)
        assert torch.equal(got[:used], items[:used]), (ns, lens, nic, G, cfg, target)
        with_items = [r for r in range(B) if table[r, 2] > 0]
        assert torch.equal(got_table[with_items], table[with_items])


@pytest.mark.parametrize("seed", range(4))
def test_scratch_bound_holds_every_schedule(seed):
    """The one-call path's bound on work items (DEVICE_WAVES waves of `target` plus two per row block) holds the
    device schedule of any step with these shapes: prefix items are under waves x target plus one per row
    block, tree items one per row block."""
    rng = random.Random(seed)
    cfg = SplitConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2.0, merge_warps=2,
                      merge_parts=16, item_cost=32)
    for _ in range(300):
        B = rng.choice([1, 2, 3, 8, 24, 64])
        ns, lens = _random_step(rng, B)
        G, target = rng.choice([1, 6, 8]), rng.choice([1, 5, 66, 132])
        qo, kv = [0], [0]
        for n, L in zip(ns, lens):
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + L)
        *_, used = ops._schedule("t", qo, kv, False, G, cfg, target, None, waves=ops.DEVICE_WAVES)
        T = qo[-1]
        assert used <= ops.DEVICE_WAVES * target + 2 * (T * G // cfg.block_m + min(B, T)), (ns, lens, G, target)


def _attend(b, **kw):
    out = b.poisoned_out()
    got, lse = tree_attn.tree_attention(*b.args(), sm_scale=b.sm_scale, **b.new_kw(), out=out, return_lse=True, **kw)
    return got, lse


STEPS = {
    "ragged": [("draft9", 23), ("empty", 1), ("chain4", 2), ("rand13", 0)],
    "one-long": [("draft32", 300)],
    "many": [("star5", 9)] * 7 + [("single", 40)],
}


# every pair of (step, layout), (step, nodes in the cache) and (layout, nodes in the cache) once: six cases, not the
# twelve of the full product
PAIRWISE = [("ragged", "slot", False), ("ragged", "paged", True), ("one-long", "slot", True),
            ("one-long", "paged", False), ("many", "slot", False), ("many", "paged", True)]


@pytest.mark.parametrize("step, layout, nodes_in_cache", PAIRWISE,
                         ids=[f"{s}-{l}-{'in-cache' if c else 'k_new'}" for s, l, c in PAIRWISE])
def test_one_call_equals_plan_and_run_bitwise(step, layout, nodes_in_cache, make_batch, check, monkeypatch):
    """With the same waves the two schedules are the same items, and a host plan sized to the one-call plan's tree
    block (which fits any tree of the call's node count: the call cannot read the largest tree's size without a host
    read) runs the same kernels, so they give the same bits; and the call passes the reference check. (With a
    smaller tree block the masked keys add zeros, but under the interpreter the dots are the CPU BLAS's, whose order
    of summation may change with the block's size: 1-ulp LSE differences on some CPUs.)"""
    monkeypatch.setattr(ops, "DEVICE_WAVES", 8)
    b = make_batch(STEPS[step], H=6, Hkv=1, D=64, layout=layout, page_size=8, nodes_in_cache=nodes_in_cache,
                   seed=len(step))
    planned = []
    real = ops.plan
    monkeypatch.setattr(ops, "plan", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    got, lse = _attend(b)
    assert not planned, "the one-call path planned on the host"
    check(b, got, lse)
    one_call = ops._DEVICE_LAST[ops._stream_key(b.q)][2]  # the plan the call launched with
    p = real(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(max_nodes=one_call.tree_block))
    assert p.tree_block == one_call.tree_block
    out = b.poisoned_out()
    want, want_lse = tree_attn.run(p, b.q, b.k_cache, b.v_cache, **b.new_kw(), sm_scale=b.sm_scale, out=out,
                                   return_lse=True)
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(lse, want_lse)
    tree_attn.check_metadata(b.q.device)  # nothing recorded
    if step == "many":  # a schedule longer than one wave of items
        assert p.num_items > ops._target_items(b.q.device, 1, p.dispatch.config)


@pytest.mark.parametrize("where", ["prefix-above", "prefix-negative", "node-slot"])
def test_bad_slot_poisons_only_its_rows(where, make_batch):
    """A slot outside the cache in request 1's prefix (past the cache's end, or negative) or among its nodes' own
    slots: request 1's rows are NaN, the other requests' rows are the bits of the same call with a valid slot
    there, and check_metadata names the position."""
    b = make_batch([("rand5", 30), ("chain3", 20), ("single", 9)], H=4, Hkv=2, D=64, seed=11,
                   nodes_in_cache=where == "node-slot")
    good, _ = _attend(b)
    idx = b.kv_indices.clone()
    at = int(b.kv_indptr[2]) - 1 if where == "node-slot" else int(b.kv_indptr[1]) + 7
    b.kv_indices[at] = -3 if where == "prefix-negative" else b.cache_slots + 5
    bad, _ = _attend(b)
    b.kv_indices.copy_(idx)
    with pytest.raises(ValueError, match=rf"kv_indices\[{at}\]"):
        tree_attn.check_metadata(b.q.device)
    rows = slice(int(b.qo_indptr[1]), int(b.qo_indptr[2]))
    assert torch.isnan(bad[rows].float()).all()
    keep = torch.ones(bad.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert_bitwise_equal(bad[keep], good[keep])


def test_bad_mask_poisons_only_its_node(make_batch):
    b = make_batch([("rand5", 30), ("chain3", 20)], H=4, Hkv=2, D=64, seed=12)
    good, _ = _attend(b)
    b.tree_mask[7] = 0b110  # node 2 of the chain sees node 1 but not its ancestor 0
    bad, _ = _attend(b)
    with pytest.raises(ValueError, match=r"tree_mask of node 7"):
        tree_attn.check_metadata(b.q.device)
    assert torch.isnan(bad[7].float()).all() and not torch.isnan(bad[:7].float()).any()
    assert_bitwise_equal(bad[:7], good[:7])


def test_same_metadata_tensors_reuse_the_call_plan(make_batch, check):
    """The layers of one step pass the same metadata tensors: the call reuses its plan object (values are read on
    the device each call, so new values in the same tensors need nothing on the host), and answers the new values;
    other tensors, or the same ones with another shape, build a plan again (and are checked again)."""
    b = make_batch([("draft9", 23), ("chain4", 2)], H=4, Hkv=2, D=64, seed=21)
    _attend(b)
    first = ops._DEVICE_LAST[(b.q.device, 0)][2]
    b2 = b.refill(seed=22)
    check(b2, *_attend(b2))  # the same metadata tensors (refill keeps them), new q / k / v
    assert ops._DEVICE_LAST[(b.q.device, 0)][2] is first
    # another step written into the same tensors: other slots of the same count
    perm = b.kv_indices[torch.randperm(b.kv_indices.shape[0], generator=torch.Generator().manual_seed(5))]
    b.kv_indices.copy_(perm)
    b3 = b.refill(seed=23)
    check(b3, *_attend(b3))
    assert ops._DEVICE_LAST[(b.q.device, 0)][2] is first
    b.kv_indptr = b.kv_indptr.to(torch.int64)  # a new tensor, of a dtype the kernels do not take
    with pytest.raises(TypeError, match="kv_indptr"):
        _attend(b)


def test_a_reused_call_plan_still_checks_the_call(make_batch, check, raises):
    """A call that reuses the plan of the call before (the same metadata tensors) skips only what those tensors
    and shapes already passed: the caches, k_new / v_new and out are checked each call, and a cache of the same
    slots in the other layout (paged after token-slot) runs on the same plan with its own strides."""
    b = make_batch([("draft9", 23), ("chain4", 2)], H=4, Hkv=2, D=64, nodes_in_cache=False, seed=25)
    _attend(b)
    first = ops._DEVICE_LAST[(b.q.device, 0)][2]
    call = dict(sm_scale=b.sm_scale, **b.new_kw())
    with raises(r"v_cache has dtype torch\.float16"):
        tree_attn.tree_attention(b.q, b.k_cache, b.v_cache.half(), b.kv_indptr, b.kv_indices, b.qo_indptr,
                                 b.tree_mask, **call)
    with raises(r"out is \(\(\d+, 4, 32\)"):
        tree_attn.tree_attention(*b.args(), **call, out=b.poisoned_out()[..., :32])
    with raises("v_new is missing"):
        tree_attn.tree_attention(*b.args(), sm_scale=b.sm_scale, k_new=b.k_new, v_new=None)
    assert ops._DEVICE_LAST[(b.q.device, 0)][2] is first
    slots = b.k_cache.shape[0]
    pg = next(p for p in (8, 4, 2, 1) if slots % p == 0)  # the same slots as [pages, pg, Hkv, D]: slot s at page s // pg
    k, v = (c.view(slots // pg, pg, 2, 64) for c in (b.k_cache, b.v_cache))
    got, lse = tree_attn.tree_attention(b.q, k, v, b.kv_indptr, b.kv_indices, b.qo_indptr, b.tree_mask, **call,
                                        out=b.poisoned_out(), return_lse=True)
    assert ops._DEVICE_LAST[(b.q.device, 0)][2] is first
    check(b, got, lse)


@pytest.mark.parametrize("nodes_in_cache", [False, True], ids=["k_new", "in-cache"])
def test_kv_indices_may_be_a_longer_buffer(nodes_in_cache, make_batch):
    """The one call reads kv_indices only up to kv_indptr[-1]: a fixed-size buffer (a CUDA graph's) whose tail holds
    anything, slots outside the cache included, gives the bits of the exact-length call and records nothing."""
    b = make_batch([("draft9", 23), ("chain4", 2)], H=4, Hkv=2, D=64, nodes_in_cache=nodes_in_cache, seed=24)
    want, want_lse = _attend(b)
    exact = b.kv_indices
    b.kv_indices = torch.cat([exact, torch.tensor([-5, b.cache_slots + 3, 2**31 - 1], dtype=torch.int32)])
    got, lse = _attend(b)
    b.kv_indices = exact
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(lse, want_lse)
    tree_attn.check_metadata(b.q.device)  # nothing recorded


def test_every_device_problem_has_its_message():
    """Each code the kernels can record (kernels/split.py) is worded for check_metadata, naming what to fix."""
    import triton.language as tl

    from tree_attn.kernels import split

    codes = {v.value for k, v in vars(split).items() if k.isupper() and isinstance(v, tl.constexpr)}
    assert codes == set(ops.METADATA_PROBLEMS) == set(range(1, 8))
    for text in ops.METADATA_PROBLEMS.values():
        assert "; " in text  # what is wrong; how to fix it


# ------------------------------------------------------------------ plan(schedule="device") and its update

STEP_A = [("draft9", 23), ("chain4", 40), ("rand13", 7)]
STEP_B = [("draft9", 2), ("chain4", 61), ("rand13", 0)]  # STEP_A's requests and nodes: other trees, prefixes, slots


def _run(p, b):
    out = b.poisoned_out()
    return tree_attn.run(p, b.q, b.k_cache, b.v_cache, **b.new_kw(), sm_scale=b.sm_scale, out=out, return_lse=True)


@pytest.mark.parametrize("nodes_in_cache", [False, True], ids=["k_new", "in-cache"])
def test_device_plan_and_its_update(nodes_in_cache, make_batch, check, monkeypatch):
    """A plan with schedule="device" runs as the host plan does (bit for bit where the schedules agree), and its
    update takes another step of the same batch and node count (other trees, prefixes and slots; fewer kv
    entries in the kv_capacity buffer) without a host schedule."""
    monkeypatch.setattr(ops, "DEVICE_WAVES", 8)
    kw = dict(H=6, Hkv=2, D=64, nodes_in_cache=nodes_in_cache, cache_slots=400)
    a = make_batch(STEP_A, seed=41, **kw)
    b = make_batch(STEP_B, seed=42, **kw)
    assert a.q.shape == b.q.shape
    p = tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw(schedule="device",
                                                                                          kv_capacity=400))
    assert p.status is not None and p.num_items == -1
    got, lse = _run(p, a)
    check(a, got, lse)
    host = tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw())
    want, want_lse = _run(host, a)
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(lse, want_lse)
    scheduled = []
    real = ops._schedule
    monkeypatch.setattr(ops, "_schedule", lambda *x, **k: scheduled.append(1) or real(*x, **k))
    p.update(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, validate=False)
    assert not scheduled
    got, lse = _run(p, b)
    check(b, got, lse)
    tree_attn.check_metadata(b.q.device)  # nothing recorded


def test_device_plan_update_with_bad_metadata(make_batch, raises):
    """Unvalidated, a bad slot reaches the kernels: its rows are NaN and check_metadata raises it; validated, the
    update raises at once."""
    a = make_batch(STEP_A, H=4, Hkv=2, D=64, seed=43)
    p = tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw(schedule="device"))
    bad = a.kv_indices.clone()
    bad[3] = a.cache_slots
    with raises(r"kv_indices"):
        p.update(a.qo_indptr, a.kv_indptr, bad, a.tree_mask)
    p.update(a.qo_indptr, a.kv_indptr, bad, a.tree_mask, validate=False)
    got, _ = _run(p, a)
    assert torch.isnan(got[:9].float()).all()  # request 0's rows (its prefix holds position 3)
    with raises(r"kv_indices\[3\]"):
        tree_attn.check_metadata(a.q.device)


@pytest.mark.parametrize("kw, pattern", [(dict(schedule="both"), r"schedule"),
                                         (dict(schedule="device", capacity=64), r"capacity"),
                                         (dict(schedule="device", variant="reference"), r"schedule='host'")],
                         ids=["unknown", "capacity", "reference"])
def test_device_plan_refusals(kw, pattern, make_batch, raises):
    a = make_batch(STEP_A, H=4, Hkv=2, D=64, seed=44)
    with raises(pattern):
        tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw(**kw))


def test_an_empty_cache_takes_the_host_schedule(make_batch, raises):
    """The device checks read the cache's last slot in place of one outside it, so a cache without slots is the host
    schedule's: plan(schedule="device") refuses it and the one call plans on the host (the same bits)."""
    a = make_batch([("draft9", 0), ("chain4", 0)], H=4, Hkv=2, D=64, seed=45, cache_slots=0)
    assert a.kv_indices.numel() == 0 and a.k_cache.shape[0] == 0
    with raises(r"cache_slots=0"):
        tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw(schedule="device"))
    got, _ = _attend(a)
    p = tree_attn.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.tree_mask, **a.plan_kw())
    want, _ = _run(p, a)
    assert_bitwise_equal(got, want)
