"""fp16 x through the bf16 flow kernel (`w12.matmul_tiled`, docs/w12-kernels.md "fp16 activations"): the split of
x into two bf16 halves before the kernel, and the sum of the halves' fp32 products after it, one program each per
row and BLOCK columns. They compute what `w12.ops.split_fp16` and `w12.ops.fp16_by_bf16_pair` compute with torch
ops, bit for bit (tests/w12/test_tiled_fp16.py), in one launch each instead of a dozen elementwise kernels.

* `fp16_split_kernel`: xb[r] = bf16(x[r]) (round to nearest even), xb[m + r] = x[r] - xb[r] (exact), 0 where that
  difference is not finite (x +-Inf or NaN); xb has K columns.
* `fp16_pair_sum_kernel`: out[r] = fp16(s + bias), s = o[r] + o[m + r] where o[r] is finite and o[m + r] is not
  zero, else o[r] (module `w12.ops`, `fp16_by_bf16_pair`, says why).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp16_split_kernel", "fp16_pair_sum_kernel"]


@triton.jit
def fp16_split_kernel(x, sx, xb, m, K, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < K
    v = tl.load(x + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    hi = v.to(tl.bfloat16, fp_downcast_rounding="rtne")
    lo = v - hi.to(tl.float32)
    lo = tl.where(lo - lo == 0.0, lo, 0.0)  # x - x is 0 exactly where x is finite
    tl.store(xb + r * K + c, hi, mask=mask)
    tl.store(xb + (m + r) * K + c, lo.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def fp16_pair_sum_kernel(o, out, so, bias, m, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    h = tl.load(o + r * N + c, mask=mask, other=0.0)
    lo = tl.load(o + (m + r) * N + c, mask=mask, other=0.0)
    s = tl.where((h - h == 0.0) & (lo != 0.0), h + lo, h)
    if HAS_BIAS:
        s = s + tl.load(bias + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r * so + c, s.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
