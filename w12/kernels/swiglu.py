"""SwiGLU of a product with a paired gate-and-up weight (`w12.pair_rows`): `w12.matmul_swiglu` where the flow
kernel's W12F_SWIGLU epilogue does not take the call (more rows than its pieces, a tuned batch kernel), so that the
product's paired columns become SwiGLU's output in one pass instead of an unpairing copy and torch's ops.

Output column c of row m is gate column 16 (c // 8) + c % 8 and up column 16 (c // 8) + 8 + c % 8 of the product,
as the epilogue's `store_swiglu` (w12_common.cuh) computes it: s = bf16(g * (1 / (1 + e^-g))) with CUDA's expf and
IEEE division, out = bf16(s u); `w12.swiglu_reference`'s bits on the same GPU but for NaN payloads. The bf16 values
are widened by their bits and rounded by integer operations (`tc._bits_to_f32`, `tc._to_out`), which give the hardware
conversions' bits on a GPU and keep subnormals under the interpreter, whose own conversions flush them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .tc import _bits_to_f32, _to_out

__all__ = ["w12_swiglu_pairs_kernel"]


@triton.jit
def _widen(b):
    """bf16 values -> fp32, by their bits (exact)."""
    return _bits_to_f32(b.to(tl.int16, bitcast=True).to(tl.int32))


@triton.jit
def w12_swiglu_pairs_kernel(y_ptr, out_ptr, M, F, stride_y, stride_o, BLOCK: tl.constexpr, ROWS: tl.constexpr = 1,
                            EXPF: tl.constexpr = True):
    """Program (i, j): rows i ROWS .. i ROWS + ROWS - 1 (those below M) of the bf16 product y [M, 2F] (paired columns),
    output columns j BLOCK .. j BLOCK + BLOCK - 1 of out [M, F] (bf16). ROWS: 1 on a GPU; more under the interpreter,
    whose cost is per program (elementwise: the same bits either way). EXPF: e^-g by CUDA's expf (libdevice), as the
    epilogue; False (the interpreter, which has no libdevice): tl.exp."""
    m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)[:, None]
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = (c < F) & (m < M)
    col = (c // 8) * 16 + c % 8
    g = _widen(tl.load(y_ptr + m * stride_y + col, mask=ok, other=0.0))
    u = _widen(tl.load(y_ptr + m * stride_y + col + 8, mask=ok, other=0.0))
    if EXPF:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = _widen(_to_out(g * tl.div_rn(1.0, 1.0 + e), tl.bfloat16))
    tl.store(out_ptr + m * stride_o + c, _to_out(s * u, tl.bfloat16), mask=ok)
