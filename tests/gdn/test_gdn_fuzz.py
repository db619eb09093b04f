"""Hypothesis fuzz of gdn's public API on the CPU: build_tree_plan, tree_verify, tree_conv1d, commit.

Random tree shapes (1-3 requests of 0-7 nodes), head splits, dims, dtypes (fp32/bf16/fp16 and the rejected int64,
fp64, bool), state and conv indices in and out of range (lists or tensors), accepted paths valid or corrupted, and
NaN/+-Inf placed in one node's input. The oracle for every example:
* a faulty call raises ValueError/TypeError whose message is "gdn.<fn>: <what>; <fix>", and writes no state (a
  kernel variant named on the torch path is one: it cannot run there);
* a valid call returns, and every output the fp64 sequential reference says is finite matches it; the nodes a
  non-finite input reaches are NaN (the dense forms) or, for the sequential form, what the fp64 recurrence gives.
Most examples run the torch path (TRITON_INTERPRET unset, as on a machine without a GPU); `test_fuzz_kernels`
runs a few through the Triton kernels under the interpreter. Examples are derandomized (fixed seeds).
`test_fuzz_device_guards*` call the kernels through the registered ops (no host checks) with wild rows,
lengths and nodes. Counts: FUZZ_EXAMPLES below (670 examples; `--hypothesis-show-statistics` shows how many were rejected calls).
"""

import math
import os
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gdn  # noqa: E402
from gdn.reference import commit_reference, conv_reference, recurrent_reference, root_path  # noqa: E402
from specpilot.testing import torch_path  # noqa: E402

FUZZ_EXAMPLES = {"plan": 150, "verify": 200, "conv": 120, "commit": 150, "kernels": 15, "device": 25,
                 "device_verify": 10}  # 670 examples
MESSAGE = re.compile(r"^gdn\.[a-z_0-9]+: .+; .+", re.S)
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


def rejected(e: Exception) -> None:
    event("rejected")
    assert isinstance(e, (ValueError, TypeError)), f"{type(e).__name__}: {e}"
    assert MESSAGE.match(str(e)), f"unclear message: {e}"


# --------------------------------------------------------------------------------------------- strategies


@st.composite
def trees(draw, max_b=3, max_n=7, allow_empty=True):
    B = draw(st.integers(1, max_b))
    out = []
    for _ in range(B):
        n = draw(st.integers(0 if allow_empty else 1, max_n))
        out.append([-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)] if n else [])
    return out


def descendants(par, x):
    return {i for i in range(len(par)) if x in root_path(par, i)}


BAD_DTYPES = [torch.int64, torch.float64, torch.bool]


def tensor(gen, shape, dtype, lo=-1.0, hi=1.0):
    t = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        return (t * 4).to(dtype)
    return t.to(dtype)


# --------------------------------------------------------------------------------------------- plan


@settings(max_examples=FUZZ_EXAMPLES["plan"], **SETTINGS)
@given(ts=trees(max_n=8), fault=st.sampled_from([None, "float", "self", "forward", "below", "string", "unwrapped"]),
       where=st.integers(0, 100))
def test_fuzz_plan(ts, fault, where):
    flat = [(r, i) for r, ps in enumerate(ts) for i in range(len(ps))]
    if fault == "unwrapped" and flat:  # one request's parent list passed without the outer list
        ts = list(ts[flat[where % len(flat)][0]])
    elif fault and flat:
        r, i = flat[where % len(flat)]
        ts[r][i] = {"float": ts[r][i] + 0.5, "self": i, "forward": len(ts[r]) + 1, "below": -2, "string": "0"}[fault]
    else:
        fault = None
    try:
        plan = gdn.build_tree_plan(ts)
    except Exception as e:  # noqa: BLE001
        assert fault, f"a valid tree was rejected: {e}"
        return rejected(e)
    assert not fault, f"{fault} parents accepted: {ts}"
    event("valid")
    depth = [len(root_path(ps, i)) - 1 for ps in ts for i in range(len(ps))]
    assert plan.depth.tolist() == depth and plan.total_nodes == len(depth) and plan.err.tolist() == [0]


# --------------------------------------------------------------------------------------------- tree_verify


def indices(draw, B, pool):
    # one pool row per request: in range three times in four, else anywhere in [-2, pool + 2]
    if draw(st.sampled_from([False, False, False, True])):
        return draw(st.lists(st.integers(-2, pool + 2), min_size=B, max_size=B))
    return draw(st.lists(st.integers(0, pool - 1), min_size=B, max_size=B))


@st.composite
def verify_case(draw):
    ts = draw(trees())
    H = draw(st.sampled_from([1, 2]))
    pool = draw(st.integers(1, 4))
    return dict(trees=ts, H=H, HV=H * draw(st.sampled_from([1, 2])), K=draw(st.sampled_from([4, 8, 16])),
                V=draw(st.sampled_from([4, 8, 16])), pool=pool,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                bad_dtype=draw(st.sampled_from([None] * 30 + [(f, d) for f in "qkvgb" for d in BAD_DTYPES])),
                idx=indices(draw, len(ts), pool),
                as_list=draw(st.booleans()), l2=draw(st.booleans()), layout=draw(st.sampled_from(["kv", "vk"])),
                nonfinite=draw(st.sampled_from([None] * 15 + [(f, x) for f in "qkvgb"
                                                               for x in (math.nan, math.inf, -math.inf)])),
                node=draw(st.integers(0, 100)), seed=draw(st.integers(0, 2**16)),
                positive=draw(st.sampled_from([False] * 7 + [True])))


def run_verify(c, variant):
    gen = torch.Generator().manual_seed(c["seed"])
    plan = gdn.build_tree_plan(c["trees"])
    T, H, HV, K, V, dt = plan.total_nodes, c["H"], c["HV"], c["K"], c["V"], c["dtype"]
    ins = {"q": tensor(gen, (T, H, K), dt), "k": tensor(gen, (T, H, K), dt), "v": tensor(gen, (T, HV, V), dt),
           "g": tensor(gen, (T, HV), dt, -1.0, 0.0), "b": tensor(gen, (T, HV), dt, 0.0, 1.0)}
    if c["positive"] and T:
        ins["g"][c["node"] % T, 0] = 0.25
    poison = set()
    if c["nonfinite"] and T:
        f, x = c["nonfinite"]
        node = c["node"] % T
        ins[f].view(T, -1)[node, 0] = x
        r = int(torch.searchsorted(plan.cu_seqlens[1:], torch.tensor(node), right=True))
        bos = int(plan.cu_seqlens[r])
        poison = {node} if f == "q" else {bos + i for i in descendants(c["trees"][r], node - bos)}
    if c["bad_dtype"]:
        f, d = c["bad_dtype"]
        ins[f] = ins[f].to(d)
    pool = torch.randn(c["pool"], HV, K, V, generator=gen) * 0.5
    pool_arg = pool.transpose(-1, -2).contiguous() if c["layout"] == "vk" else pool
    idx = c["idx"] if c["as_list"] else torch.tensor(c["idx"], dtype=torch.int32)
    # a kernel variant named for CPU tensors without the interpreter cannot run: it raises, never runs the torch path
    no_kernel = variant not in (None, "reference") and os.environ.get("TRITON_INTERPRET") != "1"
    fault = (c["bad_dtype"] is not None or any(not 0 <= i < c["pool"] for i in c["idx"])
             or (T and bool((ins["g"].float() > 0).any())) or no_kernel)
    keep = pool_arg.clone()
    try:
        o = gdn.tree_verify(ins["q"], ins["k"], ins["v"], ins["g"], ins["b"], pool_arg, idx, plan,
                            use_qk_l2norm=c["l2"], state_layout=c["layout"], variant=variant)
    except Exception as e:  # noqa: BLE001
        assert fault, f"a valid call was rejected: {e}"
        rejected(e)
        assert torch.equal(pool_arg, keep)
        return
    assert not fault, "a faulty call returned"
    event("valid" + (", non-finite input" if poison else ""))
    assert o.shape == (T, HV, V) and o.dtype == dt
    if not T:
        return
    lists, r64 = c["trees"], []
    bos = 0
    for r, ps in enumerate(lists):
        sl = slice(bos, bos + len(ps))
        if ps:
            r64.append(recurrent_reference(ins["q"][sl], ins["k"][sl], ins["v"][sl], ins["g"][sl], ins["b"][sl],
                                           pool[c["idx"][r]].double(), parents=ps, use_qk_l2norm=c["l2"],
                                           dtype=torch.float64))
        bos += len(ps)
    ref = torch.cat(r64)
    tol = 2e-4 if dt == torch.float32 else 3e-2
    for i in range(T):
        if i in poison:
            ok = torch.isnan(o[i]) | torch.isclose(o[i].double(), ref[i], rtol=tol, atol=tol, equal_nan=True)
            assert ok.all(), f"node {i} (reached by a non-finite input): neither NaN nor the recurrence"
        else:
            assert torch.isfinite(o[i]).all(), f"node {i}: a non-finite input reached a non-descendant"
            torch.testing.assert_close(o[i].double(), ref[i], rtol=tol, atol=tol, msg=f"node {i}")


@settings(max_examples=FUZZ_EXAMPLES["verify"], **SETTINGS)
@given(c=verify_case(), variant=st.sampled_from([None, "wy", "recurrent", "reference"]))
def test_fuzz_verify(c, variant):
    with torch_path():
        run_verify(c, variant)


# --------------------------------------------------------------------------------------------- tree_conv1d


@st.composite
def conv_case(draw):
    ts = draw(trees())
    pool = draw(st.integers(max(1, len(ts) - 1), 3))
    return dict(trees=ts, D=draw(st.integers(1, 12)), W=draw(st.integers(2, 4)), pool=pool,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                bad_dtype=draw(st.sampled_from([None] * 12 + BAD_DTYPES)), bias=draw(st.booleans()),
                idx=None if draw(st.booleans()) else indices(draw, len(ts), pool),
                silu=draw(st.booleans()), nonfinite=draw(st.sampled_from([None, math.nan, math.inf])),
                node=draw(st.integers(0, 100)), seed=draw(st.integers(0, 2**16)))


def run_conv(c):
    gen = torch.Generator().manual_seed(c["seed"])
    plan = gdn.build_tree_plan(c["trees"])
    T, D, W, dt = plan.total_nodes, c["D"], c["W"], c["dtype"]
    x = tensor(gen, (T, D), dt)
    cs = tensor(gen, (c["pool"], D, W - 1), dt)
    w = tensor(gen, (D, W), dt)
    bias = tensor(gen, (D,), dt) if c["bias"] else None
    if c["nonfinite"] is not None and T:
        x[c["node"] % T, 0] = c["nonfinite"]
    if c["bad_dtype"] is not None:
        x = x.to(c["bad_dtype"])
    rows = list(range(len(c["trees"]))) if c["idx"] is None else c["idx"]
    fault = c["bad_dtype"] is not None or any(not 0 <= i < c["pool"] for i in rows)
    try:
        y = gdn.tree_conv1d(x, cs, w, plan, bias=bias, activation="silu" if c["silu"] else None,
                            conv_state_indices=c["idx"])
    except Exception as e:  # noqa: BLE001
        assert fault, f"a valid call was rejected: {e}"
        return rejected(e)
    assert not fault, "a faulty call returned"
    event("valid")
    if not T:
        return
    ref = conv_reference(x, cs, w, c["trees"], bias, "silu" if c["silu"] else None, rows, dtype=torch.float64)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol, equal_nan=True)


@settings(max_examples=FUZZ_EXAMPLES["conv"], **SETTINGS)
@given(c=conv_case())
def test_fuzz_conv(c):
    with torch_path():
        run_conv(c)


# --------------------------------------------------------------------------------------------- commit


@st.composite
def commit_case(draw):
    ts = draw(trees(allow_empty=False))
    paths = []
    for ps in ts:
        leaf = draw(st.integers(0, len(ps) - 1))
        paths.append(root_path(ps, leaf)[:draw(st.integers(0, len(ps)))])
    H = draw(st.sampled_from([1, 2]))
    return dict(trees=ts, paths=paths, L=draw(st.integers(1, 2)), H=H, HV=H * draw(st.sampled_from([1, 2])),
                K=draw(st.sampled_from([4, 8])), V=draw(st.sampled_from([4, 8])), D=draw(st.integers(1, 6)),
                W=draw(st.integers(2, 4)), pool=draw(st.integers(len(ts), len(ts) + 2)),
                parts=draw(st.sampled_from(["both", "state", "conv"])), single=draw(st.booleans()),
                fault=draw(st.sampled_from([None] * 4 + ["index", "dup", "cindex", "node", "nonroot", "len", "neg",
                                                        "dtype", "gate"])),
                which=draw(st.integers(0, 100)), seed=draw(st.integers(0, 2**16)))


def run_commit(c):
    gen = torch.Generator().manual_seed(c["seed"])
    ts, B = c["trees"], len(c["trees"])
    plan = gdn.build_tree_plan(ts)
    T, L, H, HV, K, V, D, W = plan.total_nodes, c["L"], c["H"], c["HV"], c["K"], c["V"], c["D"], c["W"]
    L = 1 if c["single"] else L
    k, v = tensor(gen, (L, T, H, K), torch.float32), tensor(gen, (L, T, HV, V), torch.float32)
    g, beta = tensor(gen, (L, T, HV), torch.float32, -1.0, 0.0), tensor(gen, (L, T, HV), torch.float32, 0.0, 1.0)
    x = tensor(gen, (L, T, D), torch.float32)
    pool = torch.randn(L, c["pool"], HV, K, V, generator=gen)
    cs = torch.randn(L, c["pool"], D, W - 1, generator=gen)
    perm = torch.randperm(c["pool"], generator=gen)[:B].tolist()
    idx, cidx = list(perm), list(perm)
    max_len = max(len(p) for p in c["paths"]) + 1
    acc = torch.zeros(B, max_len, dtype=torch.int64)
    for r, p in enumerate(c["paths"]):
        acc[r, :len(p)] = torch.tensor(p, dtype=torch.int64)
    n = torch.tensor([len(p) for p in c["paths"]])
    r = c["which"] % B
    f = c["fault"]
    if f == "index":
        idx[r] = c["pool"] + r
    elif f == "dup" and B > 1:
        idx[(r + 1) % B] = idx[r]
    elif f == "cindex":
        cidx[r] = -1
    elif f == "node":
        acc[r, 0] = len(ts[r])
        n[r] = max(int(n[r]), 1)
    elif f == "nonroot" and any(p >= 0 for p in ts[r]):
        inner = [i for i, p in enumerate(ts[r]) if p >= 0]  # a node that is not a root
        acc[r, 0], n[r] = inner[c["which"] % len(inner)], 1
    elif f == "len":
        n[r] = max_len + 1
    elif f == "neg":
        n[r] = -1
    elif f == "dtype":
        k = k.double()
    elif f == "gate":
        g[0, 0, 0] = 0.5
    else:
        f = None
    state = c["parts"] in ("both", "state")
    conv = c["parts"] in ("both", "conv")
    if f in ("cindex",) and not conv:
        f = None
    if f in ("dtype", "gate") and not state:
        f = None
    p0, c0 = pool.clone(), cs.clone()
    sq = (lambda t: t[0]) if c["single"] else (lambda t: t)
    args = dict(k=sq(k) if state else None, v=sq(v) if state else None, g=sq(g) if state else None,
                beta=sq(beta) if state else None, x=sq(x) if conv else None, use_qk_l2norm=True,
                conv_state_indices=cidx)
    try:
        gdn.commit(sq(pool) if state else None, sq(cs) if conv else None, idx, plan, acc, n, **args)
    except Exception as e:  # noqa: BLE001
        assert f, f"a valid commit was rejected: {e}"
        rejected(e)
        assert torch.equal(pool, p0) and torch.equal(cs, c0), "a rejected commit wrote a state"
        return
    assert not f, f"a faulty commit ({f}) returned"
    event("valid")
    cu = plan.cu_seqlens.tolist()
    for r, p in enumerate(c["paths"]):
        for li in range(L):
            S, C = commit_reference(p0[li, idx[r]], c0[li, cidx[r]], k[li], v[li], g[li], beta[li], x[li],
                                    [cu[r] + j for j in p], use_qk_l2norm=True)
            if state:
                torch.testing.assert_close(pool[li, idx[r]], S, rtol=1e-5, atol=1e-5)
            if conv:
                assert torch.equal(cs[li, cidx[r]], C)
    for row in set(range(c["pool"])) - set(idx):
        assert torch.equal(pool[:, row], p0[:, row]) and torch.equal(cs[:, row], c0[:, row])


@settings(max_examples=FUZZ_EXAMPLES["commit"], **SETTINGS)
@given(c=commit_case())
def test_fuzz_commit(c):
    with torch_path():
        run_commit(c)


# --------------------------------------------------------------------------------------------- kernels


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need the interpreter or a GPU")
@settings(max_examples=FUZZ_EXAMPLES["kernels"], **SETTINGS)
@given(vc=verify_case(), cc=conv_case(), mc=commit_case(), variant=st.sampled_from(["wy", "recurrent"]))
def test_fuzz_kernels(vc, cc, mc, variant):
    """The same oracles through the Triton kernels (interpreter): small trees only (each call takes seconds)."""
    vc["trees"] = [t[:4] for t in vc["trees"]][:2]
    vc["idx"] = vc["idx"][:len(vc["trees"])]
    run_verify(vc, variant)
    run_conv(cc)
    run_commit(mc)



@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need the interpreter or a GPU")
@settings(max_examples=FUZZ_EXAMPLES["device"], **SETTINGS)
@given(mc=commit_case(), rows=st.lists(st.integers(-(2**40), 2**40), min_size=2, max_size=2),
       lens=st.lists(st.integers(-3, 12), min_size=1, max_size=3), nodes=st.lists(st.integers(-70, 70), min_size=3,
                                                                                    max_size=3))
def test_fuzz_device_guards(mc, rows, lens, nodes):
    """Indices that only the kernels see (the registered ops hold no host checks): wild pool rows, accepted
    lengths and nodes. Every request whose row or path is bad keeps its states; the others match the reference;
    check_errors raises exactly when some request was bad."""
    ts, B = mc["trees"], len(mc["trees"])
    plan = gdn.build_tree_plan(ts)
    gen = torch.Generator().manual_seed(mc["seed"])
    T, L, D, W = plan.total_nodes, 1, 4, 3
    k, v = torch.randn(L, T, 1, 4, generator=gen), torch.randn(L, T, 2, 4, generator=gen)
    g, beta = -torch.rand(L, T, 2, generator=gen), torch.rand(L, T, 2, generator=gen)
    x = torch.randn(L, T, D, generator=gen)
    P = B + 1
    pool, cs = torch.randn(L, P, 2, 4, 4, generator=gen), torch.randn(L, P, D, W - 1, generator=gen)
    idx = list(range(B))
    acc = torch.zeros(B, 4, dtype=torch.int64)
    n = torch.zeros(B, dtype=torch.int64)
    for r, p in enumerate(mc["paths"]):
        acc[r, :len(p[:4])] = torch.tensor(p[:4], dtype=torch.int64)
        n[r] = len(p[:4])
    r = mc["which"] % B
    kind = mc["which"] % 3
    if kind == 0:
        idx[r] = rows[0] if not 0 <= rows[0] < P else -1
    elif kind == 1:
        n[r] = lens[0]  # in or out of [0, max_len]
    else:
        acc[r, 0] = nodes[0]
        n[r] = max(int(n[r]), 1)
    good = [0 <= idx[i] < P for i in range(B)]
    for i, ps in enumerate(ts):
        m = int(n[i])
        path_ok = 0 <= m <= 4 and all(0 <= int(acc[i, j]) < len(ps) for j in range(m))
        if path_ok and m:  # the root path of its last node, whole
            path_ok = [int(a) for a in acc[i, :m]] == root_path(ps, int(acc[i, m - 1]))
        good[i] = good[i] and path_ok
    p0, c0 = pool.clone(), cs.clone()
    idx_t = torch.tensor(idx, dtype=torch.int64)
    torch.ops.specpilot_gdn.commit(pool, k, v, g, beta, idx_t, plan.cu_seqlens, acc, n, plan.parent_local, plan.err,
                                   True, False, cs, x, idx_t, "triton")
    if all(good):
        gdn.check_errors(plan)
    else:
        with pytest.raises(gdn.GuardError, match="gdn.commit"):
            gdn.check_errors(plan)
    cu = plan.cu_seqlens.tolist()
    for i in range(B):
        if not 0 <= idx[i] < P:
            continue
        if good[i]:
            S, C = commit_reference(p0[0, idx[i]], c0[0, idx[i]], k[0], v[0], g[0], beta[0], x[0],
                                    [cu[i] + int(a) for a in acc[i, :int(n[i])]], use_qk_l2norm=True)
            torch.testing.assert_close(pool[0, idx[i]], S, rtol=1e-5, atol=1e-5)
            assert torch.equal(cs[0, idx[i]], C)
        else:
            assert torch.equal(pool[0, idx[i]], p0[0, idx[i]]) and torch.equal(cs[0, idx[i]], c0[0, idx[i]])
    assert torch.equal(pool[0, B:], p0[0, B:]) and torch.equal(cs[0, B:], c0[0, B:])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need the interpreter or a GPU")
@settings(max_examples=FUZZ_EXAMPLES["device_verify"], **SETTINGS)
@given(ts=trees(max_b=2, max_n=4, allow_empty=False), rows=st.lists(st.integers(-(2**40), 2**40), min_size=2,
                                                                    max_size=2),
       variant=st.sampled_from(["wy", "recurrent"]), seed=st.integers(0, 2**16))
def test_fuzz_device_guards_verify_conv(ts, rows, variant, seed):
    """tree_verify's and tree_conv1d's kernels through the registered ops with wild pool rows: a request with a
    bad row keeps its output rows, the others are as with a valid row there, and the word names the op."""
    plan = gdn.build_tree_plan(ts)
    B, T = len(ts), plan.total_nodes
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, 1, 8, generator=gen), torch.randn(T, 1, 8, generator=gen)
    v, g, beta = torch.randn(T, 2, 8, generator=gen), -torch.rand(T, 2, generator=gen), torch.rand(T, 2, generator=gen)
    pool = torch.randn(B, 2, 8, 8, generator=gen)
    x, cs, w = torch.randn(T, 8, generator=gen), torch.randn(B, 8, 2, generator=gen), torch.randn(8, 3, generator=gen)
    idx = torch.arange(B, dtype=torch.int64)
    bad = idx.clone()
    bad[-1] = rows[0] if not 0 <= rows[0] < B else -1 - rows[0] % 7
    cu = plan.cu_seqlens.tolist()
    last = slice(cu[-2], cu[-1])

    def verify(ix):
        o = torch.full_like(v, 7.0)
        torch.ops.specpilot_gdn.tree_verify(q, k, v, g, beta, o, pool, ix, plan.cu_seqlens, plan.anc, plan.depth,
                                            plan.max_depth, plan.node_req, plan.sync, plan.err, 8 ** -0.5, True,
                                            False, variant, plan.max_nodes)
        return o

    def conv(ix):
        y = torch.full_like(x, 7.0)
        torch.ops.specpilot_gdn.tree_conv1d(x, w, None, y, cs, ix, plan.node_req, plan.parent, plan.depth, plan.err,
                                            True, "triton")
        return y

    for op, name in ((verify, "tree_verify"), (conv, "tree_conv1d")):
        want = op(idx)
        gdn.check_errors(plan)
        got = op(bad)
        with pytest.raises(gdn.GuardError, match=f"gdn.{name}"):
            gdn.check_errors(plan)
        assert torch.equal(got[:cu[-2]], want[:cu[-2]])
        assert torch.equal(got[last], torch.full_like(got[last], 7.0))
