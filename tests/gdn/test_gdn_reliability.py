"""Reliability of the gdn ops on the CPU (issue 17): index guards, dtype/device checks, NaN containment, CPU paths.

* Host indices (lists, CPU tensors) are checked before any launch: each bad call raises a "gdn.<fn>: ...; fix"
  message and leaves every state untouched.
* Device guards: the kernels (under the Triton interpreter) are called through the registered ops, which hold no
  host checks, with indices out of range: the request is skipped (outputs and states not written), the other
  requests are right, and gdn.check_errors(plan) raises GuardError once and clears the word.
* A NaN/Inf in one node's inputs leaves every non-descendant node's output bitwise as without it.
* Every op runs on CPU tensors without the interpreter (the torch reference).
"""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import gdn
from autotune import force
from gdn import guard
from gdn.configs import WYConfig
from gdn.reference import commit_reference, conv_reference, root_path, tree_reference

H, HV, K, V = 2, 4, 16, 32
TREE = [-1, 0, 0, 1, 1, 2, 3]  # node 6 is a leaf under 3 under 1; 4, 5 leaves; subtree of 1 = {1, 3, 4, 6}


def descendants(par, x):
    return [i for i in range(len(par)) if x in root_path(par, i)]


def make_inputs(T, pool=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.5
    beta = torch.rand(T, HV, generator=gen)
    state = torch.randn(pool, HV, K, V, generator=gen) * 0.3
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [state]


def acc_tensors(paths, max_len=None):
    max_len = max_len or max(1, max(len(p) for p in paths))
    acc = torch.zeros(len(paths), max_len, dtype=torch.int32)
    for r, p in enumerate(paths):
        acc[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return acc, torch.tensor([len(p) for p in paths], dtype=torch.int32)


def commit_args(trees, L=1, pool_rows=3, D=8, W=4, seed=0):
    plan = gdn.build_tree_plan(trees)
    T = plan.total_nodes
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(L, T, H, K, generator=gen)
    v = torch.randn(L, T, HV, V, generator=gen)
    g = -torch.rand(L, T, HV, generator=gen)
    beta = torch.rand(L, T, HV, generator=gen)
    x = torch.randn(L, T, D, generator=gen)
    pool = torch.randn(L, pool_rows, HV, K, V, generator=gen)
    cs = torch.randn(L, pool_rows, D, W - 1, generator=gen)
    return plan, pool, cs, k, v, g, beta, x


# ------------------------------------------------------------------- reproduced bugs: host indices


def test_commit_state_index_far_outside_the_pool_raises():
    """Was a segfault (exit 139): gdn.commit(pool, None, torch.tensor([100000, 0]), plan, ...)."""
    plan, pool, cs, k, v, g, beta, x = commit_args([[-1, 0], [-1]])
    acc, n = acc_tensors([[0, 1], [0]])
    before = pool.clone()
    for bad in ([100000, 0], [9, 0], [0, -1]):
        with pytest.raises(ValueError, match=r"gdn\.commit: state_indices\[\d\] = -?\d+ is outside the pool's rows"):
            gdn.commit(pool, None, torch.tensor(bad), plan, acc, n, k, v, g, beta)
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="conv_state_indices"):
        gdn.commit(None, cs, torch.tensor([0, 1]), plan, acc, n, x=x, conv_state_indices=[0, 3])
    with pytest.raises(ValueError, match="names a pool row twice"):
        gdn.commit(pool, None, [1, 1], plan, acc, n, k, v, g, beta)


@pytest.mark.parametrize("path, n_acc, match", [
    ([0, 5], None, "accepted node 5 outside"),  # was: 1,024 NaN written into the pool
    ([1], None, "root path"),  # non-root start, was committed silently
    ([0, 2], None, "root path"),  # 2 is not a child of 0... in [-1, 0, 1]
    ([0, 1], 3, "accepted_len 3 outside"),  # accepted_len > max_len, was committed silently
    ([0, 1], -1, "accepted_len -1 outside"),
], ids=["node-outside", "non-root", "not-a-path", "len-over", "len-negative"])
def test_commit_validates_the_accepted_path_by_default(path, n_acc, match):
    plan, pool, cs, k, v, g, beta, x = commit_args([[-1, 0, 1]])
    acc, n = acc_tensors([path], max_len=2)
    if n_acc is not None:
        n[0] = n_acc
    before, cbefore = pool.clone(), cs.clone()
    with pytest.raises(ValueError, match=match):
        gdn.commit(pool, cs, [0], plan, acc, n, k, v, g, beta, x)
    assert torch.equal(pool, before) and torch.equal(cs, cbefore)


@pytest.mark.parametrize("variant", [None, "wy", "recurrent", "reference"])
def test_verify_state_index_outside_the_pool_raises(variant):
    """Was: -1 read the last pool row (default path) or returned NaN (Triton path)."""
    plan = gdn.build_tree_plan([TREE])
    q, k, v, g, beta, pool = make_inputs(7, pool=3)
    for bad in (-1, 3, 2**40):
        with pytest.raises(ValueError, match=r"gdn\.tree_verify: state_indices\[0\] = -?\d+ is outside"):
            gdn.tree_verify(q, k, v, g, beta, pool, torch.tensor([bad]), plan, variant=variant)


@pytest.mark.parametrize("bad", [7, -1])
def test_conv_state_index_outside_raises(bad):
    """Was: values up to 5.7e37."""
    plan = gdn.build_tree_plan([TREE, [-1]])
    x, cs, w = torch.randn(8, 8), torch.randn(2, 8, 3), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"gdn\.tree_conv1d: conv_state_indices\[1\] = -?\d+ is outside"):
        gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=torch.tensor([0, bad]))


# ------------------------------------------------------------------- device guards (kernels, no host checks)


def _raw_verify(plan, q, k, v, g, beta, pool, idx, out, variant):
    torch.ops.specpilot_gdn.tree_verify(q, k, v, g, beta, out, pool, idx, plan.cu_seqlens, plan.anc, plan.depth,
                                        plan.max_depth, plan.node_req, plan.sync, plan.err, K ** -0.5, True, False,
                                        variant, plan.max_nodes)


WY_CONFIGS = {
    "default": None,
    "square": WYConfig(BV=16, inverse="square"),
    "split": WYConfig(BV=16, inverse="split"),
    "split-flag": WYConfig(BV=16, inverse="split", handoff="flag"),
    "trans": WYConfig(BV=16, inverse="levels", trans=True),
    "stack": WYConfig(BV=16, inverse="split", stack=True, inverse_stack=True),
}


def _wy_force(name):
    cfg = WY_CONFIGS[name]
    return force("gdn.tree_verify", config=cfg) if cfg is not None else contextlib.nullcontext()


@pytest.mark.parametrize("variant", ["wy:default", "wy:split", "wy:split-flag", "wy:trans", "recurrent", "reference"])
def test_verify_device_guard_skips_the_request_and_flags(variant):
    variant, _, cfg = variant.partition(":")
    trees = [TREE, [-1, 0], [-1, 0, 0]]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(plan.total_nodes, pool=3, dtype=torch.bfloat16)
    pool = pool.float()
    good = torch.tensor([2, 0, 1], dtype=torch.int32)
    want = torch.full_like(v, 7.0)
    with _wy_force(cfg or "default"):
        _raw_verify(plan, q, k, v, g, beta, pool, good, want, variant)
        gdn.check_errors(plan)  # nothing raised
        for bad in (-1, 3, 100000):
            out = torch.full_like(v, 7.0)
            idx = good.clone()
            idx[1] = bad
            _raw_verify(plan, q, k, v, g, beta, pool, idx, out, variant)
            assert torch.equal(out[7:9], torch.full_like(out[7:9], 7.0)), "the skipped request was written"
            assert torch.equal(out[:7], want[:7]) and torch.equal(out[9:], want[9:])
            assert plan.err.item() == guard.VERIFY_STATE_INDEX
            with pytest.raises(gdn.GuardError, match="gdn.tree_verify: a state index is outside"):
                gdn.check_errors(plan)
            assert plan.err.item() == 0
    # a second plan's word is its own
    gdn.check_errors(gdn.build_tree_plan(trees))


def test_sync_flags_stay_clear_after_a_skipped_request():
    """handoff='flag': the consumers of a skipped request still take their flag back (the next call is right)."""
    trees = [TREE, [-1, 0]]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(plan.total_nodes, pool=2, dtype=torch.bfloat16)
    pool = pool.float()
    with _wy_force("split-flag"):
        _raw_verify(plan, q, k, v, g, beta, pool, torch.tensor([0, 5], dtype=torch.int32), torch.empty_like(v), "wy")
        assert int(plan.sync.abs().sum()) == 0
        with pytest.raises(gdn.GuardError):
            gdn.check_errors(plan)


def test_positive_gate_is_flagged_on_the_device_and_rejected_on_the_host():
    plan = gdn.build_tree_plan([TREE])
    q, k, v, g, beta, pool = make_inputs(7)
    g[4, 1] = 0.3
    with pytest.raises(ValueError, match=r"gdn\.tree_verify: g has positive entries .* g <= 0"):
        gdn.tree_verify(q, k, v, g, beta, pool, [0], plan)
    for variant in ("wy", "recurrent", "reference"):
        _raw_verify(plan, q, k, v, g, beta, pool, torch.tensor([0]), torch.empty_like(v), variant)
        with pytest.raises(gdn.GuardError, match="g > 0"):
            gdn.check_errors(plan)


@pytest.mark.parametrize("variant", ["triton", "reference"])
def test_conv_device_guard(variant):
    plan = gdn.build_tree_plan([TREE, [-1, 0]])
    x, cs, w = torch.randn(9, 8), torch.randn(2, 8, 3), torch.randn(8, 4)
    ok = torch.empty_like(x)
    torch.ops.specpilot_gdn.tree_conv1d(x, w, None, ok, cs, torch.tensor([1, 0]), plan.node_req, plan.parent,
                                        plan.depth, plan.err, True, variant)
    for bad in (7, -1):
        out = torch.full_like(x, 7.0)
        torch.ops.specpilot_gdn.tree_conv1d(x, w, None, out, cs, torch.tensor([1, bad]), plan.node_req, plan.parent,
                                            plan.depth, plan.err, True, variant)
        assert torch.equal(out[:7], ok[:7]) and torch.equal(out[7:], torch.full_like(out[7:], 7.0))
        with pytest.raises(gdn.GuardError, match="gdn.tree_conv1d: a conv state index"):
            gdn.check_errors(plan)


def _raw_commit(plan, pool, cs, idx, acc, n, k, v, g, beta, x, cidx=None, variant="triton"):
    torch.ops.specpilot_gdn.commit(pool, k, v, g, beta, idx, plan.cu_seqlens, acc.contiguous(), n, plan.parent_local,
                                   plan.err, True, False, cs, x, idx if cidx is None else cidx, variant)


@pytest.mark.parametrize("variant", ["triton", "reference"])
@pytest.mark.parametrize("case", ["index", "conv-index", "node", "path", "non-root", "len-over", "len-negative"])
def test_commit_device_guard_skips_the_request_and_flags(case, variant, corrupt_commit):
    trees = [[-1, 0, 1], [-1, 0, 0], [-1, 0]]
    plan, pool, cs, k, v, g, beta, x = commit_args(trees, L=2, pool_rows=4)
    paths = [[0, 1, 2], [0, 2], [0]]
    acc, n = acc_tensors(paths, max_len=3)
    idx = torch.tensor([3, 0, 2], dtype=torch.int32)
    cidx = idx.clone()
    bit = {"index": 4, "conv-index": 4, "node": 8, "path": 16, "non-root": 16, "len-over": 32, "len-negative": 32}
    corrupt_commit(case, idx, cidx, acc, n)
    p0, c0 = pool.clone(), cs.clone()
    _raw_commit(plan, pool, cs, idx, acc, n, k, v, g, beta, x, cidx, variant)
    with pytest.raises(gdn.GuardError, match="gdn.commit") as e:
        gdn.check_errors(plan)
    assert e.value.bits == bit[case]
    # request 1 skipped: every row but the good requests' is untouched
    for r, row in ((0, 3), (2, 2)):
        bos = plan.cu_seqlens[r].item()
        for li in range(2):
            S, C = commit_reference(p0[li, row], c0[li, row], k[li], v[li], g[li], beta[li], x[li],
                                    [bos + j for j in paths[r]], use_qk_l2norm=True)
            torch.testing.assert_close(pool[li, row], S, rtol=1e-5, atol=1e-5)
            assert torch.equal(cs[li, row], C)
    # the state and the conv kernel each guard their own row; a bad path skips both
    assert torch.equal(pool[:, 1], p0[:, 1]) and torch.equal(cs[:, 1], c0[:, 1])
    assert case == "index" or torch.equal(cs[:, 0], c0[:, 0])
    assert case == "conv-index" or torch.equal(pool[:, 0], p0[:, 0])
    plan.err.zero_()
    _raw_commit(plan, p0.clone(), c0.clone(), torch.tensor([3, 0, 2]), *acc_tensors(paths, max_len=3), k, v, g,
                beta, x, variant=variant)
    gdn.check_errors(plan)  # the valid call raises nothing


def test_check_errors_names_every_bit_and_clears():
    plan = gdn.build_tree_plan([[-1]])
    plan.err.fill_(guard.ACCEPTED_NODE | guard.CONV_STATE_INDEX)
    with pytest.raises(gdn.GuardError) as e:
        gdn.check_errors(plan)
    assert e.value.bits == 10 and "accepted node" in str(e.value) and "conv state index" in str(e.value)
    gdn.check_errors(plan)


# ------------------------------------------------------------------- dtypes, devices, plans


def test_verify_rejects_bad_dtypes_with_a_fix():
    plan = gdn.build_tree_plan([TREE])
    q, k, v, g, beta, pool = make_inputs(7)
    idx = torch.tensor([0])
    cases = [
        (dict(q=q.to(torch.int64)), r"gdn\.tree_verify: q has dtype torch.int64; pass float32, bfloat16 or float16"),
        (dict(g=g.to(torch.int64)), r"gdn\.tree_verify: g has dtype torch.int64"),
        (dict(k=k.double()), r"gdn\.tree_verify: k has dtype torch.float64; .*dtype=torch.float64"),
        (dict(beta=beta.bool()), r"beta has dtype torch.bool"),
    ]
    for change, match in cases:
        args = dict(q=q, k=k, v=v, g=g, beta=beta)
        args.update(change)
        with pytest.raises(TypeError, match=match):
            gdn.tree_verify(state_pool=pool, state_indices=idx, tree=plan, **args)
    with pytest.raises(TypeError, match=r"gdn\.tree_verify: state_indices has dtype torch.float32"):
        gdn.tree_verify(q, k, v, g, beta, pool, torch.tensor([0.0]), plan)
    with pytest.raises(TypeError, match="state_indices must hold integers"):
        gdn.tree_verify(q, k, v, g, beta, pool, [0.5], plan)
    with pytest.raises(ValueError, match=r"gdn\.tree_verify: out must match v"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, out=torch.empty(7, HV, V, dtype=torch.bfloat16))


def test_device_mismatch_says_how_to_fix():
    plan = gdn.build_tree_plan([TREE])
    q, k, v, g, beta, pool = make_inputs(7)
    with pytest.raises(ValueError, match=r"gdn\.tree_verify: all tensors must be on one device.*\.to\(device\)"):
        gdn.tree_verify(q, k, v, g, beta, pool.to("meta"), [0], plan)


def test_state_indices_as_a_list():
    """Was: AttributeError ('list' object has no attribute 'dim')."""
    plan = gdn.build_tree_plan([TREE, [-1, 0]])
    q, k, v, g, beta, pool = make_inputs(9)
    a = gdn.tree_verify(q, k, v, g, beta, pool, [2, 1], plan, variant="recurrent")
    b = gdn.tree_verify(q, k, v, g, beta, pool, torch.tensor([2, 1]), plan, variant="recurrent")
    assert torch.equal(a, b)
    x, cs, w = torch.randn(9, 8), torch.randn(3, 8, 3), torch.randn(8, 4)
    assert torch.equal(gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=[2, 0]),
                       gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=torch.tensor([2, 0])))


@pytest.mark.parametrize("parents", [[[-1, 0.7]], [[-1.0, 0.0]], [["-1"]]], ids=["0.7", "floats", "str"])
def test_plan_rejects_non_integer_parents(parents):
    """Was: 0.7 truncated to 0."""
    with pytest.raises(TypeError, match=r"gdn\.build_tree_plan: request 0 node \d: parent .* is not an integer"):
        gdn.build_tree_plan(parents)


def test_plan_rejects_float_parent_tensor_and_accepts_integer_likes():
    with pytest.raises(TypeError, match="integer tensor"):
        gdn.build_tree_plan(torch.tensor([-1.0, 0.0]), torch.tensor([0, 2]))
    import numpy as np

    p = gdn.build_tree_plan([[np.int64(-1), torch.tensor(0), True]])
    assert p.parent_local.tolist() == [-1, 0, 1]


# ------------------------------------------------------------------- NaN/Inf containment


VERIFY_PATHS = ["reference", "recurrent", "wy:default", "wy:square", "wy:split", "wy:split-flag", "wy:trans",
                "wy:stack"]


def _verify(path, plan, q, k, v, g, beta, pool, idx):
    variant, _, cfg = path.partition(":")
    with _wy_force(cfg or "default"):
        return gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant=variant)


# (field, node, value): leaves and inner nodes, NaN and +-Inf; node 1's subtree is {1, 3, 4, 6}
PLACEMENTS = [("q", 6, float("nan")), ("k", 1, float("inf")), ("v", 6, float("nan")), ("g", 3, float("-inf")),
              ("beta", 1, float("nan")), ("q", 1, float("-inf"))]


@pytest.mark.parametrize("path", VERIFY_PATHS)
def test_nan_stays_in_its_subtree(path):
    """A NaN/Inf in one node's input: every non-descendant's output is bitwise the same as without it, and the
    affected nodes' outputs are NaN (for q only the node itself: q feeds no state)."""
    trees = [TREE, [-1, 0, 1]]
    plan = gdn.build_tree_plan(trees)
    dtype = torch.bfloat16 if path in ("wy:split", "wy:split-flag", "wy:stack") else torch.float32
    inp = make_inputs(plan.total_nodes, pool=3, seed=4, dtype=dtype)
    pool = inp[5].float()
    idx = torch.tensor([1, 2])
    clean = _verify(path, plan, *inp[:5], pool, idx)
    assert torch.isfinite(clean).all()
    names = ["q", "k", "v", "g", "beta"]
    # three placements a path, NaN and Inf, leaves and inner nodes, in turn: each placement runs on 3-5 of the
    # eight paths
    turn = VERIFY_PATHS.index(path)
    for field, node, bad in [PLACEMENTS[(turn + j) % len(PLACEMENTS)] for j in (0, 2, 3)]:
        dirty = [t.clone() for t in inp[:5]]
        dirty[names.index(field)][node, 1] = bad  # one head (q/k: key head 1; v/g/beta: value head 1)
        o = _verify(path, plan, *dirty, pool, idx)
        hit = [node] if field == "q" else descendants(TREE, node)
        heads = [2, 3] if field in ("q", "k") else [1]  # value heads 2, 3 read key head 1
        rest = [i for i in range(plan.total_nodes) if i not in hit]
        assert torch.equal(o[rest], clean[rest]), f"{field}[{node}] = {bad}: a non-descendant changed"
        assert torch.equal(o[hit][:, [h for h in range(HV) if h not in heads]],
                           clean[hit][:, [h for h in range(HV) if h not in heads]]), "another head changed"
        if field == "g" and path == "recurrent":
            continue  # the sequential form computes a -inf gate (exp = 0: the state is forgotten); WY cannot
        assert torch.isnan(o[hit][:, heads]).all(), f"{field}[{node}] = {bad}: the affected outputs must be NaN"


def test_nan_in_conv_stays_on_its_path():
    plan = gdn.build_tree_plan([TREE])
    x, cs, w = torch.randn(7, 8), torch.randn(1, 8, 3), torch.randn(8, 4)
    clean = gdn.tree_conv1d(x, cs, w, plan)
    x2 = x.clone()
    x2[1, 3] = float("nan")
    dirty = gdn.tree_conv1d(x2, cs, w, plan)
    rest = [i for i in range(7) if i not in descendants(TREE, 1)]
    assert torch.equal(dirty[rest], clean[rest])


# ------------------------------------------------------------------- CPU paths without the interpreter


def test_every_op_runs_on_cpu_without_the_interpreter(monkeypatch):
    """Without TRITON_INTERPRET every op runs CPU tensors through the torch reference (the automatic choice, or
    variant="reference"), matching the kernels (interpreter) here; a kernel variant asked for by name raises with
    the fix instead of running the reference under its name."""
    trees = [TREE, [-1, 0]]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(9, pool=3)
    x, cs, w = torch.randn(9, 8), torch.randn(3, 8, 3), torch.randn(8, 4)
    kern = {vr: gdn.tree_verify(q, k, v, g, beta, pool, [2, 0], plan, variant=vr) for vr in ("wy", "recurrent")}
    kconv = gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=[1, 2])
    acc, n = acc_tensors([[0, 1, 3], [0, 1]])
    kp, kc = pool[None].clone(), cs[None].clone()
    gdn.commit(kp, kc, [2, 0], plan, acc, n, k[None], v[None], g[None], beta[None], x[None])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for vr in (None, "reference"):
        o = gdn.tree_verify(q, k, v, g, beta, pool, [2, 0], plan, variant=vr)
        torch.testing.assert_close(o, kern["recurrent"], rtol=1e-4, atol=1e-5)
    for vr in ("wy", "recurrent", "cuda"):
        with pytest.raises(ValueError, match=rf"^gdn\.tree_verify: variant '{vr}' cannot run on CPU tensors without "
                                             r"the Triton interpreter; start Python with TRITON_INTERPRET=1"):
            gdn.tree_verify(q, k, v, g, beta, pool, [2, 0], plan, variant=vr)
    with pytest.raises(ValueError, match=r"^gdn\.tree_conv1d: variant 'triton' cannot run"):
        gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=[1, 2], variant="triton")
    torch.testing.assert_close(gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=[1, 2]), kconv)
    rp, rc = pool[None].clone(), cs[None].clone()
    gdn.commit(rp, rc, [2, 0], plan, acc, n, k[None], v[None], g[None], beta[None], x[None])
    torch.testing.assert_close(rp, kp, rtol=1e-5, atol=1e-5)
    assert torch.equal(rc, kc)
    rp1 = pool.clone()
    gdn.commit(rp1, None, [2, 0], plan, acc, n, k, v, g, beta)  # single layer, state only
    torch.testing.assert_close(rp1, kp[0], rtol=1e-5, atol=1e-5)


def test_cpu_ops_in_a_fresh_process_without_the_interpreter():
    code = r"""
import torch, gdn
plan = gdn.build_tree_plan([[-1, 0, 0]])
T, H, HV, K, V = 3, 1, 2, 8, 8
q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, HV, V)
g, beta, pool = -torch.rand(T, HV), torch.rand(T, HV), torch.randn(2, HV, K, V)
for vr in (None, "reference"):
    assert torch.isfinite(gdn.tree_verify(q, k, v, g, beta, pool, [1], plan, variant=vr)).all()
for vr in ("wy", "recurrent"):
    try:
        gdn.tree_verify(q, k, v, g, beta, pool, [1], plan, variant=vr)
        raise SystemExit(f"variant {vr} ran")
    except ValueError as e:
        assert "TRITON_INTERPRET=1" in str(e), e
x, cs, w = torch.randn(T, 4), torch.randn(2, 4, 2), torch.randn(4, 3)
assert torch.isfinite(gdn.tree_conv1d(x, cs, w, plan)).all()
gdn.commit(pool, cs, torch.tensor([1]), plan, torch.tensor([[0, 2]]), torch.tensor([2]), k, v, g, beta, x)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ------------------------------------------------------------------- the CUDA C++ kernel, through its emulator


def test_cuda_emulator_skips_a_bad_state_index_and_flags():
    from test_gdn_cuda import emulate, inputs

    trees = [TREE, [-1, 0], [-1]]
    q, k, v, g, beta, pool = inputs(trees, 3)
    Kd = q.shape[-1]
    want = emulate(q, k, v, g, beta, pool, [0, 1, 2], trees, Kd ** -0.5, True)
    for bad in (-1, pool.shape[0], 10**6):
        out = torch.full_like(want, 7.0)
        err = torch.zeros(1, dtype=torch.int32)
        emulate(q, k, v, g, beta, pool, [0, bad, 2], trees, Kd ** -0.5, True, out=out, err=err)
        assert err.item() == guard.VERIFY_STATE_INDEX
        assert torch.equal(out[7:9], torch.full_like(out[7:9], 7.0))
        assert torch.equal(out[:7], want[:7]) and torch.equal(out[9:], want[9:])
    g2 = g.clone()
    g2[2, 0] = 0.5
    err = torch.zeros(1, dtype=torch.int32)
    emulate(q, k, v, g2, beta, pool, [0, 1, 2], trees, Kd ** -0.5, True, err=err)
    assert err.item() == guard.POSITIVE_GATE


def test_cuda_emulator_keeps_nan_in_its_subtree():
    from test_gdn_cuda import emulate, inputs

    trees = [TREE, [-1, 0, 1]]
    q, k, v, g, beta, pool = inputs(trees, 5)
    Kd, HVd = q.shape[-1], v.shape[1]
    clean = emulate(q, k, v, g, beta, pool, [1, 2], trees, Kd ** -0.5, True)
    assert torch.isfinite(clean).all()
    names = ["q", "k", "v", "g", "beta"]
    for field, node, bad in PLACEMENTS:
        dirty = [t.clone() for t in (q, k, v, g, beta)]
        dirty[names.index(field)][node, 1] = bad
        o = emulate(*dirty, pool, [1, 2], trees, Kd ** -0.5, True)
        hit = [node] if field == "q" else descendants(TREE, node)
        rest = [i for i in range(o.shape[0]) if i not in hit]
        assert torch.equal(o[rest], clean[rest]), f"{field}[{node}] = {bad}: a non-descendant changed"
        heads = [h for h in range(HVd) if (h // (HVd // q.shape[1]) == 1 if field in ("q", "k") else h == 1)]
        assert torch.isnan(o[hit][:, heads]).all()


def test_plan_max_nodes_too_small():
    """The host rejects max_nodes below the largest request; where the plan is built without a host look (a tensor,
    validate=False), the WY kernel skips the request whose nodes exceed its tile and flags PLAN_NODES."""
    with pytest.raises(ValueError, match=r"gdn\.build_tree_plan: max_nodes=4 but a request has 6 nodes"):
        gdn.build_tree_plan([[-1, 0, 1, 2, 3, 4]], max_nodes=4)
    par = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, -1], dtype=torch.int32)
    plan = gdn.build_tree_plan(par, torch.tensor([0, 18, 19]), validate=False, max_nodes=4)  # tile 16 < 18 nodes
    q, k, v, g, beta, pool = make_inputs(19)
    out = torch.full_like(v, 7.0)
    with pytest.raises(gdn.GuardError, match="more nodes than the plan's max_nodes"):
        gdn.tree_verify(q, k, v, g, beta, pool, [0, 1], plan, variant="wy", out=out)
    assert torch.equal(out[:18], torch.full_like(out[:18], 7.0)) and torch.isfinite(out[18]).all()
