"""Decode of the runtime layout (w12/layout.py) to BF16 bits: one program per tile (16 rows x 64 columns, or the
masked tail of a row block), dense codes only (the caller writes the escapes after it, as `w12.unpack` does).
`w12.matmul_tiled` runs it where the flow kernel does not take a call (more than 32 rows, fp16 x), then F.linear.

Per element: code = hi << 4 | lo4, bits = ((code & 0x7FF) + (e0 << 7)) | ((code & 0x800) << 4), 0 for code 0
(`w12.format._decode`); with Q8 the 8-bit view: bits = (((hi & 0x7F) << 4) + (e0 << 7) + 8) | ((hi & 0x80) << 8),
without the + 8 where e0 = 0 (`w12.reference.decode_q8`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["w12_untile_kernel"]


@triton.jit
def w12_untile_kernel(tiles, e0, out, N, K, KF, kr, NF, nr, SB, Q8: tl.constexpr):
    b = tl.program_id(0)  # row block
    c = tl.program_id(1)  # column group (KF: the masked tail)
    R = tl.where(b < NF, 16, nr)
    r = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 64)[None, :]
    row = b * 16 + r
    base = b.to(tl.int64) * SB
    if c < KF:
        t = base + (c * 96 * R).to(tl.int64)
        ok = (r < R) & (j < 64)
        hi = tl.load(tiles + t + 64 * r + j, mask=ok, other=0).to(tl.int32)
        jj = j % 16
        lob = tl.load(tiles + t + 64 * R + 32 * r + 8 * (j // 16) + (jj % 8), mask=ok, other=0).to(tl.int32)
        lo = (lob >> (4 * (jj // 8))) & 0xF
    else:
        t = base + (KF * 96 * R).to(tl.int64)
        ok = (r < R) & (j < kr)
        hi = tl.load(tiles + t + kr * r + j, mask=ok, other=0).to(tl.int32)
        lb = (kr + 1) // 2
        lob = tl.load(tiles + t + R * kr + lb * r + j // 2, mask=ok, other=0).to(tl.int32)
        lo = (lob >> (4 * (j % 2))) & 0xF
    e = tl.load(e0 + row, mask=r < R, other=0).to(tl.int32)
    if Q8:
        bits = (((hi & 0x7F) << 4) + tl.where(e > 0, (e << 7) + 8, 0)) | ((hi & 0x80) << 8)
    else:
        code = (hi << 4) | lo
        bits = ((code & 0x7FF) + (e << 7)) | ((code & 0x800) << 4)
        bits = tl.where(code == 0, 0, bits)
    bits = tl.where(bits >= 0x8000, bits - 0x10000, bits)  # the int16 bit pattern
    col = c * 64 + j
    tl.store(out + row.to(tl.int64) * K + col, bits.to(tl.int16), mask=ok)
