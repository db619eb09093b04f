"""The fp16 x and the check of an fp16 product against the fp64 reference, shared by the CPU and GPU tests of the
runtime layout's fp16-x path (`w12.ops.fp16_by_bf16_pair`).

The path sums in fp32 and rounds once to fp16. Where the fp64 sum of |x w| over the finite x and w stays below 2^120 (no fp32 intermediate
can overflow, whatever the order), the result must be the reference rounded to fp16 within one fp16 step (half a
step from the final rounding, the rest from the fp32 sums: K 2^-23 of the magnitude) and of the same kind: NaN where
the reference is NaN, the same infinity where it is infinite (both after the rounding to fp16). Above, fp32 itself
may overflow in the sums (+Inf and -Inf make NaN where fp64 keeps a finite value), so only NaN is required where the
reference is NaN."""

from __future__ import annotations

import torch

# the fp16 values a hostile x salts into its odd rows: zeros of both signs, infinities, NaN, the largest finite
# values, the smallest subnormals, the largest subnormal (6.1e-5 rounds to 1023 * 2^-24), and two values just above
# 1 whose low bits fall into x's lo half (`w12.ops.split_fp16`)
HOSTILE_FP16 = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 6.1e-5,
                1.0 + 2.0**-10, 1.0 + 3 * 2.0**-10)
# the column where the tests' hostile weights put their one +Inf (row 0): a hostile x's even rows hold 2.0 there
INF_COL = 3


def fp16_x(M: int, K: int, seed: int, device: str | torch.device, hostile: bool = True) -> torch.Tensor:
    """fp16 activations [M, K] on `device`: standard normal times 2, from one generator on `device` seeded with `seed`.
    With `hostile`, the same generator then salts every odd row with HOSTILE_FP16 at max(1, K // 12) random columns,
    and every even row holds 2.0 at INF_COL: an fp16 whose lo half is 0, where the weight's +Inf sits, so that lo's
    0 * Inf must not count."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(M, K, generator=g, device=device) * 2.0).to(torch.float16)
    if hostile:
        special = torch.tensor(HOSTILE_FP16, dtype=torch.float16, device=device)
        for r in range(1, M, 2):
            cols = torch.randperm(K, generator=g, device=device)[: max(1, K // 12)]
            x[r, cols] = special[torch.randint(0, len(special), (cols.numel(),), generator=g, device=device)]
        x[::2, INF_COL] = 2.0
    return x


def assert_fp16_product(out: torch.Tensor, ref64: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`out` (fp16 [M, N]) against `ref64` (fp64 x @ w^T + bias) for x [M, K] and the exact weight w [N, K]."""
    assert out.dtype == torch.float16 and out.shape == ref64.shape
    out, ref64 = out.double().cpu(), ref64.cpu()
    # finite parts only: an infinite x or w gives an infinity (or NaN) in fp64 and fp32 alike
    xa = torch.nan_to_num(x.double().cpu().abs(), nan=0.0, posinf=0.0)
    wa = torch.nan_to_num(w.double().cpu().abs(), nan=0.0, posinf=0.0)
    mag = xa @ wa.T
    safe = mag < 2.0**120
    r16 = ref64.to(torch.float16).double()
    nan_r = torch.isnan(r16)
    assert torch.isnan(out)[nan_r].all(), "the reference's NaN is not NaN here"
    s = safe & ~nan_r
    assert not torch.isnan(out[s]).any(), f"{int(torch.isnan(out[s]).sum())} NaN where the reference is a number"
    inf = s & torch.isinf(r16)
    assert torch.equal(out[inf], r16[inf]), "infinities differ from the reference's"
    fin = s & ~torch.isinf(r16)
    assert not torch.isinf(out[fin]).any(), "an infinity where the reference is finite"
    step = torch.clamp(torch.exp2(torch.floor(torch.log2(ref64[fin].abs().clamp_min(2.0**-14)))) * 2.0**-10, min=2.0**-24)
    tol = step + x.shape[1] * 2.0**-23 * mag[fin]
    err = (out[fin] - ref64[fin]).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {int(fin.sum())} outputs beyond one fp16 step; worst error "
                           f"{float((err - tol).max()):.3g} over its bound")
