"""fp16 x on the runtime layout, on the CPU: x split into two bf16 halves that add up to it exactly
(`w12.ops.split_fp16`, every fp16 value), and the halves' products added as `w12.ops.fp16_by_bf16_pair` adds them,
with the flow kernel's fp32-output build emulated lane by lane (`flow_emu.emulate(fp32=True)`: the sums the
W12F_OUT32 build stores) on hostile weights and hostile x. The GPU side: tests/w12/test_tiled_fp16_gpu.py."""

from __future__ import annotations

import pytest
import torch

import w12
from w12 import layout
from w12.ops import fp16_by_bf16_pair, split_fp16

from flow_emu import emulate, hostile_weight
from fp16_check import INF_COL, assert_fp16_product, fp16_x


def _every_fp16() -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)


def test_split_fp16_is_exact_on_every_fp16_value():
    x = _every_fp16().reshape(256, 256)
    both = split_fp16(x)
    hi, lo = both[:256], both[256:]
    assert both.dtype == torch.bfloat16 and both.shape == (512, 256)
    fin = torch.isfinite(x)
    assert torch.equal(hi.double()[fin] + lo.double()[fin], x.double()[fin])  # exact, +-0 included as values
    num = ~torch.isnan(x)
    assert torch.equal(torch.signbit(hi)[num], torch.signbit(x)[num])  # hi keeps x's sign, -0.0 included
    assert torch.equal(hi.float()[fin], x.float()[fin].to(torch.bfloat16).float())  # round to nearest even
    assert torch.equal(torch.isnan(hi), torch.isnan(x))
    inf = torch.isinf(x)
    assert torch.equal(hi.float()[inf], x.float()[inf])
    assert (lo.float()[~fin] == 0).all()
    # lo is never more than half a bf16 step of x: 3 significant bits at most
    nz = fin & (lo.float() != 0)
    assert (lo.double()[nz].abs() <= hi.double()[nz].abs() * 2.0**-8).all()


def _assert_same_bits_nan_aware(got: torch.Tensor, want: torch.Tensor) -> None:
    """NaN where `want` is NaN (any payload: the conversions' NaN payloads are not part of the contract), every other
    value bit for bit."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_split_kernel_is_split_fp16_bitwise():
    """The Triton split (the interpreter here) against the torch ops, on every fp16 value, in a strided x."""
    x = _every_fp16().reshape(128, 512)[:, ::2]
    want = split_fp16(x)
    got = split_fp16(x, kernels=True)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    _assert_same_bits_nan_aware(got, want)


@pytest.mark.parametrize("bias", [None, torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_pair_sum_kernel_is_the_torch_sum_bitwise(bias):
    """The Triton sum (the interpreter here) against the torch ops on sums of every kind: -0.0, +-Inf, NaN, zeros,
    fp16 ties and overflow, subnormal results, into a slice of a wider `out`."""
    g = torch.Generator().manual_seed(7)
    m, N = 6, 1500
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65520.0, 2.0**-25,
                            2.0**-24, 3 * 2.0**-26, 1.0 + 2.0**-11, -(1.0 + 3 * 2.0**-11)])
    o = torch.randn(2 * m, N, generator=g) * torch.exp2(torch.randint(-30, 18, (2 * m, N), generator=g).float())
    pick = torch.rand(2 * m, N, generator=g) < 0.3
    o[pick] = special[torch.randint(0, len(special), (int(pick.sum()),), generator=g)]
    b = None if bias is None else (torch.randn(N, generator=g) * 0.01).to(bias)
    want = torch.full((m, N + 3), 7.0, dtype=torch.float16)
    got = want.clone()
    fp16_by_bf16_pair(torch.zeros(m, 4, dtype=torch.float16), lambda xb: o, b, want[:, :N])
    fp16_by_bf16_pair(torch.zeros(m, 4, dtype=torch.float16), lambda xb: o, b, got[:, :N], kernels=True)
    _assert_same_bits_nan_aware(got, want)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M,N,K", [(1, 37, 150), (5, 37, 150), (16, 40, 130), (3, 64, 64)])
def test_fp16_pair_from_the_emulated_fp32_build_matches_the_reference(M, N, K, q8, bias, kernels):
    w = hostile_weight(N, K, seed=M + N + K)
    w[0, INF_COL] = float("inf")  # row 0 Gaussian but for one +Inf: sums of +-Inf, where lo's 0 * Inf must not count
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = fp16_x(M, K, seed=M, device="cpu")  # hostile: x's lo = 0 at INF_COL in even rows
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.float16) if bias else None

    def product32(xb: torch.Tensor) -> torch.Tensor:
        assert xb.dtype == torch.bfloat16 and xb.shape == (2 * M, K)
        got, _ = emulate(xb, t, warps=4, kw=2, fixed=False, fp32=True, q8=q8)
        return torch.as_tensor(got).float()

    out = torch.empty(M, N, dtype=torch.float16)
    fp16_by_bf16_pair(x, product32, b, out, kernels=kernels)
    wd = w12.decode_q8(p) if q8 else w12.unpack(p)
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, b)
    assert_fp16_product(out, ref, x, wd)


def test_fp16_pair_keeps_the_hi_sum_where_the_lo_sum_is_zero_or_the_hi_sum_not_finite():
    """The combination rule on chosen sums: -0.0 survives a zero lo sum, an infinite hi sum is not turned into NaN by
    a lo sum of 0 * Inf, a NaN hi sum stays NaN, and finite sums add in fp32 before one rounding."""
    h = torch.tensor([[-0.0, float("inf"), float("nan"), 1.0, 1.0]])
    lo = torch.tensor([[0.0, float("nan"), 1.0, 3 * 2.0**-12, 2.0**-12]])
    out = torch.empty(1, 5, dtype=torch.float16)
    fp16_by_bf16_pair(torch.zeros(1, 3, dtype=torch.float16), lambda xb: torch.cat([h, lo]), None, out)
    assert torch.signbit(out[0, 0]) and out[0, 0] == 0
    assert out[0, 1] == float("inf") and torch.isnan(out[0, 2])
    assert out[0, 3] == 1.0 + 2.0**-10  # 1 + 3 2^-12: the sum rounded once
    assert out[0, 4] == 1.0
    # the bias is added to the fp32 sum before the one rounding: 1 + 2^-12 + 2^-11 rounds up, where 1 rounded first
    # and then 1 + 2^-11 (a tie, to even) would give 1
    fp16_by_bf16_pair(torch.zeros(1, 3, dtype=torch.float16), lambda xb: torch.cat([h, lo]),
                      torch.full((5,), 2.0**-11, dtype=torch.float32), out)
    assert out[0, 4] == 1.0 + 2.0**-10
