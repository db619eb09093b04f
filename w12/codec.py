"""CPU codec for W12 in numba (`@njit(parallel=True)`), for checkpoints larger than GPU memory.

Works on numpy `uint16` bit patterns and gives planes bit-identical to `w12.pack(..., layout="planes")`
(torch). Rows are independent, so both directions are `prange` loops over rows; `pack` takes two passes
(codes + escape counts, then escapes written at their CSR offsets).

    planes = pack_bits(bits_u16)          # dict of numpy planes + "K"
    bits = unpack_bits(planes)            # uint16 [N, K]
    packed = pack(weight_bf16_cpu)        # -> W12Weight (torch tensors sharing the numpy memory)
    weight = unpack(packed)               # -> BF16 tensor

numba compiles on first call (a few seconds; cached on disk afterwards).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .errors import W12VerificationError
from .format import E0_MAX, GROUP, WINDOW, W12Weight, check_pack_input, padded_k

__all__ = ["pack_bits", "unpack_bits", "pack", "unpack"]


@njit(parallel=True, cache=True)
def _pack_pass1(bits, Kp, hi, lo, e0_out, counts):
    N, K = bits.shape
    for n in prange(N):
        hist = np.zeros(256, np.int64)
        for k in range(K):
            hist[(bits[n, k] >> 7) & 0xFF] += 1
        win = 0
        for j in range(WINDOW):
            win += hist[j]
        best, e0 = win, 0
        for base in range(1, E0_MAX + 1):
            win += hist[base + WINDOW - 1] - hist[base - 1]
            if win > best:  # strict: ties keep the smallest e0
                best, e0 = win, base
        e0_out[n] = e0
        codes = np.zeros(Kp, np.int32)
        esc = 0
        for k in range(K):
            b = np.int32(bits[n, k])
            e = (b >> 7) & 0xFF
            off = e - e0
            c = ((b >> 4) & 0x800) | (off << 7) | (b & 0x7F)
            if off >= 0 and off < WINDOW and e != 0xFF and (c != 0 or e0 == 0):
                codes[k] = c
            else:
                esc += 1
        counts[n] = esc
        for k in range(Kp):
            hi[n, k] = codes[k] >> 4
        for g in range(Kp // GROUP):
            for i in range(32):
                lo[n, 32 * g + i] = (codes[GROUP * g + i] & 0xF) | ((codes[GROUP * g + 32 + i] & 0xF) << 4)


@njit(parallel=True, cache=True)
def _pack_pass2(bits, e0_arr, rowptr, esc_col, esc_val):
    N, K = bits.shape
    for n in prange(N):
        e0 = np.int32(e0_arr[n])
        j = rowptr[n]
        for k in range(K):
            b = np.int32(bits[n, k])
            e = (b >> 7) & 0xFF
            off = e - e0
            c = ((b >> 4) & 0x800) | (off << 7) | (b & 0x7F)
            if not (off >= 0 and off < WINDOW and e != 0xFF and (c != 0 or e0 == 0)):
                esc_col[j] = k
                esc_val[j] = bits[n, k]
                j += 1


@njit(parallel=True, cache=True)
def _unpack_rows(hi, lo, e0_arr, rowptr, esc_col, esc_val, K, out):
    N = hi.shape[0]
    for n in prange(N):
        e0 = np.int32(e0_arr[n])
        for k in range(K):
            g = k // GROUP
            j = k - GROUP * g
            if j < 32:
                nib = np.int32(lo[n, 32 * g + j]) & 0xF
            else:
                nib = np.int32(lo[n, 32 * g + j - 32]) >> 4
            c = (np.int32(hi[n, k]) << 4) | nib
            if c == 0:
                out[n, k] = 0
            else:
                out[n, k] = ((c & 0x7FF) + (e0 << 7)) | ((c & 0x800) << 4)
        for i in range(rowptr[n], rowptr[n + 1]):
            out[n, esc_col[i]] = esc_val[i]


def pack_bits(bits: np.ndarray) -> dict:
    """Pack uint16 BF16 bit patterns [N, K] into numpy planes (dict with the plane names and "K")."""
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16 or bits.ndim != 2:
        raise TypeError("w12.codec.pack_bits expects a 2-D numpy uint16 array of BF16 bit patterns")
    if bits.size == 0:
        raise ValueError(f"w12.codec.pack_bits got an empty array of shape {bits.shape}")
    bits = np.ascontiguousarray(bits)
    N, K = bits.shape
    Kp = padded_k(K)
    hi = np.zeros((N, Kp), np.uint8)
    lo = np.zeros((N, Kp // 2), np.uint8)
    e0 = np.zeros(N, np.uint8)
    counts = np.zeros(N, np.int64)
    _pack_pass1(bits, Kp, hi, lo, e0, counts)
    rowptr64 = np.zeros(N + 1, np.int64)
    np.cumsum(counts, out=rowptr64[1:])
    E = int(rowptr64[-1])
    if E >= 2**31:
        raise ValueError(f"{E} escapes overflow int32 esc_rowptr; split the weight into row blocks")
    rowptr = rowptr64.astype(np.int32)
    esc_col = np.zeros(E, np.int32)
    esc_val = np.zeros(E, np.uint16)
    _pack_pass2(bits, e0, rowptr, esc_col, esc_val)
    return {"hi": hi, "lo": lo, "e0": e0, "esc_rowptr": rowptr, "esc_col": esc_col,
            "esc_val": esc_val.view(np.int16), "K": K}


def unpack_bits(planes: dict) -> np.ndarray:
    """Decode numpy planes (as from `pack_bits`) to uint16 bit patterns [N, K]."""
    K = int(planes["K"])
    hi = np.ascontiguousarray(planes["hi"])
    out = np.zeros((hi.shape[0], K), np.uint16)
    _unpack_rows(hi, np.ascontiguousarray(planes["lo"]), np.ascontiguousarray(planes["e0"]),
                 np.ascontiguousarray(planes["esc_rowptr"]), np.ascontiguousarray(planes["esc_col"]),
                 np.ascontiguousarray(planes["esc_val"]).view(np.uint16), K, out)
    return out


def _bits_numpy(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def pack(weight: torch.Tensor, verify: bool = True) -> W12Weight:
    """`w12.pack(weight, layout="planes")` on the CPU through numba: same planes, bit for bit. Returns a CPU
    `W12Weight`."""
    check_pack_input(weight)
    bits = _bits_numpy(weight)
    planes = pack_bits(bits)
    K = planes.pop("K")
    packed = W12Weight(**{p: torch.from_numpy(a) for p, a in planes.items()}, K=K)
    if verify:
        back = unpack_bits(dict(planes, K=K))
        if not np.array_equal(back, bits):
            bad = np.argwhere(back != bits)
            r, c = bad[0]
            raise W12VerificationError(
                f"W12 numba round trip is not bit-exact: {len(bad)} of {bits.size} elements differ, first at "
                f"({r}, {c}): got 0x{int(back[r, c]):04x}, expected 0x{int(bits[r, c]):04x}. This is a bug in "
                f"w12.codec; please report it with the weight."
            )
    return packed


def unpack(packed: W12Weight) -> torch.Tensor:
    """Decode a `W12Weight` on the CPU through numba -> BF16 [N, K] CPU tensor."""
    planes = {p: t.detach().cpu().numpy() for p, t in packed.planes().items()}
    planes["K"] = packed.K
    return torch.from_numpy(unpack_bits(planes).view(np.int16)).view(torch.bfloat16)
