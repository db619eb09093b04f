"""GPU tests of the CUDA C++ tree-verify kernel (gdn/csrc/gdn_tree.cu, variant "cuda") at hybrid-27b
GDN dims: every specialisation it compiles (node tiles 16/32, BV, state pieces, both state layouts,
L2 norm on/off, g/beta dtypes, int64 slots, fp32 and bf16 output), ragged batches, hostile keys,
PDL chains in a CUDA graph. Outputs are poisoned with NaN first; the bound is derived (2x torch fp32)."""

import random

import pytest
import torch

import gdn
from autotune import force
from gdn import cuda as gcuda
from gdn.configs import CudaConfig
from gdn.reference import chunk_reference, tree_reference
from specpilot.bench.cases import chain, draft_tree
from specpilot.bench.cases.gdn import hostile
from specpilot.testing import assert_close, assert_replays_equal, capture_graph

pytestmark = pytest.mark.gpu
H, HV, K, V = 16, 48, 128, 128
DEV = "cuda"


@pytest.fixture(autouse=True)
def _need_cuda_kernel():
    why = gcuda.unavailable()
    if why is not None:
        pytest.skip(why)


def make(trees, seed, *, vk=False, gdt=torch.float32, bdt=torch.bfloat16, hostile_keys=False, pool_rows=None):
    plan = gdn.build_tree_plan(trees, device=DEV)
    T, B = plan.total_nodes, len(trees)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, H, K, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(T, H, K, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(T, HV, V, device=DEV, generator=gen).to(torch.bfloat16)
    g = -torch.rand(T, HV, device=DEV, generator=gen) * 0.5
    beta = torch.rand(T, HV, device=DEV, generator=gen)
    if hostile_keys:
        k, g, beta = (x[0] for x in hostile(k[None], g[None], beta[None], seed + 1))
    g, beta = g.to(gdt), beta.to(bdt)
    rows = pool_rows or B + 2
    pool = torch.randn(rows, HV, K, V, device=DEV, generator=gen) * 0.05
    if vk:
        pool = pool.transpose(-1, -2).contiguous()
    return plan, q, k, v, g, beta, pool


def check(plan, trees, q, k, v, g, beta, pool, idx, *, cfg=None, vk=False, l2=True, out_dtype=torch.float32, msg=""):
    T = plan.total_nodes
    out = torch.full((T, HV, V), float("nan"), device=DEV, dtype=out_dtype)
    with force("gdn.tree_verify", config=cfg) if cfg else _null():
        o = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=l2, state_layout="vk" if vk else "kv",
                            variant="cuda", out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), f"{msg}: unwritten outputs"
    kv = pool.transpose(-1, -2) if vk else pool
    slots = idx.tolist()
    r64 = tree_reference(q, k, v, g, beta, kv.double(), slots, trees, use_qk_l2norm=l2, dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, kv, slots, trees, use_qk_l2norm=l2, fn=chunk_reference)
    assert_close(o, r64, r32.to(out_dtype), msg=msg)
    return o


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


CONFIGS = {"bv32": CudaConfig(), "bv64": CudaConfig(BV=64), "bv16": CudaConfig(BV=16), "p2": CudaConfig(pieces=2),
           "nopdl": CudaConfig(pdl=False), "bv64-m1": CudaConfig(BV=64, min_blocks=1),
           "sw": CudaConfig(split_warps=True), "sw-bv32-vk": CudaConfig(BV=32, split_warps=True)}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("shape", ["n32", "chain32", "chain16", "b3-ragged"])
def test_cuda_matches_reference(shape, cfg):
    rng = random.Random(5)
    trees = {"n32": [draft_tree(32, rng)], "chain32": [chain(32)], "chain16": [chain(16)],
             "b3-ragged": [draft_tree(29, rng), [-1], chain(7)]}[shape]
    vk = cfg.endswith("-vk")
    plan, q, k, v, g, beta, pool = make(trees, 3, vk=vk)
    idx = torch.arange(len(trees), device=DEV, dtype=torch.int32).flip(0) + 1
    c = CONFIGS[cfg]
    if cfg == "p2":  # 16 mantissa bits of the state: checked at the bf16 output it serves
        check(plan, trees, q, k, v, g, beta, pool, idx, cfg=c, out_dtype=torch.bfloat16, msg=f"{cfg} {shape}")
    else:
        check(plan, trees, q, k, v, g, beta, pool, idx, cfg=c, vk=vk, msg=f"{cfg} {shape}")


@pytest.mark.parametrize("case", ["vk", "nol2", "gbf16-bfp32", "idx64", "bf16out", "star16", "single", "b24-n8"])
def test_cuda_specialisations(case):
    rng = random.Random(11)
    trees = [draft_tree(32, rng)]
    kw = {}
    if case == "vk":
        kw = dict(vk=True)
    elif case == "gbf16-bfp32":
        kw = dict(gdt=torch.bfloat16, bdt=torch.float32)
    elif case == "star16":
        trees = [[-1] + [0] * 15]
    elif case == "single":
        trees = [[-1], [-1]]
    elif case == "b24-n8":
        trees = [draft_tree(8, rng) for _ in range(24)]
    plan, q, k, v, g, beta, pool = make(trees, 4, **kw)
    idx = torch.arange(len(trees), device=DEV, dtype=torch.int64 if case == "idx64" else torch.int32)
    check(plan, trees, q, k, v, g, beta, pool, idx, vk=case == "vk", l2=case != "nol2",
          out_dtype=torch.bfloat16 if case == "bf16out" else torch.float32, msg=case)


@pytest.mark.parametrize("shape", ["chain32", "n32"])
def test_cuda_correlated_keys(shape):
    """Substitution needs no guard: keys nearly parallel (corr 0.95), beta near 1, gates near 0."""
    trees = {"chain32": [chain(32)], "n32": [draft_tree(32, random.Random(9))]}[shape]
    plan, q, k, v, g, beta, pool = make(trees, 10, hostile_keys=True)
    check(plan, trees, q, k, v, g, beta, pool, torch.zeros(1, device=DEV, dtype=torch.int32), msg=shape)


def test_cuda_is_default_where_supported_and_falls_back():
    trees = [draft_tree(32, random.Random(2))]
    plan, q, k, v, g, beta, pool = make(trees, 6)
    idx = torch.zeros(1, device=DEV, dtype=torch.int32)
    want = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="cuda")
    got = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cannot take this call"):
        gdn.tree_verify(q.float(), k.float(), v.float(), g, beta, pool, idx, plan, variant="cuda")
    o = gdn.tree_verify(q.float(), k.float(), v.float(), g, beta, pool, idx, plan, use_qk_l2norm=True)  # -> wy
    assert o.dtype == torch.float32 and not torch.isnan(o).any()


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.hopper)])
def test_cuda_pdl_chain_in_graph(pdl):
    """Each launch reads, as v, the previous launch's output: with PDL the kernel may only prefetch
    before griddepcontrol.wait. 20 graph replays equal eager launches bitwise."""
    trees = [draft_tree(32, random.Random(8))]
    plan, q, k, v, g, beta, pool = make(trees, 8)
    idx = torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = [torch.empty(plan.total_nodes, HV, V, device=DEV, dtype=torch.bfloat16) for _ in range(6)]
    cfg = CudaConfig(pdl=pdl)

    def chain_launches():
        src = v
        with force("gdn.tree_verify", config=cfg):
            for o in outs:
                gdn.tree_verify(q, k, src, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="cuda", out=o)
                src = o

    want, src = [], v
    with force("gdn.tree_verify", config=CudaConfig(pdl=False)):
        for _ in outs:
            src = gdn.tree_verify(q, k, src, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="cuda")
            want.append(src)
    assert_replays_equal(capture_graph(chain_launches), outs, want)
