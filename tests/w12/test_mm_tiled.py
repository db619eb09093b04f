"""The GEMM on the runtime layout for many rows (w12.ops.mm_tiled, w12/kernels/mm.py): under the Triton interpreter
on the CPU at small shapes, through `w12.matmul_tiled` on the GPU at a batch verify step's row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import w12
from w12 import layout
from w12.ops import mm_tiled
from specpilot.testing import assert_close

from flow_emu import hostile_weight


def _x(M: int, K: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 1.5).to(torch.bfloat16).to(device)


def _salt(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A tenth of x's entries set to +-0 and +-subnormals."""
    g = torch.Generator().manual_seed(seed)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 10]
    vals = torch.tensor([0.0, -0.0, 1e-40, -1e-40], dtype=torch.bfloat16)
    flat[idx.to(x.device)] = vals[torch.randint(0, 4, (idx.numel(),), generator=g)].to(x.device)
    return x


def _weight(N: int, K: int, seed: int) -> torch.Tensor:
    """`hostile_weight` with its finite salt kept under 2^120, so that no fp32 product or sum overflows where the
    fp64 reference stays finite (an overflow to +-Inf beside another row's -+Inf escape is NaN in fp32, whatever
    the order)."""
    w = hostile_weight(N, K, seed=seed)
    big = torch.isfinite(w) & (w.abs() > 2.0 ** 120)
    return torch.where(big, torch.sign(w) * 2.0 ** 120, w.float()).to(torch.bfloat16)


def _run(x, t, bias=None, q8=False):
    out = torch.full((x.shape[0], t.N), float("nan"), dtype=torch.bfloat16, device=x.device)
    mm_tiled(x, t, bias, out, q8=q8)
    return out


# M, N, K, bias, q8: x blocks of 16, 64 and 128 rows (one partial), partial row blocks, masked last groups (K % 64),
# K under one group, the 8-bit view
CASES = [(40, 75, 200, False, False), (17, 33, 130, True, False), (70, 40, 64, False, True), (130, 21, 63, True, False),
         (5, 16, 300, False, False), (33, 130, 129, False, True)]


@pytest.mark.parametrize("M,N,K,bias,q8", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}" + ("-bias" if c[3] else "") +
                                                      ("-q8" if c[4] else "") for c in CASES])
def test_mm_tiled_matches_fp64(M, N, K, bias, q8):
    """Hostile rows (zeros, subnormal, huge and tiny rows, salted +-0, +-Inf, NaN and escapes) and x salted with +-0
    and subnormals, against the fp64 product with the decoded weight (the 8-bit view's for q8) within the error of
    a same-precision F.linear; the same bits on a second run."""
    w = _weight(N, K, seed=N * K + M)
    p = w12.pack(w)
    assert p.esc_col.numel() > 0
    t = layout.tile(p)
    x = _salt(_x(M, K, seed=M + K), seed=M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16) if bias else None
    out = _run(x, t, b, q8)
    wd = w12.decode_q8(p) if q8 else w
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, b)
    assert_close(out, ref, F.linear(x, wd, b), msg=f"mm_tiled M={M} N={N} K={K}")
    assert torch.equal(_run(x, t, b, q8).view(torch.int16), out.view(torch.int16))


def test_mm_tiled_is_exact_where_the_sums_are():
    """Weights and x of a few significant bits, escapes among them (values outside each row's window, -0.0), so
    that every product and partial sum is exact in fp32: the output is the exact product rounded once, bit for bit."""
    N, K, M = 48, 200, 36
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-8, 9, (N, K), generator=g).double() * 2.0 ** torch.randint(-6, 0, (N, 1), generator=g)
    w[5, 7], w[9, 150], w[9, 151], w[30, 199] = 2.0 ** 20, -(2.0 ** 18), 2.0 ** -30, -0.0
    x = torch.randint(-4, 5, (M, K), generator=g).double() * 0.25
    p = w12.pack(w.to(torch.bfloat16))
    assert p.esc_col.numel() >= 3
    out = _run(x.to(torch.bfloat16), layout.tile(p))
    want = (x @ w.to(torch.bfloat16).double().T).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_mm_tiled_argument_errors():
    p = w12.pack(_weight(20, 70, seed=1))
    t = layout.tile(p)
    with pytest.raises(ValueError, match="bf16 x"):
        mm_tiled(_x(3, 70, 1).float(), t, None, torch.empty(3, 20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 x"):
        mm_tiled(_x(3, 71, 1), t, None, torch.empty(3, 20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous bf16"):
        mm_tiled(_x(3, 70, 1), t, None, torch.empty(20, 3, dtype=torch.bfloat16).T)


# ---- on the GPU: w12.matmul_tiled above the flow kernel's 32 rows ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("M", [33, 72, 152, 280])
@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
def test_matmul_tiled_many_rows_matches_fp64_gpu(M, q8):
    """A 5120 x 6144 layer (hybrid-27b's o_proj) with hostile rows at a batch verify step's row counts, through
    w12.matmul_tiled (which takes mm_tiled above 32 rows), against fp64; bit for bit run to run."""
    N, K = 5120, 6144
    w = _weight(N, K, seed=M).cuda()
    p = w12.pack(w)
    t = layout.tile(p)
    x = _salt(_x(M, K, seed=M + 1, device="cuda"), seed=M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16).cuda()
    fn = w12.matmul_tiled
    out = fn(x, t, b, q8=q8)
    torch.cuda.synchronize()
    wd = w12.decode_q8(p) if q8 else w
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, b)
    assert_close(out, ref, F.linear(x, wd, b), msg=f"matmul_tiled M={M}")
    assert torch.equal(fn(x, t, b, q8=q8).view(torch.int16), out.view(torch.int16))
    direct = torch.empty_like(out)
    mm_tiled(x, t, b, direct, q8=q8)
    assert torch.equal(direct.view(torch.int16), out.view(torch.int16))
