"""CPU checks of the CUDA C++ tree-verify kernel (gdn/csrc/gdn_tree.cu, variant "cuda") without a GPU.

1. `emulate` replays the kernel's algorithm in torch, per (request, value head), in its order: root-path gate
   sums from the ancestor bits, row norms, the exact bf16 gram, M and A masked before exp, N = M (I + A)^-1 by
   right-looking substitution (columns right to left, one row per lane), the state split into bf16 pieces,
   O = exp(G) rq (Q S0) + N rhs. In fp32 it must meet the derived bound against fp64, including on the
   hostile keys that make the doubling inverses lose every digit (substitution needs no guard).
2. The state split: hi + mid + lo reconstructs every normal fp32 exactly; two pieces keep 16 mantissa bits.
3. NVRTC (autotune.jit, no GPU needed) compiles the shipped specialisations for sm_80 and sm_90: mma.sync,
   cp.async, no local memory, griddepcontrol only with PDL, timer reads only when tracing; the default
   specialisation has no stack and no spills.
4. Dispatch: the default falls back to the Triton kernel wherever "cuda" cannot run; asked for by name, it
   says why; configs are validated.
"""

import random

import pytest
import torch

import gdn
from autotune import force
from gdn import cuda as gcuda
from gdn.configs import CudaConfig, WYConfig
from gdn.reference import chunk_reference, tree_reference
from specpilot.bench.cases import chain, draft_tree
from specpilot.testing import assert_close

H, HV, K, V = 2, 4, 32, 16


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def split_state(x: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """The kernel's split_pair: each piece is the bf16 rounding of what the pieces before it left over (exact for
    |x| between 2^-110 and bf16's largest finite value, test_state_split_exact_with_three_pieces)."""
    hi = bf16_round(x)
    mid = bf16_round(x - hi)
    out = [hi, mid, bf16_round(x - hi - mid)]
    return out[:pieces]


def solve_rows(M: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """N = M (I + A)^-1 as the solver warp computes it: once column l is final, every column j < l takes
    -N[:, l] A[l, j] (rows are independent lanes)."""
    N = M.clone()
    for col in range(M.shape[1] - 1, 0, -1):
        N[:, :col] = torch.addcmul(N[:, :col], -N[:, col:col + 1], A[col:col + 1, :col])
    return N


def emulate(q, k, v, g, beta, pool, idx, trees, scale, l2, pieces=3, solve=solve_rows, out=None, err=None):
    """The kernel's guards too: a request whose state index is outside the pool is skipped (its rows of `out` are
    left as they are) and bit 1 is OR-ed into `err` (an int32 [1] tensor), a gate g > 0 ORs 64. Non-finite entries
    of v, g, beta read as 0; those of q and k stay in the products, as in the kernel: a q row's only in its own rows
    (M, N, Q S0), a k row's cut where rows meet (its entries of A and its rhs row are 0). The nodes they reach (q:
    the node; the others: its subtree) output NaN."""
    T, Hq, Kd = q.shape
    HVd, Vd = v.shape[1], v.shape[2]
    out = torch.zeros(T, HVd, Vd) if out is None else out
    err = torch.zeros(1, dtype=torch.int32) if err is None else err
    bos = 0
    for r, par in enumerate(trees):
        n = len(par)
        if not 0 <= int(idx[r]) < pool.shape[0]:
            err |= 1
            bos += n
            continue
        anc = [0] * n
        for i, p in enumerate(par):
            anc[i] = (1 << i) | (anc[p] if p >= 0 else 0)
        mask_incl = torch.tensor([[bool(anc[i] >> j & 1) for j in range(n)] for i in range(n)])
        mask = mask_incl & ~torch.eye(n, dtype=torch.bool)
        for hv in range(HVd):
            h = hv // (HVd // Hq)
            qq, kk = q[bos:bos + n, h].float(), k[bos:bos + n, h].float()
            vv, gg, bb = v[bos:bos + n, hv].float(), g[bos:bos + n, hv].float(), beta[bos:bos + n, hv].float()
            if (gg > 0).any():
                err |= 64
            bad_q = ~torch.isfinite(qq).all(1)
            bad_s = ~(torch.isfinite(kk).all(1) & torch.isfinite(vv).all(1) & torch.isfinite(gg) & torch.isfinite(bb))
            bad_k = ~torch.isfinite(kk).all(1)
            vv, gg, bb = (torch.where(torch.isfinite(t), t, torch.zeros(())) for t in (vv, gg, bb))
            S = pool[idx[r], hv].float()
            G = torch.stack([sum((gg[j] for j in range(n) if anc[i] >> j & 1), torch.tensor(0.0)) for i in range(n)])
            rq = scale / torch.sqrt((qq * qq).sum(1) + 1e-6) if l2 else torch.full((n,), scale)
            rk = 1 / torch.sqrt((kk * kk).sum(1) + 1e-6) if l2 else torch.ones(n)
            QK = (qq.double() @ kk.double().T).float()  # bf16 products are exact; fp32 sums
            KK = (kk.double() @ kk.double().T).float()
            D = torch.exp(torch.where(mask_incl, G[:, None] - G[None, :], torch.zeros(())))
            M = torch.where(mask_incl, rq[:, None] * (rk[None, :] * D) * QK, torch.zeros(()))
            mask_a = mask & ~bad_k[:, None] & ~bad_k[None, :]
            A = torch.where(mask_a, (bb * rk)[:, None] * (rk[None, :] * D) * KK, torch.zeros(()))
            N = solve(M, A)
            parts = split_state(S, pieces)
            P_q = qq @ parts[0] + sum((qq @ p for p in parts[1:]), torch.zeros(n, Vd))
            P_k = kk @ parts[0] + sum((kk @ p for p in parts[1:]), torch.zeros(n, Vd))
            eG = torch.exp(G)
            rhs = torch.where(bad_k[:, None], torch.zeros(()), bb[:, None] * (vv - (eG * rk)[:, None] * P_k))
            o = (eG * rq)[:, None] * P_q + N @ rhs
            poison = bad_q | (mask_incl & bad_s[None, :]).any(1)
            out[bos:bos + n, hv] = torch.where(poison[:, None], torch.full((), float("nan")), o)
        bos += n
    return out


def inputs(trees, seed, corr=0.0, l2=True):
    T = sum(len(t) for t in trees)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    if corr:
        k = corr * torch.randn(1, H, K, generator=gen) + (1 - corr ** 2) ** 0.5 * k
    if not l2:
        q, k = q / K ** 0.5, k / K ** 0.5
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * (0.02 if corr else 0.5)
    beta = 0.9 + 0.1 * torch.rand(T, HV, generator=gen) if corr else torch.rand(T, HV, generator=gen)
    pool = torch.randn(len(trees) + 1, HV, K, V, generator=gen) * 0.3
    return [t.to(torch.bfloat16) for t in (q, k, v)] + [g, beta.to(torch.bfloat16), pool]


CASES = {
    "n32": lambda rng: [draft_tree(32, rng)],
    "chain32": lambda rng: [chain(32)],
    "star16": lambda rng: [[-1] + [0] * 15],
    "ragged": lambda rng: [draft_tree(13, rng), [-1], chain(7), [-1, -1, 0, 1]],
}


@pytest.mark.parametrize("l2", [True, False], ids=["l2", "nol2"])
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_kernel_meets_the_fp32_bound(case, l2):
    trees = CASES[case](random.Random(3))
    q, k, v, g, beta, pool = inputs(trees, 5, l2=l2)
    idx = list(range(1, len(trees) + 1))
    o = emulate(q, k, v, g, beta, pool, idx, trees, K ** -0.5, l2)
    r64 = tree_reference(q, k, v, g, beta, pool.double(), idx, trees, use_qk_l2norm=l2, dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, pool, idx, trees, use_qk_l2norm=l2, fn=chunk_reference)
    assert_close(o, r64, r32, msg=case)


@pytest.mark.parametrize("case", ["chain32", "n32"])
def test_emulated_substitution_needs_no_guard_on_hostile_keys(case):
    """Keys nearly parallel (corr 0.95), beta near 1, gates near 0: the doubling inverses need their guard's
    fallback here (docs/gdn.md); the kernel's substitution has no fallback and must stay within the bound."""
    trees = CASES[case](random.Random(9))
    q, k, v, g, beta, pool = inputs(trees, 11, corr=0.95)
    o = emulate(q, k, v, g, beta, pool, [0], trees, K ** -0.5, True)
    r64 = tree_reference(q, k, v, g, beta, pool.double(), [0], trees, use_qk_l2norm=True, dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, pool, [0], trees, use_qk_l2norm=True, fn=chunk_reference)
    assert_close(o, r64, r32, msg=case)


def test_emulation_fails_when_a_substitution_term_is_dropped():
    """The emulation's check can fail: dropping the last column's update breaks the bound."""
    trees = [chain(32)]
    q, k, v, g, beta, pool = inputs(trees, 11, corr=0.95)
    r64 = tree_reference(q, k, v, g, beta, pool.double(), [0], trees, use_qk_l2norm=True, dtype=torch.float64)
    r32 = tree_reference(q, k, v, g, beta, pool, [0], trees, use_qk_l2norm=True, fn=chunk_reference)

    def broken(M, A):
        A = A.clone()
        A[-1] = 0
        return solve_rows(M, A)

    o = emulate(q, k, v, g, beta, pool, [0], trees, K ** -0.5, True, solve=broken)
    with pytest.raises(AssertionError):
        assert_close(o, r64, r32)


def test_state_split_exact_with_three_pieces():
    gen = torch.Generator().manual_seed(0)
    mant = torch.rand(200_000, generator=gen) + 1.0
    expo = torch.randint(-100, 100, (200_000,), generator=gen).float()
    sign = torch.where(torch.rand(200_000, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign * mant * torch.exp2(expo)).float()
    # the claim holds up to bf16's largest finite value (3.39e38: above it the hi piece rounds to inf) and down
    # to where the lo piece stays normal (|x| >= 2^-110); far outside anything a recurrent state holds
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 3.38e38, -3.38e38, 2.0 ** -110, 0.1, 1 / 3])])
    hi, mid, lo = split_state(x, 3)
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double()), "3 bf16 pieces must be exact"
    hi, mid = split_state(x, 2)
    rel = ((hi.double() + mid.double() - x.double()).abs() / x.double().abs().clamp_min(1e-300)).max()
    assert rel <= 2.0 ** -16, f"2 pieces: relative error {rel:.3e} over 2^-16"


# ----------------------------------------------------------------------------------- NVRTC


SPECS = [  # (cfg, node tile, K, build keywords)
    (CudaConfig(), 32, 128, dict(pdl=True)),
    (CudaConfig(BV=32), 32, 128, dict(pdl=True, odt=0)),
    (CudaConfig(BV=16, pieces=2), 16, 128, dict(vk=True, idx64=True, gdt=1, bdt=0)),
    (CudaConfig(BV=8), 32, 64, dict(l2=False, odt=0)),
    (CudaConfig(BV=64), 16, 256, dict(vk=True, pdl=True)),
    (CudaConfig(split_warps=True), 32, 128, dict(pdl=True)),
    (CudaConfig(BV=16, split_warps=True), 16, 128, dict(vk=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("spec", range(len(SPECS)))
def test_kernel_builds_with_mma_and_no_local_memory(spec, arch, jit_cache):
    cfg, nt, kd, kw = SPECS[spec]
    kw = dict(kw)
    pdl = kw.pop("pdl", False) and arch[0] >= 9
    ptx = gcuda.spec(cfg, nt, kd, pdl=pdl, arch=arch, **kw).ptx().read_text()  # instructions: no ptxas needed
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx and "ldmatrix.sync.aligned" in ptx
    assert ".local" not in ptx, "a register array went to local memory"
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert "%globaltimer" not in ptx, "timer reads only in traced builds"


def test_default_cubin_has_no_spills_or_stack(jit_cache):
    res = gcuda.spec(CudaConfig(), 32, 128, pdl=True, arch=(9, 0)).compile().resources()
    assert (res["stack"], res["spill_stores"], res["spill_loads"]) == (0, 0, 0), res


def test_trace_and_skip_only_when_asked(jit_cache):
    ptx = gcuda.build(CudaConfig(trace=True), 32, 128, out="ptx").read_text()
    assert "%globaltimer" in ptx and "%clock64" in ptx


# ----------------------------------------------------------------------------------- dispatch


def _small_call(dtype=torch.bfloat16, n=6):
    trees = [draft_tree(n, random.Random(1))]
    plan = gdn.build_tree_plan(trees)
    q, k, v, g, beta, pool = inputs(trees, 2)
    return plan, [t.to(dtype) for t in (q, k, v)] + [g, beta, pool, torch.zeros(1, dtype=torch.int32)]


def test_cuda_by_name_says_why_it_cannot_run():
    plan, (q, k, v, g, beta, pool, idx) = _small_call()
    with pytest.raises(ValueError, match="variant 'cuda' cannot take this call: needs an sm_80\\+ CUDA GPU"):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, variant="cuda")


def test_default_falls_back_to_the_triton_kernel():
    plan, (q, k, v, g, beta, pool, idx) = _small_call()
    a = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True)
    b = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="wy")
    assert torch.equal(a, b)


def test_dispatch_picks_cuda_when_supported_and_wy_when_a_wyconfig_is_forced(monkeypatch):
    """With the support check and the launch stubbed, the default ("cuda" by GPU) takes the CUDA kernel with its
    config, and a forced WYConfig keeps the Triton kernel. The interpreter's own default is `portable` ("wy"): the
    table is taken without it here, so its smallest key, "cuda", stands in for the GPU's choice."""
    import dataclasses

    from gdn import ops as gops

    monkeypatch.setattr(gops, "VARIANTS", dataclasses.replace(gops.VARIANTS, portable=None, public=False))
    plan, (q, k, v, g, beta, pool, idx) = _small_call()
    calls = []
    monkeypatch.setattr(gcuda, "unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(gcuda, "run", lambda cfg, *a, **kw: calls.append(cfg))
    gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True)
    assert calls == [CudaConfig(BV=16)], calls  # V=16: the largest BV that divides it
    with force("gdn.tree_verify", config=CudaConfig(BV=8, pieces=2)):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan)
    assert calls[-1] == CudaConfig(BV=8, pieces=2)
    with force("gdn.tree_verify", config=WYConfig(BV=16)):
        o = gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True)
    assert len(calls) == 2 and not torch.isnan(o).any()


def test_unsupported_reasons(monkeypatch):
    plan, (q, k, v, g, beta, pool, idx) = _small_call()
    monkeypatch.setattr(gcuda, "unavailable", lambda device=None: None)
    cfg = CudaConfig(BV=16)
    o = torch.empty_like(v)
    assert gcuda.unsupported(q, k, v, g, beta, o, pool, idx, False, 6, cfg) is None
    assert "bf16" in gcuda.unsupported(q.float(), k, v, g, beta, o, pool, idx, False, 6, cfg)
    assert "at most 32 nodes" in gcuda.unsupported(q, k, v, g, beta, o, pool, idx, False, 33, cfg)
    assert "multiple of BV" in gcuda.unsupported(q, k, v, g, beta, o, pool, idx, False, 6, CudaConfig(BV=32))
    qs = torch.empty(q.shape[0], q.shape[1], K + 1, dtype=q.dtype)[..., 1:]
    qs.copy_(q)
    assert "16-byte aligned" in gcuda.unsupported(qs, k, v, g, beta, o, pool, idx, False, 6, cfg)
    assert "int32 or int64" in gcuda.unsupported(q, k, v, g, beta, o, pool, idx.to(torch.int16), False, 6, cfg)
    assert "g and beta" in gcuda.unsupported(q, k, v, g.double(), beta, o, pool, idx, False, 6, cfg)


@pytest.mark.parametrize("BV,nt,K,vk,ok", [(32, 16, 32, False, False), (32, 32, 32, False, True),
                                             (64, 16, 64, False, False), (64, 32, 64, True, True),
                                             (64, 16, 128, False, True), (16, 16, 32, True, True)])
def test_tile_splits_mirror_the_kernels_static_asserts(BV, nt, K, vk, ok):
    # gdn_tree.cu: MMA_THR % CH == 0 && NT % RPQ == 0 (q/k), MMA_THR % SCH == 0 && S_ROWS % RPS == 0 (state);
    # a config that fails them would stop NVRTC with a static assertion instead of falling back
    why = gcuda.tile_split_problem(CudaConfig(BV=BV), nt, K, vk)
    assert (why is None) == ok, why


@pytest.mark.parametrize("bad", [dict(BV=12), dict(BV=128), dict(pieces=1), dict(unroll_out=3), dict(min_blocks=0),
                                 dict(BV=8, split_warps=True)])
def test_cuda_config_validation(bad):
    with pytest.raises(ValueError, match="CudaConfig"):
        CudaConfig(**bad)
