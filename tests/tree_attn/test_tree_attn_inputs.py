"""Bad input to tree_attn is refused before any kernel runs, with an error in the house style
"tree_attn.<fn>: <what is wrong>; <how to fix>" that names the argument at fault.

Each case corrupts one thing of a valid three-request batch (rand5 over 3 prefix keys, chain3 over 2,
a single node over 1: T = 9, qo_indptr [0, 5, 8, 9]). Checks of the schedule's inputs (masks, indptrs,
slot indices) are asked of plan, of tree_attention with keep_plan (a host plan) and of the default
tree_attention, whose kernels check the values on the device: its call writes NaN and
tree_attn.check_metadata raises the same kind of error afterwards (dtypes, ranks and lengths are still
refused at the call). Checks of tensors of tree_attention and run.
"""

import pytest
import torch

import tree_attn

BASE = [("rand5", 3), ("chain3", 2), ("single", 1)]
H, HKV, D = 4, 2, 64


def fields(b):
    return dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, kv_indptr=b.kv_indptr, kv_indices=b.kv_indices,
                qo_indptr=b.qo_indptr, tree_mask=b.tree_mask, k_new=b.k_new, v_new=b.v_new, out=None, variant=None)


def cache_slots(k_cache):
    return k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)


def call(entry, f, **plan_kw):
    if entry.startswith("tree_attention"):
        return tree_attn.tree_attention(f["q"], f["k_cache"], f["v_cache"], f["kv_indptr"], f["kv_indices"],
                                        f["qo_indptr"], f["tree_mask"], k_new=f["k_new"], v_new=f["v_new"],
                                        out=f["out"], variant=f["variant"], keep_plan=entry == "tree_attention-kept")
    kw = dict(num_qo_heads=f["q"].shape[1], num_kv_heads=f["k_cache"].shape[-2], head_dim=f["q"].shape[-1],
              cache_slots=cache_slots(f["k_cache"]), nodes_in_cache=f["k_new"] is None, dtype=f["q"].dtype)
    kw.update(plan_kw)
    return tree_attn.plan(f["qo_indptr"], f["kv_indptr"], f["kv_indices"], f["tree_mask"], **kw)


def with_mask(f, row, fn):
    m = f["tree_mask"].clone()
    m[row] = fn(int(m[row]))
    f["tree_mask"] = m


def to_signed(x):
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def recast(f, dtype, *names):
    for n in names:
        if f[n] is not None:
            f[n] = f[n].to(dtype)


def resize_d(f, d):
    for n in ("q", "k_cache", "v_cache", "k_new", "v_new"):
        t = f[n]
        f[n] = torch.randn(*t.shape[:-1], d).to(t.dtype)


# name: (corruption, regexes the message must match); the schedule's inputs, asked of tree_attention and plan
SCHEDULE_CASES = {
    # rows 5..7 are chain3 (request 1), row 8 the single node (request 2)
    "mask-bit-outside-request": (lambda f: with_mask(f, 7, lambda m: m | 1 << 3), [r"tree_mask"]),
    "mask-sign-bit-of-small-request": (lambda f: with_mask(f, 8, lambda m: to_signed(m | 1 << 63)), [r"tree_mask"]),
    "mask-without-own-bit": (lambda f: with_mask(f, 6, lambda m: m & ~(1 << 1)), [r"tree_mask"]),
    "mask-zero": (lambda f: with_mask(f, 8, lambda m: 0), [r"tree_mask"]),
    # node 2 of the chain sees node 1 but not node 1's ancestor 0
    "mask-not-ancestor-closed": (lambda f: with_mask(f, 7, lambda m: 0b110), [r"tree_mask"]),
    "qo-not-monotone": (lambda f: f.update(qo_indptr=i32([0, 8, 5, 9])), [r"qo_indptr"]),
    "qo-not-from-zero": (lambda f: f.update(qo_indptr=i32([1, 5, 8, 9])), [r"qo_indptr"]),
    "qo-last-not-T": (lambda f: f.update(qo_indptr=i32([0, 5, 8, 10])), [r"qo_indptr"]),
    "kv-not-monotone": (lambda f: f.update(kv_indptr=i32([0, 5, 3, 6])), [r"kv_indptr"]),
    "kv-not-from-zero": (lambda f: f.update(kv_indptr=i32([1, 3, 5, 6])), [r"kv_indptr"]),
    "kv-last-not-len-indices": (lambda f: f.update(kv_indices=f["kv_indices"][:-1]), [r"kv_ind(ptr|ices)"]),
    "indptr-lengths-differ": (lambda f: f.update(kv_indptr=i32([0, 3, 5, 6, 6])), [r"qo_indptr|kv_indptr"]),
    "qo-indptr-int64": (lambda f: recast(f, torch.int64, "qo_indptr"), [r"qo_indptr"]),
    "kv-indptr-int64": (lambda f: recast(f, torch.int64, "kv_indptr"), [r"kv_indptr"]),
    "kv-indices-int64": (lambda f: recast(f, torch.int64, "kv_indices"), [r"kv_indices"]),
    "mask-int32": (lambda f: recast(f, torch.int32, "tree_mask"), [r"tree_mask"]),
    "qo-indptr-2d": (lambda f: f.update(qo_indptr=f["qo_indptr"][None]), [r"qo_indptr"]),
}


# refused by the default tree_attention at the call (no value of the metadata is read there)
AT_THE_CALL = ("indptr-lengths-differ", "qo-indptr-int64", "kv-indptr-int64", "kv-indices-int64", "mask-int32",
               "qo-indptr-2d")
ENTRIES = ["tree_attention", "tree_attention-kept", "plan"]


def refused(entry, f, patterns, raises, case=""):
    """The call is refused: raised by the call (plan, the kept one-call path, shape faults), or, for the device
    checks of the default tree_attention, NaN in its output and the error raised once by check_metadata."""
    if entry != "tree_attention" or case in AT_THE_CALL:
        with raises(*patterns):
            call(entry, f)
        return
    tree_attn.check_metadata(f["q"].device)  # nothing recorded before
    out = call(entry, f)
    assert torch.isnan(out.float()).any(), "a refused call must not look like a valid one"
    with raises(*patterns):
        tree_attn.check_metadata(f["q"].device)
    tree_attn.check_metadata(f["q"].device)  # raised once, then cleared


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_schedule_inputs_rejected(case, entry, make_batch, raises):
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=1)
    f = fields(b)
    corrupt, patterns = SCHEDULE_CASES[case]
    corrupt(f)
    refused(entry, f, patterns, raises, case)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("slot", ["past-end", "negative", "huge"])
@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_kv_indices_outside_the_cache(layout, slot, entry, make_batch, raises):
    """A slot outside [0, cache_slots) (pages * page_size for the paged layout) is caught on the plan step, or
    by the default tree_attention's kernels before they read any key (run() with a plan trusts it)."""
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, layout=layout, page_size=4, seed=2)
    f = fields(b)
    idx = f["kv_indices"].clone()
    idx[4] = {"past-end": b.cache_slots, "negative": -1, "huge": 2**31 - 1}[slot]
    f["kv_indices"] = idx
    refused(entry, f, [r"kv_indices"], raises)


@pytest.mark.parametrize("entry", ENTRIES)
def test_more_than_64_nodes(entry, make_batch, raises):
    """65 nodes in one request: one int64 mask per node cannot name them (tree_attn.MAX_NODES = 64)."""
    b = make_batch([("chain64", 2), ("single", 1)], H=H, Hkv=HKV, D=D, seed=3)
    f = fields(b)
    f["qo_indptr"] = i32([0, 65, 65])  # the single node joins request 0 as its 65th node
    refused(entry, f, [r"64"], raises)


@pytest.mark.parametrize("entry", ENTRIES)
def test_nodes_in_cache_with_too_few_slots(entry, make_batch, raises):
    """With nodes in the cache the last n_r entries of a request are its nodes: a request of 3 nodes with
    2 entries has no slots for them."""
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, nodes_in_cache=True, seed=4)
    assert b.kv_indptr.tolist() == [0, 8, 13, 15]
    f = fields(b)
    f["kv_indptr"] = i32([0, 8, 10, 15])
    refused(entry, f, [r"kv_indptr|kv_indices|nodes_in_cache|k_new"], raises)


def test_capacity_too_small(make_batch, raises):
    """Three requests with nodes need at least three work items: a one-item capacity cannot hold them."""
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=5)
    with raises(r"capacity"):
        call("plan", fields(b), capacity=1)


# name: (corruption, regexes): tensors that only tree_attention (and run) see
TENSOR_CASES = {
    "H-not-multiple-of-Hkv": (lambda f: f.update(q=f["q"][:, :3].contiguous()), [r"head"]),
    "v-cache-other-heads": (lambda f: f.update(v_cache=f["v_cache"][:, :1].contiguous()), [r"v_cache|head"]),
    "k-cache-other-head-dim": (lambda f: f.update(k_cache=torch.randn(*f["k_cache"].shape[:-1], 128).bfloat16()),
                               [r"k_cache|head[_ ]dim|\bD\b"]),
    "q-other-head-dim": (lambda f: f.update(q=torch.randn(9, H, 128).bfloat16()), [r"\bq\b|head[_ ]dim|\bD\b"]),
    "head-dim-96": (lambda f: resize_d(f, 96), [r"256"]),
    "head-dim-32": (lambda f: resize_d(f, 32), [r"256"]),
    "q-2d": (lambda f: f.update(q=f["q"].flatten(1)), [r"\bq\b"]),
    "q-fewer-rows-than-qo": (lambda f: f.update(q=f["q"][:8], k_new=f["k_new"][:8], v_new=f["v_new"][:8]),
                             [r"\bq\b|qo_indptr|\bT\b"]),
    "cache-5d": (lambda f: f.update(k_cache=f["k_cache"][None, None], v_cache=f["v_cache"][None, None]),
                              [r"k_cache"]),
    "head-dim-not-contiguous": (lambda f: f.update(k_cache=f["k_cache"].transpose(-1, -2).contiguous()
                                                   .transpose(-1, -2)), [r"k_cache"]),
    "fp32": (lambda f: recast(f, torch.float32, "q", "k_cache", "v_cache", "k_new", "v_new"), [r"float32"]),
    "q-bf16-cache-fp16": (lambda f: recast(f, torch.float16, "k_cache", "v_cache"), [r"float16"]),
    "k-new-fp16": (lambda f: recast(f, torch.float16, "k_new", "v_new"), [r"k_new|float16"]),
    "k-new-without-v-new": (lambda f: f.update(v_new=None), [r"k_new|v_new"]),
    "v-new-without-k-new": (lambda f: f.update(k_new=None), [r"k_new|v_new"]),
    "k-new-fewer-rows": (lambda f: f.update(k_new=f["k_new"][:-1], v_new=f["v_new"][:-1]), [r"k_new"]),
    "k-new-other-heads": (lambda f: f.update(k_new=f["k_new"][:, :1], v_new=f["v_new"][:, :1]), [r"k_new"]),
    "out-wrong-shape": (lambda f: f.update(out=torch.zeros(9, H, D + 1, dtype=torch.bfloat16)), [r"\bout\b"]),
    "out-wrong-dtype": (lambda f: f.update(out=torch.zeros(9, H, D, dtype=torch.float32)), [r"\bout\b"]),
    "out-wrong-rows": (lambda f: f.update(out=torch.zeros(8, H, D, dtype=torch.bfloat16)), [r"\bout\b"]),
    "unknown-variant": (lambda f: f.update(variant="flash"), [r"variant"]),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_tensor_inputs_rejected(case, make_batch, raises):
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=6)
    f = fields(b)
    corrupt, patterns = TENSOR_CASES[case]
    corrupt(f)
    with raises(*patterns):
        call("tree_attention", f)


@pytest.mark.parametrize("plan_kw, patterns", [
    pytest.param(dict(num_qo_heads=3), [r"head"], id="H-not-multiple-of-Hkv"),
    pytest.param(dict(head_dim=96), [r"256"], id="head-dim-96"),
    pytest.param(dict(dtype=torch.float32), [r"float32"], id="fp32"),
    pytest.param(dict(cache_slots=0), [r"cache_slots|kv_indices"], id="zero-cache-slots"),
])
def test_plan_arguments_rejected(plan_kw, patterns, make_batch, raises):
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=7)
    with raises(*patterns):
        call("plan", fields(b), **plan_kw)


def _plan(b, **kw):
    return tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(**kw))


RUN_CASES = {
    # run() trusts the plan's indices but checks its tensors against what the plan was built for
    "q-other-T": (lambda b: dict(q=b.q[:8]), [r"\bq\b|plan|\bT\b"]),
    "q-other-heads": (lambda b: dict(q=b.q[:, :2].contiguous()), [r"\bq\b|plan|head"]),
    "q-other-dtype": (lambda b: dict(q=b.q.half(), k_cache=b.k_cache.half(), v_cache=b.v_cache.half(),
                                     k_new=b.k_new.half(), v_new=b.v_new.half()), [r"float16|bfloat16|dtype"]),
    "cache-smaller-than-planned": (lambda b: dict(k_cache=b.k_cache[:2], v_cache=b.v_cache[:2]),
                                   [r"cache|slots"]),
    "nodes-given-to-nodes-in-cache-plan": (lambda b: dict(k_new=torch.randn(b.T, HKV, D).bfloat16(),
                                                          v_new=torch.randn(b.T, HKV, D).bfloat16()),
                                           [r"k_new|nodes_in_cache"]),
    "nodes-missing-for-k-new-plan": (lambda b: dict(k_new=None, v_new=None), [r"k_new|nodes_in_cache"]),
    "out-wrong-dtype": (lambda b: dict(out=torch.zeros(b.T, H, D)), [r"\bout\b"]),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_run_checks_tensors_against_the_plan(case, make_batch, raises):
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, nodes_in_cache=case.startswith("nodes-given"), seed=8)
    make, patterns = RUN_CASES[case]
    plan = _plan(b)
    kw = make(b)
    args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, k_new=b.k_new, v_new=b.v_new)
    args.update(kw)
    with raises(*patterns):
        tree_attn.run(plan, args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_update_with_other_node_count(make_batch, raises):
    """update() is for the next step of the same sizes (fixed buffers, a captured graph): another T is refused."""
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=9)
    other = make_batch([("rand6", 3), ("chain3", 2), ("single", 1)], H=H, Hkv=HKV, D=D, seed=9)
    plan = _plan(b, capacity=64)
    with raises(r"\bT\b|nodes|total"):
        plan.update(other.qo_indptr, other.kv_indptr, other.kv_indices, other.tree_mask)


@pytest.mark.parametrize("fault", ["kv_indices", "tree_mask"])
def test_update_validates_like_plan(fault, make_batch, raises):
    """A plan built with validation checks every step it is updated for: run() trusts the plan, so a slot
    outside the cache let through here would be read out of bounds on the device."""
    b = make_batch(BASE, H=H, Hkv=HKV, D=D, seed=10)
    plan = _plan(b, capacity=64)
    idx, mask = b.kv_indices.clone(), b.tree_mask.clone()
    if fault == "kv_indices":
        idx[2] = b.cache_slots
    else:
        mask[7] = 0b110
    with raises(fault):
        plan.update(b.qo_indptr, b.kv_indptr, idx, mask)


def test_update_beyond_capacity(make_batch, raises):
    """The plan's buffers are fixed: a step whose schedule needs more work items than the capacity the plan was
    built with (here: the same trees with prefixes where step 1 had none, so at least one prefix item more per
    row block) is refused, never written past the buffers."""
    step1 = make_batch([("draft20", 0), ("single", 0)], H=2, Hkv=1, D=64, seed=11, cache_slots=200)
    step2 = make_batch([("draft20", 90), ("single", 90)], H=2, Hkv=1, D=64, seed=12, cache_slots=200)
    plan = _plan(step1)  # default capacity: what step 1 needs
    with raises(r"capacity"):
        plan.update(step2.qo_indptr, step2.kv_indptr, step2.kv_indices, step2.tree_mask)
