"""Pure-PyTorch/Python reference of the W12 format (docs/w12-format.md): obviously correct, slow.

* `pack_reference` / `unpack_reference`: element-by-element loops over Python ints, written
  straight from the spec; used to check the vectorised `w12.pack` / `w12.unpack` and the codec.
* `decode_q8`: the 8-bit view (from `hi` and `e0` only; escapes exact).
* `matmul_reference` / `matmul_q8_reference`: fp64 `F.linear` oracles for the GEMM kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .format import E0_MAX, GROUP, WINDOW, W12Weight, check_pack_input, padded_k, unpack
from .layout import TiledW12, untile

__all__ = ["pack_reference", "unpack_reference", "decode_q8", "q8_view_bits", "matmul_reference", "matmul_q8_reference"]


def _bits_list(weight: torch.Tensor) -> list[list[int]]:
    return (weight.detach().cpu().contiguous().view(torch.int16).int() & 0xFFFF).tolist()


def _decode_code(c: int, e0: int) -> int:
    if c == 0:
        return 0x0000
    return ((c & 0x7FF) + (e0 << 7)) | ((c & 0x800) << 4)


def _signed16(b: int) -> int:
    return b - 0x10000 if b & 0x8000 else b


def pack_reference(weight: torch.Tensor) -> W12Weight:
    """Pack a BF16 [N, K] weight element by element, exactly as the spec reads. Returns CPU planes."""
    check_pack_input(weight)
    N, K = weight.shape
    Kp = padded_k(K)
    rows = _bits_list(weight)
    hi = [[0] * Kp for _ in range(N)]
    lo = [[0] * (Kp // 2) for _ in range(N)]
    e0s, rowptr, esc_col, esc_val = [], [0], [], []
    for n, row in enumerate(rows):
        exps = [(b >> 7) & 0xFF for b in row]
        hist = [0] * 256
        for e in exps:
            hist[e] += 1
        counts = [sum(hist[base : base + WINDOW]) for base in range(E0_MAX + 1)]  # elements in [base, base+15]
        e0 = counts.index(max(counts))  # first maximum: smallest e0
        e0s.append(e0)
        codes = [0] * Kp
        for k, b in enumerate(row):
            s, e, m = b >> 15, (b >> 7) & 0xFF, b & 0x7F
            dense = False
            if e0 <= e <= e0 + WINDOW - 1 and e != 0xFF:  # +-Inf / NaN always escape (see w12/format.py)
                c = (s << 11) | ((e - e0) << 7) | m
                dense = _decode_code(c, e0) == b
            if dense:
                codes[k] = c
            else:
                esc_col.append(k)
                esc_val.append(_signed16(b))
        rowptr.append(len(esc_col))
        for k in range(Kp):
            hi[n][k] = codes[k] >> 4
        for g in range(Kp // GROUP):
            for i in range(32):
                lo[n][32 * g + i] = (codes[GROUP * g + i] & 0xF) | ((codes[GROUP * g + 32 + i] & 0xF) << 4)
    return W12Weight(
        hi=torch.tensor(hi, dtype=torch.uint8),
        lo=torch.tensor(lo, dtype=torch.uint8),
        e0=torch.tensor(e0s, dtype=torch.uint8),
        esc_rowptr=torch.tensor(rowptr, dtype=torch.int32),
        esc_col=torch.tensor(esc_col, dtype=torch.int32),
        esc_val=torch.tensor(esc_val, dtype=torch.int16),
        K=K,
    )


def _check_packed(fn: str, packed) -> None:
    if not isinstance(packed, W12Weight):
        raise TypeError(f"w12.{fn}: expected a W12Weight (the version-1 planes), got {type(packed).__name__}; pass "
                        "w12.pack(weight, layout=\"planes\"), or w12.layout.untile(tiled) for a TiledW12")


def unpack_reference(packed: W12Weight) -> torch.Tensor:
    """Decode element by element to BF16 [N, K] (on CPU)."""
    _check_packed("unpack_reference", packed)
    hi, lo = packed.hi.cpu().tolist(), packed.lo.cpu().tolist()
    e0s, rowptr = packed.e0.cpu().tolist(), packed.esc_rowptr.cpu().tolist()
    cols, vals = packed.esc_col.cpu().tolist(), packed.esc_val.cpu().tolist()
    out = []
    for n in range(packed.N):
        row = []
        for k in range(packed.K):
            g, j = divmod(k, GROUP)
            nib = lo[n][32 * g + j] & 0xF if j < 32 else lo[n][32 * g + j - 32] >> 4
            row.append(_signed16(_decode_code((hi[n][k] << 4) | nib, e0s[n])))
        for i in range(rowptr[n], rowptr[n + 1]):
            row[cols[i]] = vals[i]
        out.append(row)
    return torch.tensor(out, dtype=torch.int16).view(torch.bfloat16)


def _apply_escapes(bits16: torch.Tensor, packed: W12Weight) -> torch.Tensor:
    rows = torch.repeat_interleave(
        torch.arange(packed.N, device=packed.device), (packed.esc_rowptr[1:] - packed.esc_rowptr[:-1]).long()
    )
    bits16[rows, packed.esc_col.long()] = packed.esc_val
    return bits16


def q8_view_bits(hi: torch.Tensor, e0: torch.Tensor) -> torch.Tensor:
    """The 8-bit view's BF16 bit patterns (int32, 0..0xFFFF) of `hi` bytes (int32) in rows of bases `e0` (int32,
    broadcast against hi): the midpoint of the 16 values sharing each byte, the lowest of them where e0 = 0, so that
    a row of zeros reads zeros (docs/w12-format.md, "The 8-bit view"). An escape's byte reads as any other."""
    return (((hi & 0x7F) << 4) + torch.where(e0 > 0, (e0 << 7) + 8, torch.zeros_like(e0))) | ((hi & 0x80) << 8)


def decode_q8(packed: W12Weight | TiledW12) -> torch.Tensor:
    """The 8-bit view as BF16 [N, K]: `q8_view_bits` of every `hi` byte; escapes exact. Takes a `TiledW12` (the
    runtime layout) too: on a GPU decoded tile by tile (`w12.ops.decode_tiled(q8=True)`, the same bits), elsewhere
    through its version-1 planes (`w12.layout.untile`)."""
    if isinstance(packed, TiledW12):
        if packed.device.type == "cuda":
            from .ops import decode_tiled

            return decode_tiled(packed, q8=True)
        packed = untile(packed)
    if not isinstance(packed, W12Weight):
        raise TypeError(f"w12.decode_q8: expected a W12Weight or TiledW12 (from w12.pack), got "
                        f"{type(packed).__name__}; pass w12.pack(weight)")
    bits = q8_view_bits(packed.hi[:, : packed.K].int(), packed.e0.int().unsqueeze(1))
    bits16 = (bits - ((bits & 0x8000) << 1)).to(torch.int16)
    return _apply_escapes(bits16, packed).view(torch.bfloat16)


def _linear64(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight has K={w.shape[1]}")
    return F.linear(x.double(), w.double().to(x.device), None if bias is None else bias.double().to(x.device))


def matmul_reference(x: torch.Tensor, packed: W12Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 `x @ W.T + bias` with W the exact unpacked weight: the oracle for `w12.matmul`."""
    return _linear64(x, unpack(packed), bias)


def matmul_q8_reference(x: torch.Tensor, packed: W12Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 `x @ Wq8.T + bias` with Wq8 the 8-bit view: the oracle for `w12.matmul_q8`."""
    return _linear64(x, decode_q8(packed), bias)
