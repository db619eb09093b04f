"""CPU tests of tree_attn: the Triton kernels run under the interpreter at small, odd shapes, against
tree_attn.tree_attention_reference.

Bounds are derived (conftest.check_attn): the output within 3x the error of the fp32 reference rounded to
the output dtype, the lse within 4x the error of the fp32 reference's lse, both against the fp64 reference.
Outputs are passed in filled with NaN (and torch.empty is poisoned by tests/conftest.py), so an element
the kernel leaves unwritten fails.
"""

import random

import pytest
import torch

import tree_attn
from specpilot.testing import assert_bitwise_equal

TRITON = ["wgmma", "mma"]  # both run in the interpreter here
ALL_VARIANTS = [*TRITON, None, "reference"]


def grid(names, values, wgmma_for, ids=lambda v: "-".join(map(str, v))):
    """pytest params of `values` (tuples named by `names`) x both Triton variants, "wgmma" only for the
    values in `wgmma_for`: under the interpreter both variants run one kernel at one config (the
    tile shapes that make tl.dot wgmma or mma.sync matter only on the GPU, where
    test_tree_attn_gpu.py runs the full product), so the CPU suite names the variant where it is cheap."""
    out = []
    for v in values:
        for variant in TRITON:
            if variant == "wgmma" and v not in wgmma_for:
                continue
            out.append(pytest.param(*v, variant, id=f"{ids(v)}-{variant}"))
    return pytest.mark.parametrize(f"{names}, variant", out)


def attend(b, variant=None, **kw):
    """tree_attention into a NaN-filled out, with the lse; checks the result is written into `out`."""
    out = b.poisoned_out()
    got, lse = tree_attn.tree_attention(*b.args(), sm_scale=b.sm_scale, **b.new_kw(), out=out, return_lse=True,
                                        variant=variant, **kw)
    assert got.data_ptr() == out.data_ptr(), "the result is not the out= tensor"
    return got, lse


def run_plan(plan, b, **kw):
    out = b.poisoned_out()
    got, lse = tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), sm_scale=b.sm_scale, out=out,
                             return_lse=True, **kw)
    assert got.data_ptr() == out.data_ptr(), "the result is not the out= tensor"
    return got, lse


# ------------------------------------------------------------------------------------ tree shapes

CASES = {
    "rand13-L5": [("rand13", 5)],
    "draft32-L40": [("draft32", 40)],
    "chain7-L0": [("chain7", 0)],  # empty prefix: node 0 sees only itself
    "chain64-L3": [("chain64", 3)],  # the deepest node's mask is all 64 bits (-1 as int64)
    "rand64-L1": [("rand64", 1)],
    "star9-L2": [("star9", 2)],
    "single-L0": [("single", 0)],
    "single-L33": [("single", 33)],  # a prefix of an odd length, more than one key block
    "forest6-L4": [("forest6", 4)],  # several roots in one request
    "dag4-L3": [("dag4", 3)],  # ancestor-closed masks that no parent list gives
    "child-first5-L2": [("child-first5", 2)],  # a node's ancestor may come after it in local order
    # sizes 1..64 mixed, requests with no nodes, a long prefix beside prefixes of 0, 1 and 2 keys
    "ragged": [("rand13", 300), ("single", 1), ("empty", 5), ("chain5", 0), ("star3", 17), ("draft64", 2),
               ("empty", 0), ("forest9", 31)],
    "all-empty": [("empty", 3), ("empty", 0)],  # T = 0: nothing to write, nothing may fail
}
SLOW_CASES = {"ragged", "chain64-L3", "rand64-L1"}
# Under the interpreter "wgmma", "mma" and the default (None, "mma" here) run one kernel at one config (see `grid`):
# every case runs "mma" and the reference, and the other two names only these
NAMED_CASES = {"wgmma": {"draft32-L40", "chain64-L3", "forest6-L4", "all-empty"},
               None: {"rand13-L5", "single-L0", "dag4-L3"}}


def _shape_params():
    for case in CASES:
        for variant in ALL_VARIANTS:
            if variant in NAMED_CASES and case not in NAMED_CASES[variant]:
                continue
            slow = case in SLOW_CASES and variant in TRITON
            yield pytest.param(case, variant, id=f"{case}-{variant}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("case, variant", list(_shape_params()))
def test_tree_shapes(case, variant, make_batch, check):
    """Random trees, chains, stars, single nodes, forests and ragged batches, every variant."""
    # GQA is the subject of test_gqa_and_head_dims: the 64-node trees and the ragged batch keep one head
    h = 1 if case in SLOW_CASES else 3
    b = make_batch(CASES[case], H=h, Hkv=1, D=64, seed=len(case))
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{case}/{variant}")


@pytest.mark.parametrize("variant", TRITON)
def test_ragged_batch_small(variant, make_batch, check):
    """The ragged case at a size that stays in the fast set: a 0-node request, a long prefix beside L=1."""
    b = make_batch([("draft11", 70), ("single", 1), ("empty", 4), ("star4", 0), ("chain3", 9)], H=2, Hkv=2, D=64,
                   seed=11)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=variant)


def test_lone_nodes_return_their_values(make_batch):
    """A node with no prefix and no ancestors sees one key: its softmax weight is exactly 1, so its output
    is its own value, bit for bit, in every query head of the group."""
    b = make_batch([("single", 0)] * 3 + [("forest3", 0)], H=6, Hkv=2, D=64, seed=3)
    roots = [t for t, m in enumerate(b.tree_mask.tolist()) if m & (m - 1) == 0]  # only the node's own bit
    out, _ = attend(b)
    want = b.v_new.repeat_interleave(3, dim=1)
    assert_bitwise_equal(out[roots], want[roots])


# ------------------------------------------------------------------------------------ heads

@grid("G, D", [(g, d) for g in (1, 6, 8) for d in (64, 128, 256)], wgmma_for={(1, 64), (6, 128), (8, 256)})
def test_gqa_and_head_dims(G, D, variant, make_batch, check):
    """GQA ratios 1, 6 and 8 (query head h reads kv head h // G; two kv heads but for G=8), every head dim."""
    reqs = [("draft5", 5), ("single", 2)] if D < 256 else [("draft4", 3)]
    hkv = 1 if G == 8 else 2
    b = make_batch(reqs, H=hkv * G, Hkv=hkv, D=D, seed=G * D)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"G={G} D={D} {variant}")


# ------------------------------------------------------------------------------------ caches

LAYOUT_REQS = [("draft8", 21), ("single", 0), ("star4", 3), ("empty", 2), ("chain3", 16)]


@grid("layout, nodes_in_cache", [(lay, nic) for lay in ("slot", "paged") for nic in (False, True)],
      wgmma_for={("slot", False), ("paged", True)}, ids=lambda v: f"{v[0]}-{'nodes-in-cache' if v[1] else 'k_new'}")
def test_cache_layouts(layout, nodes_in_cache, variant, make_batch, check):
    """Token-slot and paged caches with shuffled slots; the nodes' keys from k_new/v_new or from the last
    n_r slots of each request. The call changes none of its inputs."""
    b = make_batch(LAYOUT_REQS, H=2, Hkv=2, D=64, layout=layout, page_size=16, nodes_in_cache=nodes_in_cache,
                   seed=5)
    before = [t.clone() for t in (*b.args(), b.k_new, b.v_new) if t is not None]
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{layout}/{nodes_in_cache}/{variant}")
    after = [t for t in (*b.args(), b.k_new, b.v_new) if t is not None]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "an input was modified"


@grid("layout, nodes_in_cache", [("slot", False), ("paged", True)], wgmma_for={("paged", True)})
def test_unnamed_slots_are_never_read(layout, nodes_in_cache, variant, make_batch, check):
    """Every cache slot no request names holds NaN: a key block that reaches past a request's kv_indices
    (a padded tail, a neighbour's slots, slot 0 as a stand-in) would turn outputs into NaN."""
    b = make_batch(LAYOUT_REQS, H=2, Hkv=1, D=64, layout=layout, nodes_in_cache=nodes_in_cache, seed=6,
                   unused=float("nan"))
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{layout}/{variant}")


@pytest.mark.parametrize("page_size", [1, 5])
def test_odd_page_sizes(page_size, make_batch, check):
    """Slot s is (page s // page_size, offset s % page_size) for any page size, not only powers of two."""
    b = make_batch([("draft7", 12), ("chain2", 3)], H=2, Hkv=1, D=64, layout="paged", page_size=page_size,
                   nodes_in_cache=True, seed=7)
    out, lse = attend(b)
    check(b, out, lse, msg=f"page_size={page_size}")


@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_strided_caches(layout, make_batch, check):
    """K and V as views into one fused buffer: strides other than the last dim are not those of a
    contiguous cache (the contract allows any strides but a contiguous head dim)."""
    b = make_batch([("draft6", 19), ("single", 4)], H=4, Hkv=2, D=64, layout=layout, fused_kv=True,
                   nodes_in_cache=layout == "paged", seed=8)
    assert not b.k_cache.is_contiguous() and b.k_cache.stride(-1) == 1
    out, lse = attend(b)
    check(b, out, lse, msg=layout)


# ------------------------------------------------------------------------------------ dtypes, scale

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@grid("dtype", [(d,) for d in DTYPES], wgmma_for={(torch.bfloat16,)}, ids=lambda v: DTYPES[v[0]])
def test_dtypes(dtype, variant, make_batch, check):
    b = make_batch([("draft6", 21), ("star3", 0)], H=4, Hkv=2, D=128, dtype=dtype, seed=9)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{dtype}/{variant}")


@grid("dtype", [(d,) for d in DTYPES], wgmma_for={(torch.float16,)}, ids=lambda v: DTYPES[v[0]])
def test_peaked_scores_and_sm_scale(dtype, variant, make_batch, check):
    """Scores with a spread of tens (q scaled by 6, sm_scale 0.4 instead of D**-0.5): one key dominates each
    row, so the running maximum and the split merge must rescale without overflow or underflow to 0/0."""
    b = make_batch([("draft12", 45), ("chain4", 1)], H=2, Hkv=1, D=64, dtype=dtype, seed=10, q_scale=6.0,
                   sm_scale=0.4)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{dtype}/{variant}")


def test_default_call_returns_out_only(make_batch, check):
    """Without out= and return_lse the call returns one tensor, allocated in q's dtype."""
    b = make_batch([("draft5", 6)], H=2, Hkv=1, D=64, seed=12)
    out = tree_attn.tree_attention(*b.args(), **b.new_kw())
    assert isinstance(out, torch.Tensor)
    check(b, out)


def test_registry():
    """The names the contract gives: 64 nodes a request, the variants and where each is the default."""
    assert tree_attn.MAX_NODES == 64
    assert tree_attn.VARIANTS.known == ("wgmma", "mma", "ws", "reference")
    assert tree_attn.VARIANTS.by_arch == {9: "wgmma", 8: "mma"} and tree_attn.VARIANTS.fallback == "reference"


# ------------------------------------------------------------------------------------ plan and run

def test_plan_reused_for_two_inputs(make_batch, check):
    """One plan serves every layer of a step: run() with two different q/k/v sets gives both right answers."""
    b1 = make_batch([("draft9", 23), ("empty", 1), ("chain4", 2)], H=4, Hkv=2, D=64, seed=13)
    b2 = b1.refill(seed=14)
    plan = tree_attn.plan(b1.qo_indptr, b1.kv_indptr, b1.kv_indices, b1.tree_mask, **b1.plan_kw())
    assert isinstance(plan, tree_attn.TreeAttnPlan)
    for b in (b1, b2, b1):
        out, lse = run_plan(plan, b)
        check(b, out, lse)


def test_one_call_plans_once_per_step(make_batch, check, monkeypatch):
    """tree_attention(keep_plan=True) keeps its plan for the next call with the same metadata tensors (the layers of
    one step): the layers run on it and give their own right answers; new tensors, or the same ones written in place,
    plan again; the entry goes with its tensors. Without keep_plan no call plans on the host (the kernels build the
    schedule on the device)."""
    import gc

    from tree_attn import ops

    planned = []
    real = ops.plan
    monkeypatch.setattr(ops, "plan", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    monkeypatch.setattr(ops, "_ONE_CALL", {})
    b1 = make_batch([("draft9", 23), ("empty", 1), ("chain4", 2)], H=4, Hkv=2, D=64, seed=31)
    b2 = b1.refill(seed=32)  # another layer: the same metadata tensors
    for b in (b1, b2, b1):
        check(b, *attend(b, keep_plan=True))
    assert len(planned) == 1
    check(b2, *attend(b2))  # not asked to keep: the device schedule, no host plan
    assert len(planned) == 1
    planned.clear()
    check(b1, *attend(b1, keep_plan=True))  # the kept plan
    assert len(planned) == 0
    # a new step in the same tensors, written in place: planned again, and right for the new slots
    perm = b1.kv_indices[torch.randperm(b1.kv_indices.shape[0], generator=torch.Generator().manual_seed(3))]
    b1.kv_indices.copy_(perm)
    b3 = b1.refill(seed=33)
    check(b3, *attend(b3, keep_plan=True))
    assert len(planned) == 1
    # equal values in new tensors: planned again (the cache matches tensor objects, not their values)
    b4 = b3.refill(seed=34)
    b4.kv_indptr = b3.kv_indptr.clone()
    check(b4, *attend(b4, keep_plan=True))
    assert len(planned) == 2
    # another step's batch in its own tensors: planned again; its entry goes when they do
    b5 = make_batch([("draft9", 23)], H=2, Hkv=2, D=64, seed=35)
    check(b5, *attend(b5, keep_plan=True))
    assert len(planned) == 3
    n = len(ops._ONE_CALL)
    del b5
    gc.collect()
    assert len(ops._ONE_CALL) == n - 1  # dropped with its tensors


def test_plan_nodes_in_cache_and_variant(make_batch, check):
    """A plan for nodes in the cache, pinned to one variant, run on a paged cache."""
    b = make_batch([("draft8", 9), ("single", 30)], H=2, Hkv=1, D=64, layout="paged", nodes_in_cache=True,
                   seed=15)
    for variant in TRITON:
        plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant=variant))
        out, lse = run_plan(plan, b)
        check(b, out, lse, msg=variant)


def test_split_items_store_the_rows_of_their_nodes_only(make_batch, check):
    """A split item stores the partial output and LSE of its nodes' rows (nodes x G) and of no padding row of its
    tile: the merge reads no other row, and at one token per request a tile is mostly padding. The plan's scratch
    starts as NaN; afterwards every padding row still holds it and every used item's node rows are numbers."""
    b = make_batch([("single", 40), ("chain2", 23)], H=6, Hkv=2, D=64, seed=16)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="mma"))
    plan.po.fill_(float("nan"))
    plan.plse.fill_(float("nan"))
    out, lse = run_plan(plan, b)
    check(b, out, lse)
    rows = [n * 3 for n in (1, 2)]  # G = 3; each request fits one row block
    bm = plan.po.shape[2]
    assert max(rows) < bm, "the case needs padding rows in every tile"
    used = plan.items[:plan.num_items].tolist()
    assert {it[0] for it in used} == {0, 1}, f"both requests run split items: {used}"
    for i, it in enumerate(used):
        r = rows[it[0]]
        assert torch.isnan(plan.po[i, :, r:]).all() and torch.isnan(plan.plse[i, :, r:]).all(), \
            f"item {i} {it} wrote a padding row"
        assert torch.isfinite(plan.plse[i, :, :r]).all() and torch.isfinite(plan.po[i, :, :r]).all(), \
            f"item {i} {it} left a node row unwritten"
    for i in range(plan.num_items, plan.po.shape[0]):
        assert torch.isnan(plan.po[i]).all(), f"unused item {i} was written"


@pytest.mark.parametrize("parts,warps", [(64, 8), (8, 1)])
def test_merge_shapes_over_many_partials(parts, warps, make_batch, check):
    """One-token requests over long prefixes split into many partials per row; the merge loads them `parts` at a
    time (more than a request has, and fewer) in `warps` warps. The few-node heuristic takes 64 in 8."""
    import autotune
    from tree_attn.configs import FEW_NODES, SplitConfig, _heuristic

    h = _heuristic("wgmma", 256, 9, False, nodes=1)
    assert (h.merge_parts, h.merge_warps) == (64, 8)
    assert _heuristic("wgmma", 256, 9, False, nodes=FEW_NODES + 1).merge_parts == SplitConfig().merge_parts
    b = make_batch([("single", 300), ("single", 71), ("chain2", 5)], H=4, Hkv=2, D=64, seed=17)
    cfg = SplitConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, programs_per_sm=8.0, merge_warps=warps,
                      merge_parts=parts)
    with autotune.force("tree_attn.tree_attention", config=cfg):
        plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="wgmma"))
    assert plan.dispatch.config == cfg
    splits = int(plan.req_table.view(-1, 3)[0, 1])
    assert splits > 8, f"the first request's prefix needs more than 8 partials a row, got {splits}"
    out, lse = run_plan(plan, b)
    check(b, out, lse, msg=f"{parts} partials, {warps} warps")


STEP1 = [("draft9", 5), ("chain3", 0), ("single", 12), ("star8", 2)]  # T = 21, 19 prefix slots
NEXT_STEPS = {
    # other trees of the same node counts, the same prefix lengths, other slots
    "same-sizes": [("rand9", 5), ("star3", 0), ("single", 12), ("draft8", 2)],
    # the same T and B, other prefix lengths (48 + 30 slots instead of 19)
    "longer-prefixes": [("star9", 40), ("rand3", 7), ("single", 1), ("chain8", 30)],
    # the same T, B and prefix total, but an 18-node tree where step 1's largest had 9 nodes
    "larger-tree": [("draft18", 5), ("single", 0), ("single", 12), ("single", 2)],
}


@pytest.mark.parametrize("step", list(NEXT_STEPS))
def test_plan_update_for_a_new_step(step, make_batch, check):
    """update() refills a plan built with spare room (work items, kv_indices buffer, tree block) for the next
    step of the same total_nodes and batch; padded work items of the fixed-size schedule do nothing."""
    step1 = make_batch(STEP1, H=2, Hkv=1, D=64, seed=16, cache_slots=101)
    step2 = make_batch(NEXT_STEPS[step], H=2, Hkv=1, D=64, seed=17, cache_slots=101)
    assert (step1.T, len(step1.nodes)) == (step2.T, len(step2.nodes))
    plan = tree_attn.plan(step1.qo_indptr, step1.kv_indptr, step1.kv_indices, step1.tree_mask,
                          **step1.plan_kw(capacity=64, kv_capacity=101, max_nodes=64))
    out, lse = run_plan(plan, step1)
    check(step1, out, lse, msg="step 1")
    plan.update(step2.qo_indptr, step2.kv_indptr, step2.kv_indices, step2.tree_mask)
    out, lse = run_plan(plan, step2)
    check(step2, out, lse, msg="step 2")


@pytest.mark.parametrize("step", ["longer-prefixes", "larger-tree"])
def test_plan_update_refuses_what_its_buffers_cannot_hold(step, make_batch, raises):
    """A plan sized for its own step refuses a next step with more kv_indices or a larger tree, saying
    which plan() argument makes room (a CUDA graph captured on the plan cannot follow reallocated buffers)."""
    step1 = make_batch(STEP1, H=2, Hkv=1, D=64, seed=16, cache_slots=101)
    step2 = make_batch(NEXT_STEPS[step], H=2, Hkv=1, D=64, seed=17, cache_slots=101)
    plan = tree_attn.plan(step1.qo_indptr, step1.kv_indptr, step1.kv_indices, step1.tree_mask,
                          **step1.plan_kw(capacity=64))
    with raises("update", "kv_capacity" if step == "longer-prefixes" else "max_nodes"):
        plan.update(step2.qo_indptr, step2.kv_indptr, step2.kv_indices, step2.tree_mask)


def test_plan_without_validation_runs_the_same(make_batch):
    """validate=False skips the checks, not the schedule: the same bits as a validated plan."""
    b = make_batch([("draft7", 10), ("single", 3)], H=2, Hkv=1, D=64, seed=18)
    a = run_plan(tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw()), b)
    c = run_plan(tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(validate=False)),
                 b)
    assert_bitwise_equal(a[0], c[0])
    assert_bitwise_equal(a[1], c[1])


def test_gdn_tree_plan_drives_tree_attn(make_batch, check):
    """One topology for both halves of a hybrid model: gdn.TreePlan.anc is the tree mask and its
    cu_seqlens the qo_indptr."""
    import gdn

    rng = random.Random(19)
    parents = [[-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, 12)], list(range(-1, 3)), [-1]]
    tp = gdn.build_tree_plan(parents)
    b = make_batch(list(zip(parents, [9, 0, 20])), H=4, Hkv=2, D=64, seed=19)
    assert torch.equal(tp.anc, b.tree_mask) and torch.equal(tp.cu_seqlens, b.qo_indptr)
    out = b.poisoned_out()
    got, lse = tree_attn.tree_attention(b.q, b.k_cache, b.v_cache, b.kv_indptr, b.kv_indices, tp.cu_seqlens, tp.anc,
                                        **b.new_kw(), out=out, return_lse=True)
    check(b, got, lse)
