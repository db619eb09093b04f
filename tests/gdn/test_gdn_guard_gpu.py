"""GPU index guards and NaN containment of the gdn kernels (issue 17), small shapes and few launches so that the
file also runs under `compute-sanitizer --tool memcheck` (/work/plan/gpu_gdn_guard.sh; with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 every tensor is its own allocation, so an access past one is reported).

Indices live on the device here, so no host check runs: each bad request must be skipped by the kernel (its
output rows and states untouched), every other request must be as in a clean call, and gdn.check_errors(plan)
must raise once and clear the word."""

import contextlib

import pytest
import torch

import gdn
from autotune import force
from gdn import guard
from gdn.configs import WYConfig
from gdn.reference import commit_reference, root_path

pytestmark = pytest.mark.gpu

H, HV, K, V = 2, 4, 128, 64
TREE = [-1, 0, 0, 1, 1, 2, 3]  # subtree of 1 = {1, 3, 4, 6}


def _cuda_ok():
    from gdn import cuda as gcuda

    return torch.cuda.is_available() and gcuda.available(torch.device("cuda"))


PATHS = {
    "cuda": (dict(variant="cuda"), None),
    "wy": (dict(variant="wy"), WYConfig(BV=32, inverse="square")),
    "wy-split": (dict(variant="wy"), WYConfig(BV=32, inverse="split", stack=True, inverse_stack=True)),
    "wy-flag": (dict(variant="wy"), WYConfig(BV=32, inverse="split", handoff="flag")),
    "wy-trans": (dict(variant="wy"), WYConfig(BV=64, inverse="levels", trans=True)),
    "recurrent": (dict(variant="recurrent"), None),
}


def _verify(path, plan, q, k, v, g, beta, pool, idx, out=None):
    if path == "cuda" and not _cuda_ok():
        pytest.skip("the CUDA C++ kernel cannot build here")
    kw, cfg = PATHS[path]
    with force("gdn.tree_verify", config=cfg) if cfg is not None else contextlib.nullcontext():
        return gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, out=out, **kw)


def _inputs(plan, pool_rows=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = plan.total_nodes
    q = torch.randn(T, H, K, generator=gen).bfloat16()
    k = torch.randn(T, H, K, generator=gen).bfloat16()
    v = torch.randn(T, HV, V, generator=gen).bfloat16()
    g = -torch.rand(T, HV, generator=gen) * 0.5
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(pool_rows, HV, K, V, generator=gen) * 0.3
    return [t.cuda() for t in (q, k, v, g, beta, pool)]


@pytest.mark.parametrize("path", list(PATHS))
def test_verify_guard_gpu(path):
    trees = [TREE, [-1, 0], [-1, 0, 0]]
    plan = gdn.build_tree_plan(trees, device="cuda")
    q, k, v, g, beta, pool = _inputs(plan)
    want = _verify(path, plan, q, k, v, g, beta, pool, torch.tensor([2, 0, 1], device="cuda"))
    gdn.check_errors(plan)
    for bad, dt in ((-1, torch.int32), (3, torch.int32), (2**31 - 1, torch.int32), (2**40, torch.int64)):
        out = torch.full_like(v, 7.0)
        _verify(path, plan, q, k, v, g, beta, pool, torch.tensor([2, bad, 1], device="cuda", dtype=dt), out=out)
        assert torch.equal(out[7:9], torch.full_like(out[7:9], 7.0)), f"{bad}: the skipped request was written"
        assert torch.equal(out[:7], want[:7]) and torch.equal(out[9:], want[9:])
        with pytest.raises(gdn.GuardError, match="state index is outside"):
            gdn.check_errors(plan)
        assert plan.err.item() == 0


@pytest.mark.parametrize("path", ["cuda", "wy", "recurrent"])
def test_positive_gate_flag_gpu(path):
    plan = gdn.build_tree_plan([TREE], device="cuda")
    q, k, v, g, beta, pool = _inputs(plan)
    g[3, 1] = 0.5
    _verify(path, plan, q, k, v, g, beta, pool, torch.tensor([0], device="cuda"))
    with pytest.raises(gdn.GuardError) as e:
        gdn.check_errors(plan)
    assert e.value.bits == guard.POSITIVE_GATE


@pytest.mark.parametrize("path", ["cuda", "wy", "wy-split", "wy-trans", "recurrent"])
def test_nan_stays_in_its_subtree_gpu(path):
    trees = [TREE, [-1, 0, 1]]
    plan = gdn.build_tree_plan(trees, device="cuda")
    ins = _inputs(plan, seed=3)
    idx = torch.tensor([1, 2], device="cuda")
    clean = _verify(path, plan, *ins, idx)
    assert torch.isfinite(clean).all()
    sub = [i for i in range(7) if 1 in root_path(TREE, i)]
    for field, node, bad in (("k", 1, float("nan")), ("v", 6, float("inf")), ("q", 1, float("nan")),
                             ("beta", 3, float("nan"))):
        dirty = [t.clone() for t in ins]
        dirty[["q", "k", "v", "g", "beta"].index(field)][node, 1] = bad
        o = _verify(path, plan, *dirty, idx)
        hit = [node] if field == "q" else [i for i in sub if node in root_path(TREE, i)]
        rest = [i for i in range(plan.total_nodes) if i not in hit]
        assert torch.equal(o[rest], clean[rest]), f"{path}: {field}[{node}] = {bad} reached a non-descendant"
        heads = [2, 3] if field in ("q", "k") else [1]
        # NaN from the WY forms (by selection); the sequential form may also give +-Inf (an Inf v)
        assert (~torch.isfinite(o[hit][:, heads])).all()


def test_conv_guard_gpu():
    plan = gdn.build_tree_plan([TREE, [-1, 0]], device="cuda")
    x, cs, w = torch.randn(9, 64, device="cuda"), torch.randn(2, 64, 3, device="cuda"), torch.randn(64, 4, device="cuda")
    want = gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=torch.tensor([1, 0], device="cuda"))
    for bad in (2, -1, 2**31 - 1):
        out = torch.full_like(x, 7.0)
        gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=torch.tensor([1, bad], device="cuda"), out=out)
        assert torch.equal(out[:7], want[:7]) and torch.equal(out[7:], torch.full_like(out[7:], 7.0))
        with pytest.raises(gdn.GuardError, match="conv state index"):
            gdn.check_errors(plan)


@pytest.mark.parametrize("case", ["index", "huge-index", "conv-index", "node", "huge-node", "path", "non-root",
                                  "len-over", "len-negative"])
def test_commit_guard_gpu(case, corrupt_commit):
    trees = [[-1, 0, 1], [-1, 0, 0], [-1, 0]]
    plan = gdn.build_tree_plan(trees, device="cuda")
    gen = torch.Generator().manual_seed(1)
    L, T, D, W = 2, plan.total_nodes, 32, 4
    k, v = torch.randn(L, T, H, K, generator=gen), torch.randn(L, T, HV, V, generator=gen)
    g, beta = -torch.rand(L, T, HV, generator=gen), torch.rand(L, T, HV, generator=gen)
    x = torch.randn(L, T, D, generator=gen)
    pool, cs = torch.randn(L, 4, HV, K, V, generator=gen), torch.randn(L, 4, D, W - 1, generator=gen)
    paths = [[0, 1, 2], [0, 2], [0]]
    acc = torch.tensor([[0, 1, 2], [0, 2, 0], [0, 0, 0]], dtype=torch.int32)
    n = torch.tensor([3, 2, 1], dtype=torch.int32)
    idx, cidx = torch.tensor([3, 0, 2]), torch.tensor([3, 0, 2])
    corrupt_commit(case, idx, cidx, acc, n)
    dev = [t.cuda() for t in (pool, cs, k, v, g, beta, x, acc, n, idx, cidx)]
    gdn.commit(dev[0], dev[1], dev[9], plan, dev[7], dev[8], dev[2], dev[3], dev[4], dev[5], dev[6],
               use_qk_l2norm=True, conv_state_indices=dev[10])
    with pytest.raises(gdn.GuardError, match="gdn.commit"):
        gdn.check_errors(plan)
    got_p, got_c = dev[0].cpu(), dev[1].cpu()
    for r, row in ((0, 3), (2, 2)):
        bos = plan.cu_seqlens[r].item()
        for li in range(L):
            S, C = commit_reference(pool[li, row], cs[li, row], k[li], v[li], g[li], beta[li], x[li],
                                    [bos + j for j in paths[r]], use_qk_l2norm=True)
            torch.testing.assert_close(got_p[li, row], S, rtol=1e-4, atol=1e-4)
            assert torch.equal(got_c[li, row], C)
    assert torch.equal(got_p[:, 1], pool[:, 1]) and torch.equal(got_c[:, 1], cs[:, 1])
    assert case == "index" or case == "huge-index" or torch.equal(got_c[:, 0], cs[:, 0])
    assert case == "conv-index" or torch.equal(got_p[:, 0], pool[:, 0])


@pytest.mark.parametrize("path", ["cuda", "wy"])
def test_plan_nodes_guard_gpu(path):
    """A plan built on the device without a host look, max_nodes below a request's size: that request is skipped
    (node tile 16 < 18 nodes), the other is right."""
    par = torch.tensor(list(range(-1, 17)) + [-1, 0], dtype=torch.int32, device="cuda")
    plan = gdn.build_tree_plan(par, torch.tensor([0, 18, 20], device="cuda"), validate=False, max_nodes=4)
    small = gdn.build_tree_plan([[-1, 0]], device="cuda")
    q, k, v, g, beta, pool = _inputs(plan)
    out = torch.full_like(v, 7.0)
    _verify(path, plan, q, k, v, g, beta, pool, torch.tensor([0, 1], device="cuda"), out=out)
    with pytest.raises(gdn.GuardError, match="more nodes than the plan's max_nodes"):
        gdn.check_errors(plan)
    assert torch.equal(out[:18], torch.full_like(out[:18], 7.0))
    want = _verify(path, small, q[18:], k[18:], v[18:], g[18:], beta[18:], pool, torch.tensor([1], device="cuda"))
    torch.testing.assert_close(out[18:], want)  # (the two plans may pick different configs: bf16 tolerance)
