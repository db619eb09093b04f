"""Packed W12 decode in PTX: two weights per 32-bit register op (bf16x2 lanes).

The plain decode (`tc._decode_bits`) spends ~7 integer ops per weight on int32 lanes. On the
H200 the CUDA-core GEMV was no faster for 1 byte per weight (q8) than for 1.5, so decode
instructions, not bytes, bound it. Here one `inline_asm_elementwise` call (pack=4)
takes 4 `hi` bytes and 4 `lo` bytes in one register each and builds two 16-bit lanes at once:

    t = prmt(h, 0, {h0, 0, h1, 0})                      # lanes = hi bytes 0..255
    n = prmt(lo, 0, {l0, 0, l1, 0}) [>> 4] & 0x000F000F  # lanes = nibbles
    bits = (((t << 4) & 0x07F007F0) | n) + E2 | ((t << 8) & 0x80008000)

which equals `((c & 0x7FF) + E) | ((c & 0x800) << 4)` per lane (c = hi << 4 | nib). No carry
crosses a lane: the sum is at most 0x7FF + 0x7800 (e0 <= 240, the format's bound) < 0x8000.
E2 comes as int16 elements, so each pair of lanes gets its own rows' `e0 << 7` (the asm is
purely lane-wise: which elements a pack holds does not matter). The q8 view uses no nibble and
takes its bin midpoint from E2, which the caller passes as the view's row constant ((e0 << 7) + 8 for e0 >= 1, 0
for e0 = 0: `tc._q8_base`).

Outputs: bf16 (two bf16x2 registers, the tensor-core operand) or fp32 (bf16 bits << 16, for the
GEMV and the tf32 path). The interpreter cannot run PTX: callers switch on a constexpr
(USE_ASM) and keep the plain decode for CPU; tests/w12/test_matmul.py replays the same op
sequence in torch, bit-exactly against the plain decode for every code and e0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["decode_pk", "asm_text"]

_SEL = ("0x4140", "0x4342")  # prmt selectors: bytes {0,1} / {2,3} into the low byte of each 16-bit lane


def asm_text(mode: str, out: str) -> str:
    """PTX for 4 weights. mode: 'lo' (low nibble), 'hi' (high nibble), 'q8', 'lo0' / 'hi0': the same as 'lo' /
    'hi' except that code 0 decodes to +0.0 (the dense decode of `lmhead`'s exact logits), or 'lo4' / 'hi4': the
    same bits as 'lo' / 'hi' in the flow kernel's four instructions a pair (`dec_pair` / `dec_pair_hi` of
    csrc/w12_common.cuh: one byte permute puts each lane's hi byte above its lo byte, two masks, one shift and add).
    out: 'bf16' | 'f32'. Registers: outputs first ($0,$1 for bf16; $0..$3 for f32), then h, lo, E pair 0, E pair 1."""
    if mode not in ("lo", "hi", "q8", "lo0", "hi0", "lo4", "hi4"):
        raise ValueError(f"pk_decode.asm_text: mode must be 'lo', 'hi', 'q8', 'lo0', 'hi0', 'lo4' or 'hi4', got "
                         f"{mode!r}")
    n_out = 2 if out == "bf16" else 4
    h, lo, e = f"${n_out}", f"${n_out + 1}", (f"${n_out + 2}", f"${n_out + 3}")
    if mode in ("lo4", "hi4"):
        return " ".join(["{", ".reg .b32 y, a, b, w;",
                         *(ln for p in range(2) for ln in _four_pair(p, h, lo, e[p], mode == "hi4", out)), "}"])
    if mode in ("lo0", "hi0"):
        return " ".join(["{", ".reg .b32 y, a, b, f, m, w;",
                         *(ln for p in range(2) for ln in _zero_code_pair(p, h, lo, e[p], mode == "hi0", out)), "}"])
    s = ["{", ".reg .b32 z, t, n, s, w;", "mov.b32 z, 0;"]
    for p in range(2):
        s.append(f"prmt.b32 t, {h}, z, {_SEL[p]};")
        s.append("shl.b32 s, t, 8;")
        s.append("and.b32 s, s, 0x80008000;")
        s.append("shl.b32 w, t, 4;")
        s.append("and.b32 w, w, 0x07F007F0;")
        if mode != "q8":
            s.append(f"prmt.b32 n, {lo}, z, {_SEL[p]};")
            if mode == "hi":
                s.append("shr.b32 n, n, 4;")
            s.append("and.b32 n, n, 0x000F000F;")
            s.append("or.b32 w, w, n;")
        s.append(f"add.u32 w, w, {e[p]};")
        s.append("or.b32 w, w, s;")
        s += _pair_out(p, out)
    s.append("}")
    # One line: torch.compile (inductor) re-emits these globals into generated Python source,
    # where an embedded newline became an unterminated string literal (H200, torch 2.11).
    return " ".join(s)


def _pair_out(p: int, out: str) -> list[str]:
    """Pair p's two decoded lanes in w to the outputs: one bf16x2 register ($p), or two fp32 ($2p, $2p + 1: each
    lane's bits shifted into the high half)."""
    if out == "bf16":
        return [f"mov.b32 ${p}, w;"]
    return [f"shl.b32 ${2 * p}, w, 16;", f"and.b32 ${2 * p + 1}, w, 0xFFFF0000;"]


def _four_pair(p: int, h: str, lo: str, e: str, high: bool, out: str) -> list[str]:
    """One pair of lanes in four instructions: y = (hi << 8 | lo byte) per lane, then ((y & offset and mantissa
    bits) >> 4) + ((y & sign and nibble) | E); with `high` the nibble is the lo byte's high one, kept beside the
    other bits so that the one shift brings both down. No carry crosses a lane (code & 0x7FF plus E <= 0x7FFF)."""
    keep, rest = ("0x7FF07FF0", "0x80008000") if high else ("0x7F007F00", "0x800F800F")
    s = [f"prmt.b32 y, {h}, {lo}, {('0x1504', '0x3726')[p]};",
         f"and.b32 a, y, {keep};",
         "shr.b32 a, a, 4;",
         f"and.b32 b, y, {rest};",
         f"or.b32 b, b, {e};",
         "add.u32 w, a, b;"]
    return s + _pair_out(p, out)


def _zero_code_pair(p: int, h: str, lo: str, e: str, high: bool, out: str) -> list[str]:
    """One pair of lanes with code 0 -> +0.0, in eleven instructions: the lanes y = hi << 8 | lo byte and the value
    of `_four_pair` (code & 0x7FF, the nibble, plus E, with the sign), then a lane mask m, 0xFFFF where the code is
    not 0. Bit 15 of f = ((y & code bits but the sign) + 0x7FFF) | y is set exactly where the code is not 0 (the
    sum carries into bit 15 where one of the other code bits is set, and stays below 0x10000: no lane overflows);
    a byte permute that replicates the sign of each lane's high byte spreads it over the lane."""
    keep, rest, bits = (("0x7FF07FF0", "0x80008000", "0x7FF07FF0") if high else
                        ("0x7F007F00", "0x800F800F", "0x7F0F7F0F"))
    s = [f"prmt.b32 y, {h}, {lo}, {('0x1504', '0x3726')[p]};",
         f"and.b32 a, y, {keep};",
         "shr.b32 a, a, 4;",
         f"and.b32 b, y, {rest};",
         f"or.b32 b, b, {e};",
         "add.u32 w, a, b;",
         f"and.b32 f, y, {bits};",
         "add.u32 f, f, 0x7FFF7FFF;",
         "or.b32 f, f, y;",
         "prmt.b32 m, f, f, 0xBB99;",
         "and.b32 w, w, m;"]
    return s + _pair_out(p, out)


_ASM = {(m, o): asm_text(m, o) for m in ("lo", "hi", "q8") for o in ("bf16", "f32")}


@triton.jit
def decode_pk(h, lo, E16, MODE: tl.constexpr, F32: tl.constexpr):
    """h, lo: uint8 [BN, BKH] (lo ignored for q8); E16: int16 [BN, 1] = e0 << 7.
    MODE: 0 low nibble, 1 high nibble, 2 q8. Returns bf16 (F32=False) or fp32 [BN, BKH]."""
    # (the asm text is picked inline: a str bound to a local would be taken for a tensor)
    if F32:  # four fp32 results per 32-bit input lane
        w = tl.inline_asm_elementwise(_ASM_LO_F32 if MODE == 0 else _ASM_HI_F32 if MODE == 1 else _ASM_Q8_F32,
                                      "=r,=r,=r,=r,r,r,r,r", [h, lo, E16], tl.float32, True, 4)
    else:  # four bf16 results in two 32-bit registers
        w = tl.inline_asm_elementwise(_ASM_LO_BF16 if MODE == 0 else _ASM_HI_BF16 if MODE == 1 else _ASM_Q8_BF16,
                                      "=r,=r,r,r,r,r", [h, lo, E16], tl.bfloat16, True, 4)
    return w


# module-level constexprs: the jit reads globals by name
_ASM_LO_BF16 = tl.constexpr(_ASM[("lo", "bf16")])
_ASM_HI_BF16 = tl.constexpr(_ASM[("hi", "bf16")])
_ASM_Q8_BF16 = tl.constexpr(_ASM[("q8", "bf16")])
_ASM_LO_F32 = tl.constexpr(_ASM[("lo", "f32")])
_ASM_HI_F32 = tl.constexpr(_ASM[("hi", "f32")])
_ASM_Q8_F32 = tl.constexpr(_ASM[("q8", "f32")])
