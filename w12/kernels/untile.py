"""Decode of the runtime layout (w12/layout.py) to BF16 bits: one program per row block and BC consecutive full
column groups of 16 rows x 64 columns (`w12.ops.UNTILE_GROUPS`), or the masked tail of a row block, dense codes only
(the caller writes the escapes after it, as `w12.unpack` does). `w12.matmul_tiled` runs it where the flow kernel
does not take a call (more than 96 rows, fp16 x), then F.linear. BC = 4 is not yet timed on a GPU against BC = 1
(docs/w12-kernels.md, "Above 32 rows": decode + F.linear took 194 us on in_proj at 40 rows, cuBLAS 46).

Per element: code = hi << 4 | lo4, bits = ((code & 0x7FF) + (e0 << 7)) | ((code & 0x800) << 4), 0 for code 0
(`w12.format._decode`); with Q8 the 8-bit view: bits = (((hi & 0x7F) << 4) + (e0 << 7) + 8) | ((hi & 0x80) << 8),
without the + 8 where e0 = 0 (`w12.reference.decode_q8`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["w12_untile_kernel"]


@triton.jit
def w12_untile_kernel(tiles, e0, out, N, K, KF, kr, NF, nr, SB, Q8: tl.constexpr, BC: tl.constexpr):
    """Program (b, g): row block b, and its column groups BC g .. BC g + BC - 1 (the full ones among them); the last
    g of a weight with a masked tail (kr > 0) takes that tail. BC groups a program make each row's store BC x 128
    contiguous bytes."""
    b = tl.program_id(0)  # row block
    g = tl.program_id(1)  # a chunk of BC column groups (past the full ones: the masked tail)
    R = tl.where(b < NF, 16, nr)
    r = tl.arange(0, 16)[:, None]
    col = tl.arange(0, BC * 64)[None, :]  # column in the chunk
    row = b * 16 + r
    base = b.to(tl.int64) * SB
    if g * BC < KF:
        c = g * BC + col // 64  # the column group of each column
        j = col % 64
        tile = base + (c * 96 * R).to(tl.int64)  # each column's tile ([1, BC * 64])
        ok = (r < R) & (c < KF)
        hi = tl.load(tiles + tile + 64 * r + j, mask=ok, other=0).to(tl.int32)
        jj = j % 16
        lob = tl.load(tiles + tile + 64 * R + 32 * r + 8 * (j // 16) + (jj % 8), mask=ok, other=0).to(tl.int32)
        lo = (lob >> (4 * (jj // 8))) & 0xF
        out_col = g * BC * 64 + col
    else:
        tail = base + (KF * 96 * R).to(tl.int64)  # the tail's one tile (a scalar: named apart from the full
        ok = (r < R) & (col < kr)                 # branch's, whose shape differs, as Triton's compiler requires)
        hi = tl.load(tiles + tail + kr * r + col, mask=ok, other=0).to(tl.int32)
        lb = (kr + 1) // 2
        lob = tl.load(tiles + tail + R * kr + lb * r + col // 2, mask=ok, other=0).to(tl.int32)
        lo = (lob >> (4 * (col % 2))) & 0xF
        out_col = KF * 64 + col
    e = tl.load(e0 + row, mask=r < R, other=0).to(tl.int32)
    if Q8:
        bits = (((hi & 0x7F) << 4) + tl.where(e > 0, (e << 7) + 8, 0)) | ((hi & 0x80) << 8)
    else:
        code = (hi << 4) | lo
        bits = ((code & 0x7FF) + (e << 7)) | ((code & 0x800) << 4)
        bits = tl.where(code == 0, 0, bits)
    bits = tl.where(bits >= 0x8000, bits - 0x10000, bits)  # the int16 bit pattern
    tl.store(out + row.to(tl.int64) * K + out_col, bits.to(tl.int16), mask=ok)
