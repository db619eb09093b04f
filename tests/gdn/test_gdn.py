"""CPU (interpreter) tests of the gdn op: plan, tree verify (wy, recurrent), tree conv, commit.

Tolerances are derived: every kernel result is compared with an fp64 reference and must be within
2x the error of the same-precision PyTorch computation (the fp32 sequential oracle, rounded to
the output dtype), via specpilot.testing.assert_close. For the "wy" variant the baseline is the
same WY algorithm in torch fp32 (gdn.chunk_reference); for "recurrent" and commit it is the
sequential recurrence in fp32.
"""

import random
import re

import pytest
import torch

import gdn
from autotune import force
from gdn.reference import commit_reference, conv_reference, recurrent_reference, root_path, tree_reference
from specpilot.bench.cases import chain, star
from specpilot.testing import assert_close

H, HV, K, V = 2, 4, 16, 32


def rand_tree(n, rng, max_children=None):
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def make_inputs(T, dtype=torch.float32, pool=4, seed=0, l2=True, h=H, hv=HV, k=K, v=V, corr=0.0):
    """corr > 0: every key is corr * (one shared direction per head) + noise, beta in [0.9, 1] and gates
    near 0, so A's entries approach 1 and the doubling inverses' powers grow (the hostile case)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, h, k, generator=gen)
    kk = torch.randn(T, h, k, generator=gen)
    if corr:
        kk = corr * torch.randn(1, h, k, generator=gen) + (1 - corr ** 2) ** 0.5 * kk
    if not l2:  # realistic norms without the in-kernel L2 norm
        q, kk = q / k ** 0.5, kk / k ** 0.5
    vv = torch.randn(T, hv, v, generator=gen)
    g = -torch.rand(T, hv, generator=gen) * (0.02 if corr else 0.5)
    beta = 0.9 + 0.1 * torch.rand(T, hv, generator=gen) if corr else torch.rand(T, hv, generator=gen)
    state = torch.randn(pool, hv, k, v, generator=gen) * 0.3
    return [t.to(dtype) for t in (q, kk, vv, g, beta)] + [state]


def check_verify(trees, variant, dtype=torch.float32, l2=True, layout="kv", h=H, hv=HV, k=K, v=V, seed=0,
                 corr=0.0):
    plan = gdn.build_tree_plan(trees)
    q, kk, vv, g, beta, pool = make_inputs(plan.total_nodes, dtype, pool=len(trees) + 2, seed=seed, l2=l2, h=h,
                                           hv=hv, k=k, v=v, corr=corr)
    idx = torch.randperm(len(trees) + 2, generator=torch.Generator().manual_seed(seed))[: len(trees)]
    pool_k = pool.transpose(-1, -2).contiguous() if layout == "vk" else pool
    o = gdn.tree_verify(q, kk, vv, g, beta, pool_k, idx, plan, use_qk_l2norm=l2, state_layout=layout,
                        variant=variant)
    assert o.dtype == vv.dtype and o.shape == vv.shape
    r64 = tree_reference(q, kk, vv, g, beta, pool.double(), idx, trees, use_qk_l2norm=l2, dtype=torch.float64)
    # same-precision torch computation of the same algorithm: the WY form for "wy" (its triangular
    # solve over 64 levels is ~3x less accurate than the recurrence, in torch as in the kernel)
    fn = gdn.chunk_reference if variant in ("wy", "reference") else recurrent_reference
    r32 = tree_reference(q, kk, vv, g, beta, pool, idx, trees, use_qk_l2norm=l2, dtype=torch.float32, fn=fn)
    return assert_close(o, r64, r32.to(vv.dtype), msg=f"{variant}")


# ----------------------------------------------------------------------------------- plan


def test_plan_bitmasks_and_depth():
    rng = random.Random(1)
    trees = [rand_tree(13, rng), chain(5), [-1], star(4), rand_tree(64, rng)]
    plan = gdn.build_tree_plan(trees)
    anc, depth = plan.anc.tolist(), plan.depth.tolist()
    t0 = 0
    for r, ps in enumerate(trees):
        for i in range(len(ps)):
            path = root_path(ps, i)
            want = sum(1 << j for j in path)
            want = want - (1 << 64) if want >= 1 << 63 else want
            assert anc[t0 + i] == want and depth[t0 + i] == len(path) - 1
            assert plan.node_req[t0 + i] == r
            assert plan.parent[t0 + i] == (t0 + ps[i] if ps[i] >= 0 else -1)
        assert plan.max_depth[r] == max(depth[t0:t0 + len(ps)])
        t0 += len(ps)
    assert plan.max_nodes == 64 and plan.batch == 5
    flat = torch.tensor([p for ps in trees for p in ps])
    plan2 = gdn.TreePlan.build(flat, plan.cu_seqlens, max_nodes=64, validate=False)
    for f in ("anc", "depth", "parent", "node_req", "max_depth"):
        assert torch.equal(getattr(plan, f), getattr(plan2, f)), f


@pytest.mark.parametrize("trees,match", [
    ([[-1, 1]], "topologically"),
    ([[-1, 0, 2]], "topologically"),
    ([[-1, 5]], "outside"),
    ([[-1, -2]], "outside"),
    ([chain(65)], "at most 64"),
], ids=["self-parent", "forward-parent", "outside", "below-minus-one", "65-nodes"])
def test_plan_rejects(trees, match):
    with pytest.raises(ValueError, match=match):
        gdn.build_tree_plan(trees)


# ------------------------------------------------------------------------------ reference


def test_chunk_form_equals_sequential_fp64():
    """The tree WY derivation itself: chunk form == per-path recurrence to fp64 rounding."""
    rng = random.Random(2)
    for n in (1, 7, 20, 64):
        ps = rand_tree(n, rng)
        q, k, v, g, beta, pool = make_inputs(n, seed=n)
        a = recurrent_reference(q, k, v, g, beta, pool[0], parents=ps, use_qk_l2norm=True, dtype=torch.float64)
        b = gdn.chunk_reference(q, k, v, g, beta, pool[0], parents=ps, use_qk_l2norm=True, dtype=torch.float64)
        assert (a - b).abs().max() < 1e-12


# --------------------------------------------------------------------------------- verify

_rng = random.Random(3)
TREES = {
    "chain7": [chain(7)],
    "rand13": [rand_tree(13, _rng)],
    "star9": [star(9)],
    "single": [[-1]],
    "chain64": [chain(64)],
    "rand64": [rand_tree(64, _rng)],
    "batch-rand33-chain5-single-star3": [rand_tree(33, _rng), chain(5), [-1], star(3)],
    "forest-multi-root": [[-1, -1, 0, 1, -1, 2]],
}


@pytest.mark.parametrize("variant", ["wy", "recurrent", "reference"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("64") or n.startswith("batch")
                                  else n for n in TREES])
def test_verify_trees(variant, name):
    if variant == "recurrent" and name in ("chain64", "rand64"):
        check_verify(TREES[name], variant, h=1, hv=1, k=16, v=16)  # the interpreter is slow on 64 x 64 walks
    else:
        check_verify(TREES[name], variant)


def test_chain_tree_matches_sequential_chain():
    """A chain-shaped tree is plain sequential decoding (parents=None in the reference)."""
    n = 11
    q, k, v, g, beta, pool = make_inputs(n, seed=5)
    plan = gdn.build_tree_plan([chain(n)])
    idx = torch.tensor([2])
    o = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="wy")
    r64 = recurrent_reference(q, k, v, g, beta, pool[2].double(), use_qk_l2norm=True, dtype=torch.float64)
    r32 = recurrent_reference(q, k, v, g, beta, pool[2], use_qk_l2norm=True)
    assert_close(o, r64, r32)


@pytest.mark.parametrize("variant", ["wy", pytest.param("recurrent", marks=pytest.mark.slow), "reference"])
def test_verify_bf16_inputs(variant):
    check_verify([rand_tree(21, random.Random(4)), chain(3)], variant, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["wy", "recurrent", "reference"])
def test_verify_no_l2norm_vk_layout_odd_dims(variant):
    # SGLang pool layout [pool, HV, V, K], K != V, odd head dims, H=1 grouped over 3 value heads
    check_verify([rand_tree(10, random.Random(5)), star(4)], variant, l2=False, layout="vk", h=1, hv=3, k=24, v=20)


def test_verify_auto_layout_and_scale():
    plan = gdn.build_tree_plan([rand_tree(6, random.Random(6))])
    q, k, v, g, beta, pool = make_inputs(6, k=16, v=32)
    idx = torch.tensor([1])
    a = gdn.tree_verify(q, k, v, g, beta, pool.transpose(-1, -2).contiguous(), idx, plan, scale=0.3,
                        state_layout="auto", variant="wy")
    b = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, scale=0.3, variant="wy")
    r64 = tree_reference(q, k, v, g, beta, pool.double(), idx, [plan.parent_local.tolist()], scale=0.3,
                         dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, pool, idx, [plan.parent_local.tolist()], scale=0.3)
    assert_close(a, r64, r32)
    assert_close(b, r64, r32)


def test_force_variant_and_default():
    plan = gdn.build_tree_plan([chain(4)])
    q, k, v, g, beta, pool = make_inputs(4)
    idx = torch.tensor([0])
    with force("gdn.tree_verify", variant="recurrent"):
        a = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan)
    b = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan)  # interpreter: portable variant "wy"
    r64 = tree_reference(q, k, v, g, beta, pool.double(), idx, [chain(4)], dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, pool, idx, [chain(4)])
    assert_close(a, r64, r32)
    assert_close(b, r64, r32)


def test_registered_ops_match_eager():
    """The torch custom ops (what torch.compile sees) give the same bits as the eager launches."""
    trees = [rand_tree(7, random.Random(11))]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(7)
    idx = torch.tensor([1])
    want = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="wy")
    got = torch.empty_like(v)
    torch.ops.specpilot_gdn.tree_verify(q, k, v, g, beta, got, pool, idx, plan.cu_seqlens, plan.anc, plan.depth,
                                        plan.max_depth, plan.node_req, plan.sync, plan.err, K ** -0.5, True, False, "auto",
                                        7)
    assert torch.equal(got, want)
    x, cs, w = torch.randn(7, 8), torch.randn(2, 8, 3), torch.randn(8, 4)
    y = torch.empty_like(x)
    torch.ops.specpilot_gdn.tree_conv1d(x, w, None, y, cs, idx, plan.node_req, plan.parent, plan.depth, plan.err,
                                        True, "auto")
    assert torch.equal(y, gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=idx))
    acc, acc_len = _acc_tensors([root_path(trees[0], 6)])
    p1, p2, c1, c2 = pool.clone()[None], pool.clone()[None], cs.clone()[None], cs.clone()[None]
    gdn.commit(p1, c1, idx, plan, acc, acc_len, k[None], v[None], g[None], beta[None], x[None], use_qk_l2norm=True)
    torch.ops.specpilot_gdn.commit(p2, k[None], v[None], g[None], beta[None], idx, plan.cu_seqlens, acc, acc_len,
                                   plan.parent_local, plan.err, True, False, c2, x[None], idx, "auto")
    assert torch.equal(p1, p2) and torch.equal(c1, c2)


def test_wy_padded_tiles_ieee():
    """Tiles padded to 64 rows (the sm_90 default) and the no-tensor-core precision."""
    from gdn.configs import WYConfig

    with force("gdn.tree_verify", config=WYConfig(BV=16, min_bt=64, dot_precision="ieee")):
        check_verify([rand_tree(9, random.Random(12)), [-1]], "wy")


# ---------------------------------------------------------------------------------- conv


@pytest.mark.parametrize("variant", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_conv1d(dtype, variant):
    rng = random.Random(7)
    # depths 0..>3 so paths shorter than the width read 3, 2 or 1 committed columns
    trees = [rand_tree(17, rng), [-1], chain(2), chain(6), star(5)]
    plan = gdn.build_tree_plan(trees)
    D, W = 45, 4
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(plan.total_nodes, D, generator=gen).to(dtype)
    cs = torch.randn(7, D, W - 1, generator=gen).to(dtype)
    w = torch.randn(D, 1, W, generator=gen).to(dtype)
    bias = torch.randn(D, generator=gen).to(dtype)
    ci = torch.tensor([6, 0, 3, 2, 5])
    y = gdn.tree_conv1d(x, cs, w, plan, bias=bias, conv_state_indices=ci, variant=variant)
    r64 = conv_reference(x, cs, w, trees, bias=bias, conv_state_indices=ci, dtype=torch.float64)
    r32 = conv_reference(x, cs, w, trees, bias=bias, conv_state_indices=ci)
    assert_close(y, r64, r32.to(dtype))
    y2 = torch.empty_like(x)
    assert gdn.tree_conv1d(x, cs, w[:, 0], plan, activation=None, conv_state_indices=ci, variant=variant, out=y2) is y2
    r64 = conv_reference(x, cs, w, trees, activation=None, conv_state_indices=ci, dtype=torch.float64)
    r32 = conv_reference(x, cs, w, trees, activation=None, conv_state_indices=ci)
    assert_close(y2, r64, r32.to(dtype))


# -------------------------------------------------------------------------------- commit


def _random_root_path(ps, rng):
    if rng.random() < 0.1:
        return []
    return root_path(ps, rng.randrange(len(ps)))


def _acc_tensors(paths):
    ml = max([len(p) for p in paths] + [1])
    acc = torch.tensor([p + [0] * (ml - len(p)) for p in paths], dtype=torch.int32)
    return acc, torch.tensor([len(p) for p in paths], dtype=torch.int32)


@pytest.mark.parametrize("variant", ["triton", "reference"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_commit_then_second_step(layout, variant):
    rng = random.Random(8)
    trees = [rand_tree(12, rng), chain(6), star(5)]
    plan = gdn.build_tree_plan(trees)
    T, L, D, W, P = plan.total_nodes, 2, 24, 4, 5
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(L, T, H, K, generator=gen)
    v = torch.randn(L, T, HV, V, generator=gen)
    g = -torch.rand(L, T, HV, generator=gen)
    beta = torch.rand(L, T, HV, generator=gen)
    x = torch.randn(L, T, D, generator=gen)
    pool = torch.randn(L, P, HV, K, V, generator=gen) * 0.3
    cst = torch.randn(L, P, D, W - 1, generator=gen)
    idx = torch.tensor([4, 0, 2])
    paths = [root_path(trees[0], 11), root_path(trees[1], 5), [0, 3]]
    acc, acc_len = _acc_tensors(paths)
    pk = pool.transpose(-1, -2).contiguous() if layout == "vk" else pool.clone()
    c = cst.clone()
    gdn.commit(pk, c, idx, plan, acc, acc_len, k, v, g, beta, x, use_qk_l2norm=True, state_layout=layout,
               validate=True, variant=variant)
    got = pk.transpose(-1, -2) if layout == "vk" else pk
    cu = plan.cu_seqlens.tolist()
    for li in range(L):
        for r in range(3):
            toks = [cu[r] + j for j in paths[r]]
            S64, C = commit_reference(pool[li, idx[r]].double(), cst[li, idx[r]], k[li], v[li], g[li], beta[li],
                                      x[li], toks, use_qk_l2norm=True, dtype=torch.float64)
            S32, _ = commit_reference(pool[li, idx[r]], cst[li, idx[r]], k[li], v[li], g[li], beta[li], x[li], toks,
                                      use_qk_l2norm=True)
            assert_close(got[li, idx[r]], S64, S32)
            assert torch.equal(c[li, idx[r]], C.float())  # conv commit is a pure copy: exact
    # untouched pool rows stay bitwise
    for other in (1, 3):
        assert torch.equal(got[:, other], pool[:, other]) and torch.equal(c[:, other], cst[:, other])
    # second step from the committed state (layer 0): verify a new tree
    trees2 = [rand_tree(9, rng), [-1], chain(4)]
    plan2 = gdn.build_tree_plan(trees2)
    q2, k2, v2, g2, b2, _ = make_inputs(plan2.total_nodes, seed=9)
    o = gdn.tree_verify(q2, k2, v2, g2, b2, pk[0], idx, plan2, use_qk_l2norm=True, state_layout=layout, variant="wy")
    base = pool[0].clone().double()
    for r in range(3):  # fp64 committed states from the fp64 reference
        base[idx[r]], _ = commit_reference(pool[0, idx[r]].double(), cst[0, idx[r]], k[0], v[0], g[0], beta[0],
                                           x[0], [cu[r] + j for j in paths[r]], use_qk_l2norm=True,
                                           dtype=torch.float64)
    r64 = tree_reference(q2, k2, v2, g2, b2, base, idx, trees2, use_qk_l2norm=True, dtype=torch.float64)
    r32 = tree_reference(q2, k2, v2, g2, b2, got[0], idx, trees2, use_qk_l2norm=True)
    assert_close(o, r64, r32)


@pytest.mark.parametrize("variant", ["triton", "reference"])
def test_commit_single_layer_and_state_only(variant):
    plan = gdn.build_tree_plan([star(4), chain(3)])
    q, k, v, g, beta, pool = make_inputs(plan.total_nodes, pool=3)
    acc, acc_len = _acc_tensors([[0, 2], [0, 1, 2]])
    idx = torch.tensor([2, 0])
    p = pool.clone()
    gdn.commit(p, None, idx, plan, acc, acc_len, k, v, g, beta, use_qk_l2norm=True, variant=variant)
    for r, toks in enumerate([[0, 2], [4, 5, 6]]):
        S64, _ = commit_reference(pool[idx[r]].double(), torch.zeros(1, 3), k, v, g, beta, torch.zeros(7, 1), toks,
                                  use_qk_l2norm=True, dtype=torch.float64)
        S32, _ = commit_reference(pool[idx[r]], torch.zeros(1, 3), k, v, g, beta, torch.zeros(7, 1), toks,
                                  use_qk_l2norm=True)
        assert_close(p[idx[r]], S64, S32)
    assert torch.equal(p[1], pool[1])


@pytest.mark.slow
def test_full_cycle_equals_sequential_decoding():
    """Many verify + commit steps with random acceptance == sequential decoding of the accepted
    tokens: same outputs for accepted nodes, same final recurrent and conv state. bf16 inputs,
    fp32 state, 24 steps (drift)."""
    rng = random.Random(10)
    gen = torch.Generator().manual_seed(10)
    D, W = 20, 4
    pool = torch.randn(1, 2, HV, K, V, generator=gen) * 0.3
    cst = torch.randn(1, 2, D, W - 1, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    S0, C0 = pool[0, 1].clone(), cst[0, 1].clone()
    idx = torch.tensor([1])
    stream = {n: [] for n in ("q", "k", "v", "g", "beta", "x")}
    outs, conv_outs = [], []
    for step in range(24):
        n = rng.choice([1, 3, 8, 16])
        ps = rand_tree(n, rng)
        plan = gdn.build_tree_plan([ps])
        q, k, v, g, beta, _ = make_inputs(n, torch.bfloat16, seed=100 + step)
        x = torch.randn(n, D, generator=gen).to(torch.bfloat16)
        o = gdn.tree_verify(q, k, v, g, beta, pool[0], idx, plan, use_qk_l2norm=True, variant="wy")
        y = gdn.tree_conv1d(x, cst[0], weight, plan, conv_state_indices=idx)
        path = root_path(ps, rng.randrange(n)) if rng.random() > 0.15 else []
        acc, acc_len = _acc_tensors([path])
        gdn.commit(pool, cst, idx, plan, acc, acc_len, k[None], v[None], g[None], beta[None], x[None],
                   use_qk_l2norm=True, validate=True)
        for name, t in zip(("q", "k", "v", "g", "beta", "x"), (q, k, v, g, beta, x)):
            stream[name].append(t[path])
        outs.append(o[path])
        conv_outs.append(y[path])
    s = {n: torch.cat(ts) for n, ts in stream.items()}
    got = torch.cat(outs)
    r64, st64 = recurrent_reference(s["q"], s["k"], s["v"], s["g"], s["beta"], S0.double(), use_qk_l2norm=True,
                                    return_states=True, dtype=torch.float64)
    r32, st32 = recurrent_reference(s["q"], s["k"], s["v"], s["g"], s["beta"], S0, use_qk_l2norm=True,
                                    return_states=True)
    assert got.shape[0] == s["q"].shape[0] > 30
    assert_close(got, r64, r32.to(torch.bfloat16), msg="outputs")
    assert_close(pool[0, 1], st64[-1], st32[-1], msg="final state")
    chain_ps = [chain(s["x"].shape[0])]
    c64 = conv_reference(s["x"], C0[None], weight, chain_ps, dtype=torch.float64)
    c32 = conv_reference(s["x"], C0[None], weight, chain_ps)
    assert_close(torch.cat(conv_outs), c64, c32.to(torch.bfloat16), msg="conv outputs")
    assert torch.equal(cst[0, 1], s["x"][-(W - 1):].float().T)


# ---------------------------------------------------------------------------- bad inputs


def test_bad_inputs():
    plan = gdn.build_tree_plan([chain(3)])
    q, k, v, g, beta, pool = make_inputs(3)
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn.tree_verify(q, k, v[:, :3], g[:, :3], beta[:, :3], pool[:, :3], idx, plan)
    with pytest.raises(TypeError, match="float32"):
        gdn.tree_verify(q, k, v, g, beta, pool.bfloat16(), idx, plan)
    with pytest.raises(ValueError, match="q and k"):
        gdn.tree_verify(q, k[:, :1], v, g, beta, pool, idx, plan)
    with pytest.raises(ValueError, match="g must be"):
        gdn.tree_verify(q, k, v, g[:, :2], beta, pool, idx, plan)
    with pytest.raises(ValueError, match="rebuild the plan"):
        gdn.tree_verify(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, idx, plan)
    with pytest.raises(ValueError, match="state pool must be"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, state_layout="vk")
    with pytest.raises(ValueError, match="ambiguous"):
        gdn.tree_verify(q, k, v[..., :16], g, beta, pool[..., :16], idx, plan, state_layout="auto")
    with pytest.raises(ValueError, match="state_indices"):
        gdn.tree_verify(q, k, v, g, beta, pool, torch.tensor([0, 1]), plan)
    with pytest.raises(ValueError, match="unknown"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="nope")
    with pytest.raises(TypeError, match="TreePlan"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, [-1, 0, 1])
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="conv_state must be"):
        gdn.tree_conv1d(x, torch.zeros(1, 8, 4), torch.randn(8, 4), plan)
    with pytest.raises(ValueError, match="weight must be"):
        gdn.tree_conv1d(x, torch.zeros(1, 8, 3), torch.randn(7, 4), plan)
    plan2 = gdn.build_tree_plan([[-1, 0, 0]])
    for path, match in (([0, 2, 1], "root path"), ([1], "root path"), ([0, 5], "outside")):
        acc, acc_len = _acc_tensors([path])
        with pytest.raises(ValueError, match=match):
            gdn.commit(pool.clone(), None, idx, plan2, acc, acc_len, k, v, g, beta, validate=True)
    acc, acc_len = _acc_tensors([[0, 1]])
    with pytest.raises(ValueError, match="needs k, v, g and beta"):
        gdn.commit(pool.clone(), None, idx, plan2, acc, acc_len, k, None, g, beta)


def test_errors_share_one_prefix_style():
    """Every public gdn error reads `gdn.<function>: <what is wrong>; <how to fix>`."""
    plan = gdn.build_tree_plan([chain(3)])
    q, k, v, g, beta, pool = make_inputs(3)
    idx = torch.tensor([0])
    x, cs, w = torch.randn(3, 8), torch.zeros(1, 8, 3), torch.randn(8, 4)
    acc, acc_len = _acc_tensors([[0, 1]])
    calls = {
        "gdn.tree_verify": [lambda: gdn.tree_verify(q, k, v[:, :3], g[:, :3], beta[:, :3], pool[:, :3], idx, plan),
                            lambda: gdn.tree_verify(q, k, v, g, beta, pool.bfloat16(), idx, plan),
                            lambda: gdn.tree_verify(q, k, v, g, beta, pool, idx, [-1, 0, 1]),
                            lambda: gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="nope"),
                            lambda: gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, out=v[:2]),
                            lambda: gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="cuda")],
        "gdn.tree_conv1d": [lambda: gdn.tree_conv1d(x, torch.zeros(1, 8, 4), w, plan),
                            lambda: gdn.tree_conv1d(x, cs, w, plan, variant="wy"),
                            lambda: gdn.tree_conv1d(x, cs, w, plan, out=x.double())],
        "gdn.commit": [lambda: gdn.commit(pool.clone(), None, idx, plan, acc, acc_len, k, None, g, beta),
                       lambda: gdn.commit(pool.clone(), None, idx, plan, acc, acc_len, k, v, g, beta, variant="x")],
    }
    for fn, bad in calls.items():
        for call in bad:
            with pytest.raises((TypeError, ValueError)) as e:
                call()
            assert re.match(re.escape(fn) + r": [^;]+; \S", str(e.value)), str(e.value)


def test_plans_are_cached_per_shape_key():
    """One plan per key: a second call of the same shapes reuses it, a forced config is part of the key,
    and the Plan names the variant asked for beside the kernel that runs (an automatic "cuda" runs "wy"
    where the CUDA kernel cannot)."""
    from gdn import ops as gops

    plan = gdn.build_tree_plan([chain(4)])
    q, k, v, g, beta, pool = make_inputs(4)
    idx = torch.tensor([0])
    for _ in range(2):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan)
    (got,) = gops._PLANS._plans.values()
    assert got.variant == gops.VARIANTS.default() and got.kernel == "wy" and got.config is not None
    from gdn.configs import WYConfig

    with force("gdn.tree_verify", config=WYConfig(BV=16)):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan)
    assert len(gops._PLANS) == 2


def test_max_nodes_is_the_plan_bound():
    """gdn.MAX_NODES is what a TreePlan takes; the CUDA kernel's own, smaller bound has its own name."""
    from gdn import cuda as gcuda

    assert gdn.MAX_NODES == 64 and gcuda.MAX_CUDA_NODES == 32 and not hasattr(gcuda, "MAX_NODES")
    gdn.build_tree_plan([chain(gdn.MAX_NODES)])
    with pytest.raises(ValueError, match="at most 64"):
        gdn.build_tree_plan([chain(gdn.MAX_NODES + 1)])


# ------------------------------------------------------------------------ wy configurations


@pytest.mark.parametrize("inverse", ["square", "levels", "fold", "split"])
@pytest.mark.parametrize("split", [pytest.param(True, marks=pytest.mark.slow), False], ids=["split", "nosplit"])
def test_wy_inverse_and_split(inverse, split):
    """The inverses ('square': log2(depth) rounds; 'levels'; 'fold': (q.k^T d).T built directly;
    'split': fold's N from a first launch, read by the second) and
    both product modes (bf16 split of the state vs fp32 products), on bf16 inputs, deep chains and
    bushy trees."""
    from gdn.configs import WYConfig

    rng = random.Random(21)
    with force("gdn.tree_verify", config=WYConfig(BV=16, inverse=inverse, split=split)):
        check_verify([chain(33), rand_tree(20, rng), star(5), [-1]], "wy", dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("split", [pytest.param(True, marks=pytest.mark.slow), False], ids=["split", "nosplit"])
@pytest.mark.parametrize("inverse", ["square", "levels", pytest.param("fold", marks=pytest.mark.slow), "split"])
def test_wy_transposed(split, inverse):
    """trans=True (products as [BV, K] x [K, BT], M = BV: configs.WY_WGMMA on sm_90) gives the same function
    within the derived bound: deep chains, bushy trees, a one-node tree, odd V (masked V block)."""
    from gdn.configs import WYConfig

    rng = random.Random(22)
    with force("gdn.tree_verify", config=WYConfig(BV=16, inverse=inverse, split=split, trans=True)):
        check_verify([chain(33), rand_tree(20, rng), star(5), [-1]], "wy", dtype=torch.bfloat16, seed=4)


def test_wy_transposed_odd_dims_vk():
    from gdn.configs import WYConfig

    with force("gdn.tree_verify", config=WYConfig(BV=16, trans=True)):
        check_verify([rand_tree(10, random.Random(5)), star(4)], "wy", l2=False, layout="vk", h=1, hv=3, k=24, v=20)


@pytest.mark.parametrize("inverse", ["square"] + [pytest.param(i, marks=pytest.mark.slow)
                                                 for i in ("loop", "fold", "split")])
def test_wy_stacked_qk_and_loop_inverse(inverse):
    """stack=True (q rows over k rows: one [2BT, K] set of state products) and inverse='loop' (the
    squaring rounds as a runtime loop) give the same function within the derived bound: deep
    chains (many rounds), bushy trees, a one-node tree, odd K and V (masked tiles), both layouts."""
    from gdn.configs import WYConfig

    rng = random.Random(23)
    with force("gdn.tree_verify", config=WYConfig(BV=16, inverse=inverse, stack=True)):
        check_verify([chain(33), rand_tree(20, rng), star(5), [-1]], "wy", dtype=torch.bfloat16, seed=5)
        check_verify([rand_tree(10, rng), star(4)], "wy", dtype=torch.bfloat16, l2=False, layout="vk", h=1, hv=3,
                     k=24, v=20, seed=6)
    with force("gdn.tree_verify", config=WYConfig(BV=16, inverse="loop")):
        check_verify([chain(33), rand_tree(20, rng), [-1]], "wy", dtype=torch.bfloat16, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("inverse", ["fold", "split", "split-loop"])
def test_wy_fold_depth64_and_ragged(inverse):
    """inverse='fold' (and 'split', its two-launch form) on a depth-63 chain (all 5 rounds, 64-row
    tile), a batch mixing depths (each request stops its rounds at its own depth; the last one is
    N.P alone) and a star (no rounds at all), against the per-path sequential reference."""
    from gdn.configs import WYConfig

    rng = random.Random(24)
    # "split-loop": the first launch's rounds as a runtime loop (inverse_loop), which must stop where the
    # unrolled rounds do for every depth: 63, 2 (N.P alone), 16, 8, 0
    loop = inverse == "split-loop"
    inverse = "split" if loop else inverse
    cfg = WYConfig(BV=16, inverse=inverse, stack=True, inverse_stack=inverse == "split", inverse_loop=loop)
    with force("gdn.tree_verify", config=cfg):
        check_verify([chain(64)], "wy", dtype=torch.bfloat16, seed=8)
        check_verify([chain(2), rand_tree(17, rng), star(9), chain(9)], "wy", dtype=torch.bfloat16, seed=9)
        # fp32 inputs and output: the bound is the fp32 algorithm's own, so a 1e-3 error in N shows
        check_verify([rand_tree(20, rng), chain(9)], "wy", seed=10)
        # keys correlated 0.5: A's powers are large enough that a missing round shows (a last round skipped at
        # depth 2 is a 1e-1 error here; random keys hide it under the bound), small enough for no fallback
        check_verify([chain(3), rand_tree(17, random.Random(1)), chain(9)], "wy", seed=10, corr=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "loop"])
def test_wy_split_flag_handoff(loop, no_two_launch_split):
    """inverse='split' in one launch (handoff='flag'): the B * HV inverse programs raise a flag per
    (request, value head) that the state programs of that head poll. Same function as the two-launch
    form within the derived bound, on ragged batches (every request its own depth and flag), odd
    dims, both layouts; the flags are all back at 0 after each call, so the plan's next call (a second
    layer) is right too. The two-launch kernel must not run: the flag path is the one tested."""
    from gdn.configs import WYConfig

    rng = random.Random(26)
    cfg = WYConfig(BV=16, inverse="split", stack=True, inverse_stack=True, handoff="flag", inverse_loop=loop)
    with force("gdn.tree_verify", config=cfg):
        for seed in (12, 13):
            check_verify([chain(33), rand_tree(20, rng), star(5), [-1]], "wy", dtype=torch.bfloat16, seed=seed)
        check_verify([rand_tree(10, rng), star(4)], "wy", dtype=torch.bfloat16, l2=False, layout="vk", h=1, hv=3,
                     k=24, v=20, seed=14)
        check_verify([chain(32), star(4)], "wy", seed=15, corr=0.95)  # the guard's fallback inside a producer
    plan = gdn.build_tree_plan([chain(5), rand_tree(9, rng)])
    q, k, v, g, beta, pool = make_inputs(plan.total_nodes, hv=3, h=1)
    idx = torch.tensor([0, 1])
    with force("gdn.tree_verify", config=cfg):
        o1 = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="wy")
        assert not plan.sync.any(), "a flag was left raised"
        o2 = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="wy")
    assert not plan.sync.any()
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("inverse", ["square"] + [pytest.param(i, marks=pytest.mark.slow)
                                                 for i in ("loop", "fold", "split", "levels")])
def test_wy_correlated_keys_stay_accurate(inverse):
    """Hostile inverse: keys along each path nearly parallel (corr 0.95), beta near 1, gates near 0, so
    A's entries approach 1 and its powers grow far past 1 on a 32-node chain and a deep tree. The
    doubling inverses must notice (max |A^(2^i)| > GROWTH_MAX) and fall back to substitution: fp32
    inputs and output, within the derived bound of torch's fp32 WY form (a triangular solve)."""
    from gdn.configs import WYConfig

    rng = random.Random(25)
    deep = [-1] + [max(0, i - 1 - rng.randrange(2)) for i in range(1, 24)]  # depth ~16, a few branches
    with force("gdn.tree_verify", config=WYConfig(BV=16, inverse=inverse, stack=inverse in ("fold", "split"))):
        check_verify([chain(32), deep, star(4)], "wy", seed=11, corr=0.95)


@pytest.mark.parametrize("fields, match", [
    (dict(inverse="cubic"), "must be one of"),
    (dict(inverse_stack=True), "do nothing with inverse='square'"),
    (dict(inverse="fold", inverse_warps=8), "do nothing with inverse='fold'"),
    (dict(inverse="split", inverse_warps=3), "inverse_warps must be"),
    (dict(inverse="split", maxnreg=300), "maxnreg is a per-thread register cap"),
    (dict(inverse="split", inverse_maxnreg=8), "inverse_maxnreg is a per-thread register cap"),
    (dict(inverse="square", handoff="flag"), "nothing to hand over"),
    (dict(inverse="fold", inverse_loop=True), "do nothing with inverse='fold'"),
    (dict(inverse="split", handoff="spin"), "handoff must be"),
])
def test_wy_config_rejects(fields, match):
    """A pinned WYConfig that cannot mean what it says fails at the call with the field named."""
    from gdn.configs import WYConfig

    plan = gdn.build_tree_plan([[-1, 0]])
    q, k, v, g, beta, pool = make_inputs(2)
    with force("gdn.tree_verify", config=WYConfig(BV=16, **fields)):
        with pytest.raises(ValueError, match=match):
            gdn.tree_verify(q, k, v, g, beta, pool, torch.tensor([0]), plan, variant="wy")


def test_wy_node_tile_follows_plan():
    from gdn.configs import wy_config

    assert wy_config(8, 128, 128).min_bt == 16 and wy_config(64, 128, 128).num_warps == 8


def test_compile_fullgraph_out_none():
    """torch.compile(fullgraph) with out=None (allocating twins of the ops), deterministic mode on:
    its NaN-filled `empty` is the pattern that broke functionalization on the GPU."""
    trees = [rand_tree(6, random.Random(5))]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(6)
    idx = torch.tensor([2])
    x, cs, w = torch.randn(6, 8), torch.randn(4, 8, 3), torch.randn(8, 4)

    def f(q, k, v, g, beta, pool, x):
        o = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="wy")
        return o * 2, gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=idx) + 1

    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, pool, x)
    finally:
        torch.use_deterministic_algorithms(prev)
    want = f(q, k, v, g, beta, pool, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cpu_tensors_without_the_interpreter_run_the_references(monkeypatch):
    """No Triton backend for CPU tensors: every op's automatic variant is "reference", and a Triton variant
    asked for by name raises (it would otherwise run the reference under its name)."""
    import autotune.dispatch
    import autotune.hardware
    from gdn import ops as gops

    monkeypatch.setattr(autotune.dispatch, "is_interpreter", lambda: False)
    monkeypatch.setattr(autotune.hardware, "is_interpreter", lambda: False)  # autotune.host_only reads it
    monkeypatch.setattr(gops, "is_interpreter", lambda: False)
    trees = [rand_tree(6, random.Random(3)), chain(3)]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = make_inputs(plan.total_nodes, pool=3)
    idx = torch.tensor([2, 0])
    o = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True)
    r64 = tree_reference(q, k, v, g, beta, pool.double(), idx, trees, use_qk_l2norm=True, dtype=torch.float64)
    assert_close(o, r64, tree_reference(q, k, v, g, beta, pool, idx, trees, use_qk_l2norm=True, fn=gdn.chunk_reference))
    with pytest.raises(ValueError, match=r"gdn\.tree_verify: variant 'wy' cannot run on CPU tensors without the "
                                         r"Triton interpreter; .*variant=None or 'reference'"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="wy")
    assert torch.equal(gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="reference"),
                       o)
    assert {(p.variant, p.kernel) for p in gops._PLANS._plans.values()} == {("reference", "reference")}
    x, cs, w = torch.randn(plan.total_nodes, 8), torch.randn(3, 8, 3), torch.randn(8, 4)
    assert torch.equal(gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=idx),
                       conv_reference(x, cs, w, trees, conv_state_indices=idx))
    acc, acc_len = _acc_tensors([root_path(trees[0], 5), [0, 1]])
    p = pool.clone()
    gdn.commit(p, None, idx, plan, acc, acc_len, k, v, g, beta, use_qk_l2norm=True)
    assert not torch.equal(p[2], pool[2]) and torch.equal(p[1], pool[1])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", ["default", "bv64-w8"])
def test_wy_tree_mix_at_node_tile_64(cfg):
    """The tree mix that broke the untransposed split WY configs on the H200 (a 64-chain, 63- and 32-node trees
    and small ones, node tile 64, bf16 q/k): under the interpreter at small head dims, every config, including the
    BV < 64 state products computed as (S0^T K^T)^T, equals the fp64 reference within the derived bound. (The fault
    was in Triton's sm_90 lowering, which the interpreter does not run: tests/test_sm90_codegen.py guards that.)"""
    from gdn.configs import WYConfig

    rng = random.Random(0)
    trees = [chain(64), rand_tree(63, rng), [-1], [-1, 0, 0, 0, 1, 2, 3]]
    config = {"default": WYConfig(), "bv64-w8": WYConfig(BV=64, num_warps=8)}[cfg]
    with force("gdn.tree_verify", config=config):
        check_verify(trees, "wy", dtype=torch.bfloat16, h=1, hv=2, k=16, v=64, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_reference_states_are_the_root_path_walks_bitwise(dtype):
    """The reference computes each node's state once, from its parent's: the outputs and states equal, bit for bit,
    a separate walk down every node's root path, on trees whose parents come after their children too, with a NaN
    and an Inf among the inputs (they stay in their subtrees)."""
    from gdn.reference import _prep, _step

    gen = torch.Generator().manual_seed(5)
    T, H, HV, K, V = 9, 1, 2, 8, 4
    q, k = (torch.randn(T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    S0 = torch.randn(HV, K, V, generator=gen)
    k[3, 0, 1] = float("nan")
    v[6, 1, 2] = float("inf")
    for parents in ([-1, 0, 1, 1, 0, 4, 5, 2, 2], [4, -1, 1, 2, 1, 0, 8, 0, 3], list(range(-1, T - 1))):
        o, st = recurrent_reference(q, k, v, g, beta, S0, parents=parents, use_qk_l2norm=True, return_states=True,
                                    dtype=dtype)
        qq, kk, vv, gg, bb, S = _prep(q, k, v, g, beta, S0, None, True, dtype)
        for i in range(T):
            W = S
            for j in root_path(parents, i):
                W = _step(W, kk[j], vv[j], gg[j], bb[j])
            assert torch.equal(st[i].nan_to_num(7.0), W.nan_to_num(7.0)), (parents, i)
            assert torch.equal(o[i].nan_to_num(7.0), torch.einsum("hkv,hk->hv", W, qq[i]).nan_to_num(7.0)), (parents, i)
        assert o.isnan().any() and not o[[i for i in range(T) if 3 not in root_path(parents, i)
                                           and 6 not in root_path(parents, i)]].isnan().any()


# ------------------------------------------------------------------------ one node a request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout, l2, h, hv, k, v", [("kv", True, H, HV, K, V), ("vk", False, 1, 3, 24, 20)],
                         ids=["kv", "vk-odd"])
def test_one_node_plans_take_the_one_node_kernel(dtype, layout, l2, h, hv, k, v, verify_kernel):
    """A plan of one node a request runs gdn/kernels/one.py (two state products and a rank-one correction) by
    default, within the derived bound of the fp64 sequential step, requests in any pool row; odd head dims
    (V not a multiple of the V block, K not a power of two) and the SGLang layout included."""
    trees = [[-1]] * 4
    plan = gdn.build_tree_plan(trees)
    assert plan.max_nodes == 1
    q, kk, vv, g, beta, pool = make_inputs(4, dtype, pool=6, seed=9, l2=l2, h=h, hv=hv, k=k, v=v)
    pool_k = pool.transpose(-1, -2).contiguous() if layout == "vk" else pool
    assert verify_kernel(plan, q, kk, vv, g, beta, pool_k, torch.tensor([0, 1, 2, 3]), layout == "vk") == "one"
    check_verify(trees, None, dtype=dtype, l2=l2, layout=layout, h=h, hv=hv, k=k, v=v, seed=9)
    check_verify(trees, "one", dtype=dtype, l2=l2, layout=layout, h=h, hv=hv, k=k, v=v, seed=9)


def test_one_node_kernel_guards_and_non_finite_inputs():
    """A state index outside the pool (checked by the kernel: the registered op skips the host checks) skips its
    request, outputs untouched, and raises VERIFY_STATE_INDEX; a NaN or Inf input reaches its own request's outputs
    and value heads and no others."""
    plan = gdn.build_tree_plan([[-1]] * 3)
    q, kk, vv, g, beta, pool = make_inputs(3, pool=4, seed=2)
    q[1, 0, 3] = float("nan")
    vv[2, 1, 5] = float("inf")

    def raw(idx):
        o = torch.full_like(vv, 7.0)
        torch.ops.specpilot_gdn.tree_verify(q, kk, vv, g, beta, o, pool, torch.tensor(idx, dtype=torch.int32),
                                            plan.cu_seqlens, plan.anc, plan.depth, plan.max_depth, plan.node_req,
                                            plan.sync, plan.err, K ** -0.5, True, False, "auto", plan.max_nodes)
        return o

    o = raw([3, 0, 1])
    assert plan.err.item() == 0
    rep = HV // H  # value heads 0 .. rep - 1 read key head 0
    assert o[1, :rep].isnan().all() and torch.isfinite(o[1, rep:]).all() and torch.isfinite(o[0]).all()
    assert not torch.isfinite(o[2, 1]).all() and torch.isfinite(o[2, 0]).all() and torch.isfinite(o[2, 2:]).all()
    for bad in (-1, 4, 100000):
        got = raw([3, bad, 1])
        assert (got[1] == 7.0).all(), "the skipped request was written"
        assert torch.equal(got[0], o[0])
        assert torch.equal(got[2].nan_to_num(1.0, 2.0, 3.0), o[2].nan_to_num(1.0, 2.0, 3.0))
        assert plan.err.item() == gdn.guard.VERIFY_STATE_INDEX
        with pytest.raises(gdn.GuardError, match="gdn.tree_verify: a state index is outside"):
            gdn.check_errors(plan)


def test_one_node_variant_refuses_larger_plans(verify_kernel):
    """variant="one" by name takes plans of one node a request only; a forced Triton config keeps its kernel."""
    from gdn.configs import WYConfig

    plan = gdn.build_tree_plan([chain(2)])
    q, kk, vv, g, beta, pool = make_inputs(2)
    with pytest.raises(ValueError, match="one node a request"):
        gdn.tree_verify(q, kk, vv, g, beta, pool, torch.tensor([0]), plan, variant="one")
    one = gdn.build_tree_plan([[-1]])
    with force("gdn.tree_verify", config=WYConfig()):
        assert verify_kernel(one, q[:1], kk[:1], vv[:1], g[:1], beta[:1], pool, torch.tensor([0])) == "wy"
    assert verify_kernel(one, q[:1], kk[:1], vv[:1], g[:1], beta[:1], pool, torch.tensor([0])) == "one"


def test_one_node_kernel_computes_a_gate_of_minus_inf():
    """README: a gate of -inf (a full decay) is NaN in the WY forms and computed by the sequential ones; the one-node
    kernel, which forms no WY product, computes it: the fp64 sequential step's value, within the derived bound."""
    plan = gdn.build_tree_plan([[-1], [-1]])
    q, kk, vv, g, beta, pool = make_inputs(2, pool=3, seed=4)
    g[0, 1] = float("-inf")
    idx = torch.tensor([2, 0])
    o = gdn.tree_verify(q, kk, vv, g, beta, pool, idx, plan, use_qk_l2norm=True)
    assert torch.isfinite(o).all()
    trees = [[-1], [-1]]
    r64 = tree_reference(q, kk, vv, g, beta, pool.double(), idx, trees, use_qk_l2norm=True, dtype=torch.float64)
    r32 = tree_reference(q, kk, vv, g, beta, pool, idx, trees, use_qk_l2norm=True, fn=recurrent_reference)
    assert_close(o, r64, r32)
