"""CPU checks of the flow kernel (w12/csrc/w12_flow.cu, FlowConfig) without a GPU.

1. The kernel's algorithm replayed lane by lane (`flow_emu.emulate`: CTA / warp split, ring images, fragments,
   fixed-base decode, x-range guard and exact-base recomputation, K-split reduction in warp order, escapes in CSR
   order, bias) gives `w12.matmul_reference`'s output rounded to BF16 bit for bit, on odd shapes, hostile weight rows
   and hostile x; the one documented difference (x non-finite at a column that holds an escape: NaN) is checked
   where it applies.
2. In an fp32 model of the arithmetic, the fixed-base build with its guard equals the exact-base build bit for bit,
   and without the guard it does not (subnormal products).
3. The ladder steps' oracles (`w12.flow.ladder_weight`): step "c" is the dense decode alone at kw = 1.
4. NVRTC builds every ladder step for sm_80 and sm_90 with mma.sync, cp.async with the evict-first policy, no
   local memory and no spills; the host layer (configs, heuristic, shared memory, grid, the layout cache, the
   forced-config path of w12.matmul).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import autotune
import w12
from w12 import flow, layout
from w12.configs import FlowConfig, flow_heuristic
from specpilot.testing import assert_close, mma_loop, sass

from flow_emu import (dec_exact, dec_exact_hi, dec_fixed, emulate, hostile_weight, lanes_f64, one_unit_tiny_case,
                      wg_operand, wg_operand_split, wg_slot, wg_slot_stm, words)


def _bf16_bits(v64: np.ndarray | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(v64, dtype=torch.float64)
    return t.to(torch.bfloat16).view(torch.int16)


def _assert_bf16_equal(got: np.ndarray, want: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """got (fp64, the kernel's value before its rounding) and want (fp64 reference) round to the same BF16 bits;
    NaN matches NaN whatever its payload; `skip` marks outputs left out (checked by the caller)."""
    a, b = _bf16_bits(got), _bf16_bits(want)
    nan_a, nan_b = torch.isnan(torch.as_tensor(got)), torch.isnan(want)
    keep = torch.ones_like(nan_a) if skip is None else ~skip
    assert torch.equal(nan_a & keep, nan_b & keep), "NaN positions differ"
    bad = keep & ~nan_a & (a != b)
    assert not bad.any(), f"{int(bad.sum())} outputs differ, first at {bad.nonzero()[0].tolist()}"


def _x(M: int, K: int, seed: int) -> torch.Tensor:
    return (torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 1.5).to(torch.bfloat16)


def _check_decode(e0: int, c0: np.ndarray, c1: np.ndarray, rng: np.random.Generator) -> None:
    """dec_pair (w12_common.cuh; flow_emu.dec_exact) on lanes `hi << 8 | lo byte`, codes c0 and c1 (hi = code >> 4,
    the nibble code & 15 in the lo byte's low half, a random nibble of another column in its high half): the code's
    value (sign, exponent e0 + offset, 7 mantissa bits) and the three-term form's bits; the fixed base's bits where
    the base is 112 (0 where e0 = 0)."""
    hi0, n0, hi1, n1 = c0 >> 4, c0 & 15, c1 >> 4, c1 & 15
    g0, g1 = (rng.integers(0, 16, c0.size, dtype=np.uint32) for _ in range(2))
    y = ((hi0 << 8) | n0 | (g0 << 4) | (((hi1 << 8) | n1 | (g1 << 4)) << 16)).astype(np.uint32)
    e0x = np.uint32((e0 << 7) | (e0 << 23))
    got = dec_exact(y, e0x)
    val = lambda hi, n: ((hi & 0x80) << 8) + ((((hi >> 3) & 15) + e0) << 7) + ((hi & 7) << 4) + n
    assert np.array_equal(got, (val(hi0, n0) | (val(hi1, n1) << 16)).astype(np.uint32))
    three = ((y & np.uint32(0x800F800F)) + ((y >> np.uint32(4)) & np.uint32(0x07F007F0)) + e0x).astype(np.uint32)
    assert np.array_equal(got, three)
    kf = np.uint32(0 if e0 == 0 else 0x38003800)
    assert np.array_equal(dec_exact(y, kf), dec_fixed(y, kf))
    # dec_pair_hi on the same codes with each nibble in the high half of its lo byte (k-steps 2 and 3)
    y_hi = ((hi0 << 8) | (n0 << 4) | g0 | (((hi1 << 8) | (n1 << 4) | g1) << 16)).astype(np.uint32)
    assert np.array_equal(dec_exact_hi(y_hi, e0x), got)


@pytest.mark.parametrize("e0", [0, 1, 112, 240])
def test_decode_is_the_code_value_on_every_pair_of_codes(e0):
    """dec_pair's masks and one shift-and-add give each lane's value for every pair of 12-bit codes in the two lanes,
    bit for bit the three-term form it replaced and, with the fixed base, the fixed-base decode; dec_pair_hi the same
    bits with the nibbles in the high half of their bytes."""
    code = np.arange(4096, dtype=np.uint32)
    _check_decode(e0, np.repeat(code, 4096), np.tile(code, 4096), np.random.default_rng(e0))


def test_decode_is_the_code_value_at_every_base():
    """The same at every window base of the format, 0..240 (offset + base <= 255): every code in each lane beside
    random codes in the other."""
    rng = np.random.default_rng(7)
    code = np.arange(4096, dtype=np.uint32)
    other = rng.integers(0, 4096, 4096, dtype=np.uint32)
    for e0 in range(241):
        _check_decode(e0, np.concatenate([code, other]), np.concatenate([other, code]), rng)


# M, N, K, warps, kw, bias: partial row blocks, masked tails, K splits wider than the full groups, inactive row blocks
CASES = [(1, 75, 200, 4, 2, False), (5, 40, 130, 8, 4, True), (13, 17, 64, 2, 1, False), (32, 33, 100, 8, 8, False),
         (20, 16, 63, 4, 4, False), (9, 130, 256, 16, 2, True), (24, 21, 192, 8, 1, False)]


@pytest.mark.parametrize("M,N,K,warps,kw,bias", CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-w{c[3]}-k{c[4]}" + ("-bias" if c[5] else "") for c in CASES])
def test_emulated_kernel_matches_reference_bitwise(M, N, K, warps, kw, bias):
    w = hostile_weight(N, K, seed=N * K + M)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=M + K)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16) if bias else None
    want = w12.matmul_reference(x, p, b)
    _assert_bf16_equal(emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False)[0], want)  # the default build
    got, stats = emulate(x, t, warps=warps, kw=kw, bias=b)  # the fixed-base build
    _assert_bf16_equal(got, want)
    if N > 4:
        assert stats["fallback"] > 0, "rows of huge and tiny weights take the exact-base recomputation"
    if N > 16:
        assert stats["scaled"] > 0, "row blocks of plain rows scale"


# M, N, K, warps, kw: an odd number of row blocks (the last row group's second block past the weight), a partial
# last block in either half of a row group, K splits with a masked tail, 1 and 4 token tiles
RB2_CASES = [(1, 75, 200, 4, 2), (32, 33, 100, 8, 8), (9, 130, 256, 4, 1), (20, 40, 130, 8, 4)]


@pytest.mark.parametrize("M,N,K,warps,kw", RB2_CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-w{c[3]}-k{c[4]}" for c in RB2_CASES])
def test_two_row_blocks_per_warp_equal_one_bitwise(M, N, K, warps, kw):
    """W12F_RB = 2 (a warp multiplies two row blocks by the same x fragments): the reference's BF16 bits, and in the
    fp32 model of the arithmetic every output the same value as the RB = 1 build (each block's sum is the same
    sequence of operations)."""
    w = hostile_weight(N, K, seed=3 * N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=K - M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    _assert_bf16_equal(emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, rb=2)[0], w12.matmul_reference(x, p, b))
    one, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, fp32=True)
    two, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, fp32=True, rb=2)
    assert np.array_equal(one, two, equal_nan=True)


# M, N, K, warps, kw, kc, rb: K pieces wider than the full groups (K = 64, 130: pieces with no unit), the masked tail
# in the last rank's last warp, partial and inactive row blocks, two row blocks per warp, 1 and 4 token tiles
KC_CASES = [(1, 75, 200, 4, 2, 2, 1), (32, 33, 100, 4, 4, 4, 1), (9, 130, 256, 4, 1, 2, 1), (20, 40, 130, 8, 4, 2, 2),
            (5, 17, 64, 2, 2, 4, 1), (12, 40, 330, 4, 2, 3, 1)]


@pytest.mark.parametrize("M,N,K,warps,kw,kc,rb", KC_CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-w{c[3]}-k{c[4]}-q{c[5]}-r{c[6]}" for c in KC_CASES])
def test_k_split_across_ctas_matches_reference_bitwise(M, N, K, warps, kw, kc, rb):
    """W12F_KC (the CTAs of a cluster split K, rank 0 adds their sums in rank order): the reference's BF16 bits on
    hostile rows, and in the fp32 model of the arithmetic a sum that differs from the one-CTA build only by where
    the partial sums meet (so the split is really taken: kc pieces of K, not one)."""
    w = hostile_weight(N, K, seed=5 * N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=K + 2 * M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    want = w12.matmul_reference(x, p, b)
    _assert_bf16_equal(emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, rb=rb, kc=kc)[0], want)
    # as kc x kw warps of one CTA would split it, the pieces are the same; only the order of the additions differs
    split, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, fp32=True, rb=rb, kc=kc)
    again, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, fp32=True, rb=rb, kc=kc)
    assert np.array_equal(split, again, equal_nan=True)  # deterministic: no order left to timing


def test_k_split_across_ctas_adds_in_rank_order():
    """Rank 0 adds the CTAs' sums in rank order, whatever order they arrive in: in the fp32 model, a huge piece of K
    first and three small ones after it lose the small ones to rounding (a tie to even each time), where the small
    ones added first would have survived; so the emulated order is the one the test pins."""
    N, K, M = 16, 256, 8
    w = torch.full((N, K), 2.0 ** -3)
    w[:, :64] = 2.0 ** 10  # rank 0's piece (one 64-column unit each at kc = 4): 64 x 2^10 x 2^10 = 2^26
    x = torch.full((M, K), 2.0 ** -1)
    x[:, :64] = 2.0 ** 10  # ranks 1..3: 64 x 2^-3 x 2^-1 = 4 each, half an fp32 ulp of 2^26
    p = w12.pack(w.to(torch.bfloat16), layout="planes")
    assert p.esc_col.numel() == 0  # both values in the rows' window: no escape corrections in the sum
    t = layout.tile(p)
    got, _ = emulate(x.to(torch.bfloat16), t, warps=1, kw=1, fixed=False, fp32=True, kc=4)
    assert np.all(got == 2.0 ** 26)  # ((2^26 + 4) + 4) + 4, each a tie rounded to even
    one, _ = emulate(x.to(torch.bfloat16), t, warps=4, kw=4, fixed=False, fp32=True)  # one CTA: the same order
    assert np.array_equal(got, one)
    assert np.float32(np.float32(4.0 + 4.0) + 4.0) + np.float32(2.0 ** 26) == 2.0 ** 26 + 16  # the other order


@pytest.mark.parametrize("nt", [1, 4])
def test_k_split_across_ctas_builds_for_sm90_only(nt, jit_cache):
    cfg = FlowConfig(warps=4, kw=4, cps=4, kc=2)
    b = flow.build(cfg, nt, (9, 0))
    ptx = b.ptx.read_text()
    assert "mapa.shared::cluster" in ptx and "st.shared::cluster.f32" in ptx and "barrier.cluster.arrive" in ptx
    assert ".reqnctapercluster 2" in ptx or ".explicitcluster" in ptx
    r = b.resources()
    assert r["spill_stores"] == 0 and r["stack"] == 0
    with pytest.raises(ValueError, match="needs sm_90"):
        flow.spec(cfg, nt, (8, 0))
    with pytest.raises(ValueError, match="only with the reduction"):
        flow.spec(cfg, nt, (9, 0), step="d")


@pytest.mark.parametrize("M", [1, 8, 13, 32, 40, 64])
def test_warpgroup_operand_is_the_fragment_order(M):
    """The warpgroup build's x slot (each thread's 4-byte stores), read through the no-swizzle K-major descriptor
    layout with the kernel's byte offsets, is the B operand mma.sync reads from the lanes' x fragments, for every
    k-step and token, token rows past M zero (at 5-8 token tiles through the kernel's two descriptors, the second
    512 bytes further); with the two offsets swapped (W12F_WG_SWAP) it is not, where there is more than one token
    group (so the test tells the orientations apart)."""
    NT = -(-M // 8)
    K = 192
    x = torch.zeros(8 * NT, K, dtype=torch.bfloat16)
    x[:M] = _x(M, K, seed=M)
    xw = words(x.view(torch.uint8).numpy().reshape(8 * NT, -1))
    lane = np.arange(32)
    g, p = lane // 4, lane % 4
    for c in range(K // 64):
        slot = wg_slot(xw, M, NT, c)
        assert not (slot == 0xDEADBEEF).any(), "a word of the slot is left unwritten"
        for s in range(4):
            want = np.zeros((16, 8 * NT))
            for j in range(NT):  # mma.sync's B fragments: lane (g, p), words 2 s and 2 s + 1 of its 16 columns
                for wi, dk in ((2 * s, 0), (2 * s + 1, 8)):
                    tok = 8 * j + g
                    l0, l1 = lanes_f64(xw[tok, (64 * c + 16 * p) // 2 + wi])
                    want[2 * p + dk, tok] = np.where(tok < M, l0, 0.0)
                    want[2 * p + dk + 1, tok] = np.where(tok < M, l1, 0.0)
            got = wg_operand_split(slot, NT, s, 128 * NT, 128)
            assert np.array_equal(got, want), f"unit {c}, k-step {s}"
            if NT > 1:
                assert not np.array_equal(wg_operand(slot, NT, s, 128, 128 * NT), want)
        if NT <= 4:  # x through stmatrix (W12F_WG_STM, up to 4 token tiles): the same slot, word for word
            assert np.array_equal(wg_slot_stm(xw, M, NT, c), slot), f"unit {c}: stmatrix's slot"


# M, N, K, warps, kw, kc: a warpgroup whose last row blocks are past the weight (N = 75: 5 row blocks), a partial
# last block, masked tails, a K split across warpgroups and across the CTAs of a cluster, 1 to 8 token tiles
WG_CASES = [(1, 75, 200, 4, 1, 1), (32, 33, 100, 8, 2, 1), (16, 130, 256, 8, 1, 1), (20, 40, 130, 8, 2, 2),
            (9, 17, 64, 4, 1, 2), (24, 64, 320, 16, 4, 1), (32, 75, 300, 4, 1, 4), (32, 70, 400, 8, 2, 3),
            (40, 75, 200, 4, 1, 1), (64, 33, 130, 8, 2, 2)]  # and 5-8 token tiles (two wgmma a k-step)


@pytest.mark.parametrize("M,N,K,warps,kw,kc", WG_CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-w{c[3]}-k{c[4]}-q{c[5]}" for c in WG_CASES])
def test_warpgroup_build_matches_reference_bitwise(M, N, K, warps, kw, kc):
    """W12F_WG (4 warps' rows through one wgmma, x from the warpgroup's slot): the reference's BF16 bits on hostile
    rows with a bias, and in the fp32 model the same value as the mma.sync build wherever the K pieces are the
    same (kw = 1, kc = 1: every row block's sum is the same sequence of k-steps). The swapped descriptor gives
    other values where there is more than one token group."""
    w = hostile_weight(N, K, seed=11 * N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=K + M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    want = w12.matmul_reference(x, p, b)
    got, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, kc=kc, wg=True)
    _assert_bf16_equal(got, want)
    if kw == 1 and kc == 1:
        one, _ = emulate(x, t, warps=4, kw=1, bias=b, fixed=False, fp32=True)
        four, _ = emulate(x, t, warps=warps, kw=1, bias=b, fixed=False, fp32=True, wg=True)
        assert np.array_equal(one, four, equal_nan=True)
    if M > 8:
        swapped, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, kc=kc, wg=True, swap=True)
        assert not np.array_equal(swapped, got, equal_nan=True)


@pytest.mark.parametrize("nt", [1, 2, 3, 4, 5, 8])
def test_warpgroup_build_compiles_for_sm90a(nt, jit_cache):
    """The warpgroup build: sm_90a, wgmma of n = 8 nt tokens with A from registers (at 5-8 token tiles two, n = 32
    and n = 8 nt - 32), the proxy fence and the named barrier per warpgroup, 4-byte x stores, no spills and no
    serialised wgmma (ptxas says so in its log)."""
    cfg = FlowConfig(warps=8, kw=2, cps=2, wg=True)
    b = flow.build(cfg, nt, (9, 0))
    ptx = b.ptx.read_text()
    for n in ([8 * nt] if nt <= 4 else [32, 8 * nt - 32]):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and "wgmma.wait_group.sync.aligned" in ptx and "bar.sync" in ptx
    assert "st.shared.b32" in ptx
    assert ".target sm_90a" in ptx
    r = b.resources()
    assert r["spill_stores"] == 0 and r["stack"] == 0
    assert "serialized" not in b.log.read_text()
    assert flow.smem_bytes(cfg, nt) == flow.smem_bytes(FlowConfig(warps=8, kw=2, cps=2), nt) + 2 * 3 * nt * 1024
    with pytest.raises(ValueError, match="needs sm_90"):
        flow.spec(cfg, nt, (8, 0))
    with pytest.raises(ValueError, match="reads no x"):
        flow.spec(cfg, nt, (9, 0), step="a")
    with pytest.raises(ValueError, match="a step of the warpgroup build"):
        flow.spec(FlowConfig(warps=8, kw=2, cps=2), min(nt, 4), (9, 0), step="e-depth1")
    if nt > 4:  # the mma.sync build and the warpgroup variants stop at 4 token tiles
        with pytest.raises(ValueError, match="1..4 token tiles"):
            flow.spec(FlowConfig(warps=8, kw=2, cps=2), nt, (9, 0))
        with pytest.raises(ValueError, match="shipped warpgroup steps only"):
            flow.spec(cfg, nt, (9, 0), step="e-stm")
        return
    # x through stmatrix (W12F_WG_STM): two stmatrix.x4 per unit in place of the 4-byte stores, no spills
    s = flow.build(cfg, nt, (9, 0), defines={"W12F_WG_STM": 1})
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in s.ptx.read_text()
    assert s.resources()["spill_stores"] == 0 and "serialized" not in s.log.read_text()


def test_warpgroup_config_is_checked():
    assert FlowConfig(warps=8, kw=2, wg=True).tag().endswith("-g")
    for bad in (dict(warps=4, kw=2), dict(warps=8, kw=4), dict(warps=8, kw=2, fixed=True), dict(warps=8, kw=2, rb=2),
                dict(warps=2, kw=1)):
        with pytest.raises(ValueError, match="wg=True"):
            FlowConfig(wg=True, **bad)


@pytest.mark.parametrize("kind", ["nonfinite", "subnormal"])
def test_emulated_kernel_with_hostile_x(kind):
    """x with NaN, +-Inf, +-0 and subnormals: equal to the reference except where x is non-finite at a column that
    holds an escape of the row, where the kernel gives NaN (w12.matmul's documented difference); finite hostile x
    (subnormals, +-0) sends every warp with e0 != 0 rows to the exact base, and matches everywhere."""
    M, N, K = 11, 37, 150
    w = hostile_weight(N, K, seed=7)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=3)
    bits = x.view(torch.int16)
    g = torch.Generator().manual_seed(5)
    pool = [0x0000, -0x8000, 0x0001, 0x007F, -0x7F81]  # +0, -0, subnormals (0x807F as int16)
    if kind == "nonfinite":
        pool += [0x7F80, 0x7FC0, 0xFF80 - 0x10000]  # +Inf, NaN, -Inf
    idx = torch.randperm(M * K, generator=g)[: M * K // 12]
    bits.view(-1)[idx] = torch.tensor(pool, dtype=torch.int16)[torch.randint(0, len(pool), (idx.numel(),), generator=g)]
    got, stats = emulate(x, t, warps=4, kw=2)
    want = w12.matmul_reference(x, p)
    esc = torch.zeros(N, K, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(N), (p.esc_rowptr[1:] - p.esc_rowptr[:-1]).long())
    esc[rows, p.esc_col.long()] = True
    diff = (~torch.isfinite(x.float())).double() @ esc.double().T > 0  # [M, N]
    _assert_bf16_equal(got, want, skip=diff)
    assert np.isnan(got[diff.numpy()]).all()
    assert stats["fallback"] > 0
    if kind == "nonfinite":
        assert diff.any()


@pytest.mark.parametrize("x_exp", [-40, -8, 0, 30])
def test_fixed_base_with_guard_equals_exact_base_in_fp32(x_exp):
    """fp32 model (every mma sum and later step rounded to fp32): the fixed-base build with its guard gives the
    exact-base build's bits; rows of tiny weights (e0 ~ 20) times tiny x give subnormal products, where scaling
    without the guard would differ."""
    M, N, K = 3, 48, 128
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    w[:16] = (torch.randn(16, K, generator=g) * 2.0**-105).to(torch.bfloat16)  # e0 ~ 20: s ~ -92
    w[16:32] = (torch.randn(16, K, generator=g) * 2.0**90).to(torch.bfloat16)  # e0 ~ 210: s ~ 98
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = (torch.randn(M, K, generator=g) * 2.0**x_exp).to(torch.bfloat16)
    exact, _ = emulate(x, t, warps=4, kw=2, fixed=False, fp32=True)
    fixed, stats = emulate(x, t, warps=4, kw=2, fp32=True)
    assert torch.equal(_bf16_bits(fixed), _bf16_bits(exact)) and torch.equal(torch.tensor(fixed), torch.tensor(exact))
    assert stats["fallback"] > 0 and stats["scaled"] > 0
    if x_exp == -40:
        unguarded, _ = emulate(x, t, warps=4, kw=2, fp32=True, guard=False)
        assert not np.array_equal(unguarded, exact), "the guard is needed here"


@pytest.mark.parametrize("unit", [0, 3, 7, 8])
def test_every_unit_reaches_the_guard(unit):
    """The x range is folded by the CTA's active row blocks in turn, one unit each. With 3 of 4 row blocks active
    (N = 48, warps = 8, kw = 2: 4 units per K range plus the masked tail) and x non-zero (near 2^-40) in one unit
    only (3 and 7: the fourth turn of each K range, 8: the tail), the guard still fires, and the fixed-base build
    gives the exact-base build's bits (fp32 model). With normal x everywhere the guard passes every row."""
    w, calm, x = one_unit_tiny_case(unit)
    t = layout.tile(w12.pack(w, layout="planes"))
    assert emulate(calm, t, warps=8, kw=2, fp32=True)[1]["fallback"] == 0
    exact, _ = emulate(x, t, warps=8, kw=2, fixed=False, fp32=True)
    fixed, stats = emulate(x, t, warps=8, kw=2, fp32=True)
    assert stats["fallback"] > 0, "the guard saw the tiny unit"
    assert torch.equal(torch.tensor(fixed), torch.tensor(exact))
    unguarded, _ = emulate(x, t, warps=8, kw=2, fp32=True, guard=False)
    assert not np.array_equal(unguarded, exact), "the guard is needed here"


def test_ladder_step_c_is_the_dense_decode_at_kw_1():
    M, N, K = 6, 35, 140
    w = hostile_weight(N, K, seed=2)
    w = torch.where(torch.isfinite(w.float()), w, torch.zeros_like(w))  # finite, so the escape correction matters
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=9)
    got, _ = emulate(x, t, warps=4, kw=1, esc=False, red=False)
    wc = flow.ladder_weight(p, "c")
    _assert_bf16_equal(got, torch.nn.functional.linear(x.double(), wc.double()))
    assert not torch.equal(wc.view(torch.int16), w.view(torch.int16))
    assert torch.equal(flow.ladder_weight(p, "d").view(torch.int16), w.view(torch.int16))
    assert flow.ladder_weight(p, "a") is None and flow.ladder_weight(p, "b") is None
    # with kw > 1 and no reduction a row block holds warp 0's share only
    part, _ = emulate(x, t, warps=4, kw=2, red=False)
    assert not torch.equal(_bf16_bits(part), _bf16_bits(w12.matmul_reference(x, p)))


# --------------------------------------------------------------------------------------
# NVRTC builds and the host layer
# --------------------------------------------------------------------------------------


def _check_build(b, step: str, arch, cfg: FlowConfig) -> str:
    res = b.resources()
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert 0 < res["registers"] <= 65536 // (32 * cfg.warps * cfg.cps), res  # the launch bound's register budget
    ptx = b.ptx.read_text()
    assert f".target sm_{arch[0]}{arch[1]}\n" in ptx
    assert ".local" not in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    assert ("st.global.u16" in ptx) == (step in "cde")  # the bf16 output store
    # the CTA barrier: the x range of the fixed base (steps c..e) and the K-split reduction (step e, kw > 1)
    assert ("bar.sync" in ptx) == (step in "cde" and cfg.fixed or step == "e" and cfg.kw > 1)
    return ptx


@pytest.mark.slow
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_every_ladder_step_builds(arch, jit_cache):
    for cfg in (FlowConfig(), FlowConfig(fixed=True)):
        for step in "abcde":
            ptx = _check_build(flow.build(cfg, 1, arch, step=step), step, arch, cfg)
            assert "createpolicy.fractional.L2::evict_first" in ptx and "L2::cache_hint" in ptx
            assert ("ld.global.nc.v4" in ptx) == (step != "a")  # x, read from step b on
    for nt in (2, 3, 4):
        for cfg in (FlowConfig(warps=8, kw=4), FlowConfig(warps=8, kw=4, fixed=True)):
            _check_build(flow.build(cfg, nt, arch), "e", arch, cfg)
    xh = FlowConfig(warps=4, kw=1, stages=3, cps=4, xh=True)  # x by halves: step a reads no x, the rest do
    for step in "abcde":
        _check_build(flow.build(xh, 4, arch, step=step), step, arch, xh)


@pytest.mark.slow
def test_options_build(jit_cache):
    """The exact-base build (the default: no guard, no x range, no barrier at kw = 1), the build without the L2
    policy, and the shapes of the heuristic (kw 1, 8; 16 warps; 1 CTA per SM)."""
    arch = (9, 0)
    exact = flow.spec(FlowConfig(kw=1, fixed=False), 1, arch).ptx().read_text()
    assert "bar.sync" not in exact and "redux.sync" not in exact and "st.global.u16" in exact
    keep = flow.spec(FlowConfig(evict=False), 1, arch).ptx().read_text()
    assert "createpolicy" not in keep and "cache_hint" not in keep
    for cfg, nt in [(FlowConfig(warps=8, kw=8), 4), (FlowConfig(warps=16, kw=4, cps=1, stages=6), 2),
                    (FlowConfig(warps=8, kw=2, cps=1, rb=2), 4), (FlowConfig(warps=8, kw=8, rb=2), 1)]:
        _check_build(flow.build(cfg, nt, arch), "e", arch, cfg)


@pytest.mark.slow
def test_x_sets_build_without_local_memory(jit_cache):
    """FlowConfig.xd = 1, 2 (x loaded that many units ahead into sets of its own): no stack and no spills at the
    shapes the heuristic gives it (1-2 token tiles; the full format and the 8-bit view), for sm_90 and sm_80."""
    arch = (9, 0)
    for cfg, nt in [(FlowConfig(warps=4, kw=4, stages=3, cps=4, kc=2, xd=2), 1), (FlowConfig(warps=4, kw=2, stages=3,
                    cps=4, xd=2), 1), (FlowConfig(warps=2, kw=2, cps=4, kc=3, xd=1), 2), (FlowConfig(xd=1), 2)]:
        for q8 in (False, True):
            r = flow.build(cfg, nt, arch, q8=q8).resources()
            assert r["stack"] == 0 and r["spill_stores"] == 0, (cfg.tag(), nt, q8, r)
    for cfg in (FlowConfig(fixed=True, xd=1), FlowConfig(warps=4, kw=2, stages=3, cps=4, xd=2)):
        _check_build(flow.build(cfg, 1, arch), "e", arch, cfg)
        _check_build(flow.build(cfg, 1, (8, 0)), "e", (8, 0), cfg)
    assert dict(flow.spec(FlowConfig(xd=2), 1, arch).defines)["W12F_XD"] == "2"


@pytest.mark.slow
def test_x_by_halves_builds_with_fewer_registers_and_loads_between_the_halves(jit_cache):
    """FlowConfig.xh (one x set, each half reloaded for the next unit once the mma that read it are issued): no stack
    and no spills at 2 and 4 token tiles in the 5120-row layers' 3-CTA cluster shape at 4 and 5 CTAs per SM and in
    its 4-CTA split; fewer registers than the two sets of xd = 1 at the same bound; and in the main loop's SASS
    each half's loads come after the mma of the k-steps that read it: half 0's between k-steps 1 and 2, half 1's
    after the last."""
    arch = (9, 0)
    base = FlowConfig(warps=4, kw=2, stages=3, cps=4, kc=3)
    for nt in (2, 4):
        two = flow.build(dataclasses.replace(base, xd=1), nt, arch).resources()
        for cfg in (dataclasses.replace(base, xh=True), dataclasses.replace(base, cps=5, xh=True),
                    dataclasses.replace(base, cps=5, kc=4, xh=True)):
            b = flow.build(cfg, nt, arch)
            r = b.resources()
            assert r["stack"] == 0 and r["spill_stores"] == 0, (cfg.tag(), nt, r)
            if cfg.cps == base.cps:
                assert r["registers"] < two["registers"], (cfg.tag(), nt, r, two)
            loop = mma_loop(sass(b.cubin))
            mma = [i for i, t in enumerate(loop) if "HMMA" in t]
            xld = [i for i, t in enumerate(loop) if "LDG.E.128" in t]
            assert len(mma) == 4 * nt and len(xld) == 2 * nt, (cfg.tag(), nt, loop)
            assert sum(mma[2 * nt - 1] < i < mma[2 * nt] for i in xld) == nt, (cfg.tag(), nt, loop)
            assert sum(i > mma[-1] for i in xld) == nt, (cfg.tag(), nt, loop)


def test_x_staged_in_shared_memory_config():
    """FlowConfig.xs: its tag (-xs) round-trips, its define is set only where on (the other builds' sources as they
    were), its shared memory is one x ring per K piece (stages slots of 1 KB per token tile; none for ladder step a,
    which reads no x) with a cluster's sums received in the rings, and the builds it cannot join are refused."""
    c = FlowConfig(warps=4, kw=1, stages=3, cps=5, kc=4, kg=True, xs=True)
    assert c.tag() == "flow-w4-k1-s3-c5-p4-xs" and FlowConfig.from_tag(c.tag()) == c
    assert dict(flow.spec(c, 4, (9, 0)).defines)["W12F_XRING"] == "1"
    assert "W12F_XRING" not in dict(flow.spec(dataclasses.replace(c, xs=False), 4, (9, 0)).defines)
    plain = dataclasses.replace(c, xs=False)
    assert flow.smem_bytes(c, 4) == flow.smem_bytes(plain, 4) + 3 * 4 * 1024
    two = FlowConfig(warps=8, kw=2, stages=4, cps=2, xs=True)
    assert flow.smem_bytes(two, 2) == flow.smem_bytes(dataclasses.replace(two, xs=False), 2) + 2 * 4 * 2 * 1024
    assert flow.smem_bytes(c, 4, "a") == flow.smem_bytes(plain, 4, "a")
    # in a cluster, rank 0 receives the other CTAs' sums (3 of 4 row groups x 4 token tiles x 512 bytes) in its rings
    q4 = dataclasses.replace(c, kg=False)
    assert flow.smem_bytes(dataclasses.replace(q4, xs=False), 4) == 4 * 3 * 1536 + 3 * 4 * 4 * 512 + 4 * 1024
    assert flow.smem_bytes(q4, 4) == 4 * 3 * 1536 + 3 * 4 * 1024 + 4 * 1024
    # where they do not fit (2 slots: 20 KB of rings for 24 KB of sums), they keep their own place
    s2 = dataclasses.replace(q4, stages=2)
    assert flow.smem_bytes(s2, 4) == 4 * 2 * 1536 + 2 * 4 * 1024 + 3 * 4 * 4 * 512 + 4 * 1024
    assert flow.smem_bytes(s2, 1) == 4 * 2 * 1536 + 2 * 1 * 1024
    for bad in (dict(xd=1), dict(xh=True), dict(wg=True), dict(fixed=True, kc=1, kg=False)):
        with pytest.raises(ValueError, match="xs=True"):
            dataclasses.replace(c, **bad)


@pytest.mark.parametrize("rw", [1, 2, 4, 8])
@pytest.mark.parametrize("nt,m", [(1, 1), (1, 8), (2, 11), (3, 17), (4, 32), (4, 27)])
def test_x_staged_in_shared_memory_copies_each_lane_its_fragment(rw, nt, m):
    """The staged-x copy plan of w12_flow.cu (XS), replayed: the RW warps of a K piece copy a unit's 64 NT 16-byte
    chunks, thread xt = 32 warp + lane taking chunks xt + 32 RW r (r < ceil(64 NT / 32 RW)), chunk q = 64 j + 2 l + v
    from token 8 j + l / 4, columns 16 (l % 4) + 8 v of the unit (zero-filled past M) to slot offset
    16 (64 j + 32 v + l); each lane (g, p) of each warp then reads, at 16 ((2 j + v) 32 + lane), what load_x loads:
    token 8 j + g, columns 16 p + 8 v .. + 7 (zeros past M). Every chunk is written once."""
    g = torch.Generator().manual_seed(nt * 100 + m)
    unit = torch.randint(-2 ** 15, 2 ** 15, (m, 64), generator=g, dtype=torch.int32).to(torch.int16)
    slot = torch.full((64 * nt, 8), 0x7FFF, dtype=torch.int16)  # chunks of 8 bf16, never-written marker
    written = torch.zeros(64 * nt, dtype=torch.int32)
    per = -(-64 * nt // (32 * rw))
    for xt in range(32 * rw):
        for r in range(per):
            q = xt + 32 * rw * r
            if q >= 64 * nt:
                continue
            j, l, v = q >> 6, (q >> 1) & 31, q & 1
            tok, dst = 8 * j + (l >> 2), 64 * j + 32 * v + l
            col = 16 * (l & 3) + 8 * v
            slot[dst] = unit[tok, col:col + 8] if tok < m else 0
            written[dst] += 1
    assert bool((written == 1).all())
    for lane in range(32):
        gg, p = lane >> 2, lane & 3
        for j in range(nt):
            for v in range(2):
                tok, col = 8 * j + gg, 16 * p + 8 * v
                want = unit[tok, col:col + 8] if tok < m else torch.zeros(8, dtype=torch.int16)
                assert torch.equal(slot[(2 * j + v) * 32 + lane], want), (lane, j, v)


@pytest.mark.slow
@pytest.mark.parametrize("tag,arch", [("w4-k1-s3-c5-p4-xs", (9, 0)), ("w4-k1-s3-c5-q4-xs", (9, 0)),
                                      ("w8-k2-s3-c2-xs", (9, 0)), ("w4-k1-s3-c5-p4-xs", (8, 0)),
                                      ("w4-k1-s3-c4-r2-q4-xs", (9, 0)), ("w2-k1-s3-c8-q4-xs", (9, 0))])
def test_x_staged_in_shared_memory_builds_without_spills_and_reads_x_from_the_ring(tag, arch, jit_cache):
    """The staged-x builds at 2 and 4 token tiles (full row blocks, as the 5120-row layers launch them): no stack or
    spills, and a main loop whose x comes from the ring: no global load, 2 NT 16-byte shared loads of x beside the
    tiles' two each, the tiles' three copies each (L2 only) and the thread's share of the x copies (through L1), and
    one barrier of the K piece; with two row blocks a warp, the same x fragments feed both."""
    cfg = FlowConfig.from_tag(tag)
    for nt in (2, 4):
        b = flow.build(cfg, nt, arch, defines={"W12F_FULL": 1})
        r = b.resources()
        assert r["stack"] == 0 and r["spill_stores"] == 0, (tag, nt, r)
        loop = mma_loop(sass(b.cubin))
        count = lambda op: sum(1 for t in loop if re.search(rf"\b{op}\b", t))  # noqa: E731
        share = -(-64 * nt // (32 * cfg.warps // cfg.kw))
        assert count("HMMA.16816.F32.BF16") == 4 * nt * cfg.rb, (tag, nt, loop)
        assert not any(re.search(r"\bLDG\.E", t) for t in loop), (tag, nt, loop)
        assert count("LDS.128") == 2 * cfg.rb + 2 * nt, (tag, nt, loop)
        assert count("LDGSTS.E.BYPASS.128") == 3 * cfg.rb, (tag, nt, loop)
        assert count("LDGSTS.E.128") == share, (tag, nt, loop)  # x through L1: an SM's CTAs read the same x
        assert sum(1 for t in loop if "BAR.SYNC" in t) == 1, (tag, nt, loop)


@pytest.mark.slow
@pytest.mark.parametrize("tag,nt,defines", [("w4-k1-s3-c5-q4-xs", 4, {}), ("w4-k1-s2-c4-q4-xs", 4, {}),
                                            ("w4-k1-s3-c4-r2-q4-xs", 1, {}), ("w8-k2-s4-c2-xs", 3, {}),
                                            ("w4-k2-s3-c4-q3-x1", 4, {"W12F_FULL": 1}), ("w8-k2-s4-c2-q2-e", 4, {}),
                                            ("w4-k1-s6-c4-q2-g", 8, {"W12F_FULL": 1}), ("w8-k2-s3-c2-p3-g", 4, {}),
                                            ("w8-k2-s4-c2", 4, {"W12F_ESCX": 1})])
def test_shared_memory_layout_is_checked_by_the_build(tag, nt, defines, jit_cache, monkeypatch):
    """The kernel asserts at compile time that its shared-memory layout ends at the bytes w12.flow.smem_bytes gives
    the launch (W12F_SMEM, from the same defines): builds with each region (x rings, the cluster's sums in the rings
    or in their own place, the KW shares, the escape stash, the warpgroup's x rings, x at the first escapes) build,
    and the same build told 16 bytes more or less fails."""
    cfg = FlowConfig.from_tag(tag)
    want = flow.smem_bytes(cfg, nt, defines=defines)
    assert int(dict(flow.spec(cfg, nt, (9, 0), defines=defines).defines)["W12F_SMEM"]) == want
    flow.build(cfg, nt, (9, 0), defines=defines)
    smem = flow._smem
    for off in (16, -16):
        monkeypatch.setattr(flow, "_smem", lambda d, off=off: smem(d) + off)
        with pytest.raises(autotune.BuildError, match="disagree"):
            flow.build(cfg, nt, (9, 0), defines=defines)


@pytest.mark.slow
def test_k_split_through_memory_builds_everywhere(jit_cache):
    """FlowConfig.kg (the K split's CTAs meeting in a global workspace): no cluster, so sm_80 builds it too; its tag
    is -p<kc> and round-trips; kc 2 to 8 (a cluster takes at most 4); no shared memory for other CTAs' sums; the
    counter's atomic add and the fences in the PTX, and no launch of the next grid before the CTAs exit."""
    cfg = FlowConfig(warps=4, kw=4, stages=3, cps=4, kc=6, kg=True, xd=1)
    assert cfg.tag() == "flow-w4-k4-s3-c4-p6-x1" and FlowConfig.from_tag(cfg.tag()) == cfg
    assert FlowConfig.from_tag("w8-k2-s4-c2-p3-g") == FlowConfig(warps=8, kw=2, stages=4, cps=2, kc=3, kg=True, wg=True)
    for bad in (dict(kc=1, kg=True), dict(kc=5), dict(kc=9, kg=True)):
        with pytest.raises(ValueError, match="kc"):
            FlowConfig(**bad)
    for arch in ((8, 0), (9, 0)):
        b = flow.build(cfg, 2, arch)
        ptx = b.ptx.read_text()
        assert b.resources()["spill_stores"] == 0 and b.resources()["stack"] == 0
        assert "atom.global.add" in ptx and "membar.gl" in ptx and "cluster" not in ptx
        assert "griddepcontrol.launch_dependents" not in ptx
    assert flow.smem_bytes(cfg, 2) == flow.smem_bytes(FlowConfig(warps=4, kw=4, stages=3, cps=4), 2)
    assert flow.grid(cfg, 5120) == 320 * 6 // 1
    wg = flow.build(FlowConfig(warps=8, kw=2, cps=2, kc=3, kg=True, wg=True), 4, (9, 0))
    assert wg.resources()["spill_stores"] == 0 and "serialized" not in wg.log.read_text()


def _copy_sizes(ptx: str) -> list[str]:
    """The src-size operands of the PTX's cp.async copies, in order."""
    return re.findall(r"cp\.async\.cg\.shared\.global[^;]*\], 16, (%r\d+)", ptx)


def test_full_row_blocks_build_copies_at_fixed_offsets(jit_cache):
    """W12F_FULL (N % 16 == 0): a lane's pieces of a tile (three, two for the 8-bit view) all copy 16 bytes where the
    block exists, one size for all of them (the offsets from one pointer fixed), for the mma.sync, memory-split,
    two-row-block, 8-bit view and warpgroup builds (sm_80 and sm_90a), no spills; the general build gives each piece
    its own size (rows past a partial block)."""
    cases = [(FlowConfig(), 1, (8, 0), False), (FlowConfig(warps=4, kw=4, cps=4, kc=2, kg=True, xd=1), 2, (8, 0), False),
             (FlowConfig(warps=4, kw=4, rb=2), 4, (9, 0), False), (FlowConfig(warps=4, kw=4, cps=4), 1, (9, 0), True),
             (FlowConfig(warps=8, kw=2, cps=2, kc=3, kg=True, wg=True), 4, (9, 0), False)]
    for cfg, nt, arch, q8 in cases:
        b = flow.build(cfg, nt, arch, q8=q8, defines={"W12F_FULL": 1})
        assert b.resources()["spill_stores"] == 0 and b.resources()["stack"] == 0
        sizes, per = _copy_sizes(b.ptx.read_text()), 2 if q8 else 3
        assert sizes and len(sizes) % per == 0, cfg.tag()
        assert all(len(set(sizes[i:i + per])) == 1 for i in range(0, len(sizes), per)), cfg.tag()
    general = _copy_sizes(flow.build(FlowConfig(), 1, (8, 0)).ptx.read_text())
    assert len(set(general[:3])) == 3


def test_full_row_blocks_build_is_refused_where_a_block_is_partial():
    """launch_tiled takes W12F_FULL where N % 16 == 0 (M > 8) and refuses it forced where N % 16 != 0 (a partial last block would
    read past its rows)."""
    t = layout.tile(w12.pack(hostile_weight(75, 200, seed=1), layout="planes"))
    x = _x(3, 200, 2)
    with pytest.raises(ValueError, match="W12F_FULL needs N % 16 == 0"):
        flow.launch_tiled(FlowConfig(), x, t, None, torch.empty(3, 75, dtype=torch.bfloat16),
                          defines={"W12F_FULL": 1})
    # the rule itself (w12.flow.full_rows): whole row blocks and 2-4 token tiles
    assert flow.full_rows(5120, 2) and flow.full_rows(5120, 4)
    assert not flow.full_rows(5120, 1) and not flow.full_rows(75, 4)


@pytest.mark.slow
def test_trace_build_stamps_only_when_asked(jit_cache):
    """W12F_TRACE (perf/w12_ladder.py --trace): the diagnostic build reads %globaltimer and %smid and stamps with
    atomicMax; the shipped build has none of it, and both build without spills (the cluster split, whose ranks
    other than 0 leave early, included)."""
    arch = (9, 0)
    for cfg in (FlowConfig(warps=4, kw=2, stages=3, cps=4), FlowConfig(warps=4, kw=4, stages=3, cps=4, kc=2)):
        plain = _check_build(flow.build(cfg, 1, arch), "e", arch, cfg)
        traced = _check_build(flow.build(cfg, 1, arch, defines={"W12F_TRACE": 1}), "e", arch, cfg)
        assert "globaltimer" not in plain and "atom.global.max.u64" not in plain
        assert "%globaltimer" in traced and "%smid" in traced and "atom.global.max.u64" in traced


def test_config_and_launch_geometry():
    with pytest.raises(ValueError, match="kw in"):
        FlowConfig(warps=4, kw=8)
    with pytest.raises(ValueError, match="warps \\* cps <= 32"):
        FlowConfig(warps=16, cps=3)
    cfg = FlowConfig(warps=8, kw=2, stages=4)
    assert cfg.row_blocks == 4 and cfg.rows == 64 and cfg.tag() == "flow-w8-k2-s4-c2"
    assert FlowConfig(fixed=True, evict=False).tag() == "flow-w8-k2-s4-c2-fixed-keep" and not cfg.fixed
    with pytest.raises(ValueError, match="rb .row blocks per warp. 1 or 2"):
        FlowConfig(rb=2, fixed=True)
    with pytest.raises(ValueError, match="rb .row blocks per warp. 1 or 2"):
        FlowConfig(rb=3)
    with pytest.raises(ValueError, match="kc .CTAs splitting K. 1 to 4 in a cluster"):
        FlowConfig(kc=2, fixed=True)
    with pytest.raises(ValueError, match="kc .CTAs splitting K. 1 to 4 in a cluster"):
        FlowConfig(kc=5)
    q2 = FlowConfig(warps=4, kw=4, cps=4, kc=2)
    assert q2.tag() == "flow-w4-k4-s4-c4-q2" and flow.grid(q2, 5120) == 640 and flow.grid(q2, 17) == 4
    assert flow.smem_bytes(q2, 4) == 4 * 4 * 1536 + 4 * 4 * 512 + 1 * 4 * 512 + 1024
    assert flow.smem_bytes(FlowConfig(warps=8, kw=2, kc=4), 1) == 8 * 4 * 1536 + 8 * 512 + 3 * 4 * 512
    assert dict(flow.spec(q2, 1, (9, 0)).defines)["W12F_KC"] == "2"
    r2 = FlowConfig(warps=8, kw=2, cps=1, rb=2)
    assert r2.row_blocks == 8 and r2.rows == 128 and r2.tag() == "flow-w8-k2-s4-c1-r2"
    assert flow.grid(r2, 16480) == 129 and flow.grid(r2, 17) == 1  # 1030 row blocks, 8 per CTA
    assert flow.smem_bytes(r2, 4) == 8 * 4 * 3072 + 8 * 2 * 4 * 512 + 8 * 1024
    assert dict(flow.spec(r2, 4, (9, 0)).defines)["W12F_RB"] == "2"
    assert flow.smem_bytes(cfg, 1) == 8 * 4 * 1536 + 8 * 512 and flow.smem_bytes(cfg, 4, "d") == 8 * 4 * 1536 + 4 * 1024
    assert flow.smem_bytes(FlowConfig(kw=1), 4) == 8 * 4 * 1536 + 8 * 1024  # the escape metadata stash (4 n-tiles)
    assert flow.smem_bytes(FlowConfig(kw=1), 4, "c") == flow.smem_bytes(FlowConfig(kw=1), 2) == 8 * 4 * 1536
    # x at each row's first escape column (W12F_ESCX): 512 bytes per row block and token tile, with the escapes only
    assert flow.smem_bytes(FlowConfig(kw=1), 4, defines={"W12F_ESCX": 1}) == 8 * 4 * 1536 + 8 * 1024 + 8 * 4 * 512
    assert flow.smem_bytes(FlowConfig(kw=1), 2, "c", {"W12F_ESCX": 1}) == 8 * 4 * 1536
    assert flow.grid(cfg, 16480) == 258 and flow.grid(cfg, 17) == 1 and flow.grid(FlowConfig(kw=8), 34816) == 2176
    h = FlowConfig(warps=4, kw=2, stages=3, cps=5, kc=3, xh=True)
    assert h.tag() == "flow-w4-k2-s3-c5-q3-h" and FlowConfig.from_tag(h.tag()) == h
    assert dict(flow.spec(h, 4, (9, 0)).defines)["W12F_XH"] == "1"
    assert dict(flow.spec(FlowConfig(), 4, (9, 0)).defines)["W12F_XH"] == "0"
    with pytest.raises(ValueError, match="xh=True"):
        FlowConfig(xd=1, xh=True)
    with pytest.raises(ValueError, match="xh=True"):
        FlowConfig(warps=4, kw=1, wg=True, xh=True)
    assert [flow.n_tiles(m) for m in (1, 8, 9, 17, 32)] == [1, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        flow.n_tiles(33)
    s = flow.spec(cfg, 2, (9, 0), step="c")
    d = dict(s.defines)
    assert (d["W12F_KW"], d["W12F_NT"], d["W12F_EPI"], d["W12F_ESC"], d["W12F_RED"]) == ("2", "2", "1", "0", "0")
    assert s.arch == "sm_90" and s != flow.spec(cfg, 2, (9, 0))
    with pytest.raises(ValueError, match="step must be one of"):
        flow.spec(cfg, 1, (9, 0), step="f")


def test_heuristic_fills_the_machine(monkeypatch):
    import w12.configs as c

    monkeypatch.setattr(c, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    got = {name: flow_heuristic(1, n, k, cpu).kw for name, (n, k) in
           {"in_proj": (16480, 5120), "gate_up": (34816, 5120), "o_proj": (5120, 6144), "down": (5120, 17408)}.items()}
    assert got == {"in_proj": 2, "gate_up": 1, "o_proj": 4, "down": 4}
    assert {(c.warps, c.cps) for c in (flow_heuristic(m, 5120, 6144, cpu) for m in (1, 8))} == {(4, 4)}
    # gate_up: 2176 row blocks, one per warp over the whole K, are 544 4-warp CTAs: one wave at 5 CTAs per SM
    # (4.1 a SM), where the wave model alone takes 2176 one-row-block CTAs of 8 warps in 9 waves (9 x 11 units)
    assert flow_heuristic(8, 34816, 5120, cpu) == FlowConfig(warps=4, kw=1, stages=3, cps=4)
    # at 9..16 tokens, from 12 row blocks per SM (gate_up: 16.5, the LM head: 117.6): 4-warp CTAs of 4 row blocks,
    # each warp one row block over the whole K, 3 ring slots, x one unit at a time, where the wave model takes
    # 8-warp CTAs of 8 or 2 pieces; the 8-bit view and other layers keep its pick
    assert flow_heuristic(16, 34816, 5120, cpu) == FlowConfig(warps=4, kw=1, stages=3, cps=4)
    assert flow_heuristic(16, 34816, 5120, cpu, q8=True) == FlowConfig(warps=8, kw=8, cps=2, xd=1)
    assert flow_heuristic(9, 25344, 5120, cpu).kw == 1 and flow_heuristic(9, 25328, 5120, cpu).warps == 8  # 12.0 a SM
    assert flow_heuristic(16, 248320, 5120, cpu) == FlowConfig(warps=4, kw=1, stages=3, cps=4)
    assert flow_heuristic(16, 16480, 5120, cpu) == FlowConfig(warps=8, kw=2, cps=2, xd=1)  # in_proj: 7.8 a SM
    assert flow_heuristic(16, 34816, 5120, cpu, stages=4).stages == 4
    assert flow_heuristic(1, 34816, 5120, cpu, q8=True).kw == 4  # the full format only
    assert flow_heuristic(1, 34816, 5120, cpu, warps=4) == FlowConfig(warps=4, kw=4, stages=3, cps=4)  # a fixed shape
    # x loaded ahead: two units at M <= 8 on the layers of 4-12 row blocks per SM (and below 4 for the 8-bit view),
    # one at 9..16 tokens (but the full format of gate_up and the LM head there), none on gate_up and the LM head at
    # M <= 8 or above 16 tokens
    xds = {(name, m, q8): flow_heuristic(m, n, k, cpu, q8=q8).xd for m in (1, 8, 16, 32) for q8 in (False, True)
           for name, (n, k) in {"in_proj": (16480, 5120), "qkv": (14336, 5120), "gate_up": (34816, 5120),
                                "o_proj": (5120, 6144), "head": (248320, 5120)}.items()}
    assert {key for key, v in xds.items() if v == 2} == {(n, m, q8) for n in ("in_proj", "qkv") for m in (1, 8)
                                                         for q8 in (False, True)} | {("o_proj", 1, True),
                                                                                    ("o_proj", 8, True)}
    assert {key for key, v in xds.items() if v == 1} == {(n, 16, q8) for n in ("in_proj", "qkv", "gate_up", "o_proj",
                                                                              "head") for q8 in (False, True)} - \
        {("gate_up", 16, False), ("head", 16, False)}
    # fewer than 4 such CTAs a SM (in_proj: 258) or more than one wave (the LM head: 3880) keep the wave model's pick
    assert flow_heuristic(1, 16480, 5120, cpu).kw == 2 and flow_heuristic(1, 248320, 5120, cpu).kw == 2
    assert flow_heuristic(1, 42240, 5120, cpu).kw == 1 and flow_heuristic(1, 42256, 5120, cpu).kw != 1  # 660 / 661
    # ring depth: 3 in the 4-warp CTAs at M <= 8, 4 elsewhere, or as given
    assert flow_heuristic(1, 16480, 5120, cpu).stages == 3 and flow_heuristic(16, 16480, 5120, cpu).stages == 4
    assert flow_heuristic(1, 16480, 5120, cpu, stages=6).stages == 6
    # the 8-bit view: 4-warp CTAs at M <= 8, the mma.sync build above (no wgmma even where it exists)
    assert flow_heuristic(8, 34816, 5120, cpu, q8=True) == FlowConfig(warps=4, kw=4, stages=3, cps=4)
    # ... except from 4 to 12 row blocks per SM (in_proj 7.8, qkv_proj 6.8): 8-warp CTAs at 2 per SM, 4 ring slots
    assert {flow_heuristic(m, n, 5120, cpu, q8=True) for m in (1, 8) for n in (16480, 14336)} == {FlowConfig(xd=2)}
    assert flow_heuristic(8, 16480, 5120, cpu) == FlowConfig(warps=4, kw=2, stages=3, cps=4, xd=2)  # the full format
    assert not flow_heuristic(32, 34816, 5120, cpu, wgmma=True, q8=True).wg
    big = {name: flow_heuristic(32, n, k, cpu) for name, (n, k) in {"in_proj": (16480, 5120), "gate_up": (34816, 5120),
                                                                    "o_proj": (5120, 6144)}.items()}
    assert {n: (c.warps, c.cps, c.kw) for n, c in big.items()} == {"in_proj": (8, 2, 2), "gate_up": (8, 2, 8),
                                                                  "o_proj": (8, 2, 4)}
    assert all(flow_heuristic(m, n, k, cpu).kc == 1 for m in (1, 32) for n, k in ((5120, 6144), (64, 64)))  # no clusters
    # with clusters (sm_90): the layers with fewer than 3 CTAs per SM split K across 2 CTAs, the others do not
    sm90 = {(name, m): flow_heuristic(m, n, k, cpu, clusters=True) for m in (1, 8, 16, 32) for name, (n, k) in
            {"in_proj": (16480, 5120), "gate_up": (34816, 5120), "o_proj": (5120, 6144), "down": (5120, 17408),
             "qkv": (14336, 5120), "tiny": (40, 64)}.items()}
    assert {key for key, c in sm90.items() if c.kc == 2} == {(n, m) for n in ("o_proj", "down") for m in (1, 8, 32)}
    # 9..16 tokens: 3 CTAs, each of two row blocks and 3 ring slots (the full format)
    assert sm90["o_proj", 16] == sm90["down", 16] == FlowConfig(warps=4, kw=2, stages=3, cps=4, kc=3, xd=1, late=True)
    assert FlowConfig.from_tag("w4-k2-s3-c4-q3-x1-l") == sm90["o_proj", 16] and not sm90["o_proj", 32].late
    assert flow_heuristic(16, 5120, 6144, cpu, clusters=True, stages=4).stages == 4
    # the view's split stays at 2, in CTAs of one row block and 4 slots
    assert flow_heuristic(16, 5120, 6144, cpu, clusters=True, q8=True) == FlowConfig(warps=2, kw=2, cps=4, kc=2, xd=1,
                                                                                     late=True)
    assert flow_heuristic(16, 5120, 320, cpu, clusters=True).kc == 2  # 5 units of K: too few for 3 CTAs
    assert sm90["o_proj", 1] == FlowConfig(warps=4, kw=4, stages=3, cps=4, kc=2, escx=True)
    assert FlowConfig.from_tag("w4-k4-s3-c4-q2-e") == sm90["o_proj", 1] and not sm90["o_proj", 16].escx
    assert not flow_heuristic(1, 5120, 6144, cpu, clusters=True, q8=True).escx  # the 8-bit view: unmeasured
    assert sm90["down", 32] == FlowConfig(warps=2, kw=2, cps=4, kc=2)
    assert sm90["tiny", 1].kc == 1  # one unit of K: nothing to split
    assert flow_heuristic(1, 5120, 6144, cpu, warps=4, clusters=True).kc == 1  # a fixed shape stays as asked
    # with wgmma (sm_90): the warpgroup build above 16 tokens only
    wg = {(name, m): flow_heuristic(m, n, k, cpu, clusters=True, wgmma=True) for m in (1, 8, 9, 16, 17, 32)
          for name, (n, k) in {"in_proj": (16480, 5120), "gate_up": (34816, 5120), "o_proj": (5120, 6144),
                               "down": (5120, 17408), "tiny": (40, 64)}.items()}
    # ... but on the 5120-row layers of at most 128 units of K (o_proj: 96), the mma.sync build's 3-CTA clusters
    assert {key for key, c in wg.items() if c.wg} == {(n, m) for n in ("in_proj", "gate_up", "down") for m in (17, 32)}
    assert wg["o_proj", 32] == wg["o_proj", 17] == FlowConfig(warps=4, kw=2, stages=3, cps=4, kc=3, xd=1)
    assert flow_heuristic(32, 5120, 8256, cpu, clusters=True, wgmma=True).wg  # 129 units
    assert wg["gate_up", 16] == sm90["gate_up", 16] == FlowConfig(warps=4, kw=1, stages=3, cps=4)
    # 6 ring slots in the 4-warp clusters below 8 row groups per SM (gate_up: 4.1), 4 above (the LM head: 29.4)
    assert wg["gate_up", 32] == FlowConfig(warps=4, kw=1, stages=6, cps=4, kc=2, wg=True)
    assert flow_heuristic(32, 248320, 5120, cpu, clusters=True, wgmma=True) == FlowConfig(warps=4, kw=1, cps=4, kc=2,
                                                                                           wg=True)
    assert flow_heuristic(32, 34816, 5120, cpu, clusters=True, wgmma=True, stages=4).stages == 4
    # 3 ring slots below 3 row groups per SM
    assert wg["in_proj", 32] == FlowConfig(warps=16, kw=2, stages=3, cps=1, wg=True)
    assert wg["down", 32] == wg["down", 17] == FlowConfig(warps=8, kw=2, stages=3, cps=2, kc=3, kg=True, wg=True)
    assert flow_heuristic(32, 5120, 17408, cpu, clusters=True, wgmma=True, stages=4).stages == 4
    assert flow_heuristic(32, 5120, 6144, cpu, clusters=True, wgmma=True, stages=4).stages == 4
    assert wg["in_proj", 16] == sm90["in_proj", 16] and wg["o_proj", 8] == sm90["o_proj", 8]
    assert not flow_heuristic(32, 16480, 5120, cpu, warps=8, wgmma=True).wg  # a fixed shape stays as asked
    # the 8-bit view keeps the mma.sync build (its warpgroup build measured slower)
    # and the full format's tuned entries (one op name for both)
    looked_up = []
    monkeypatch.setattr(autotune, "get_config",
                        lambda op, variant, cls, make, **kw: looked_up.append((op, variant)) or make())
    with monkeypatch.context() as m:
        m.setattr(c, "flow_heuristic", lambda *a, **kw: kw.get("q8"))
        assert c.flow_config(32, 16480, 5120, cpu, q8=True) is True and c.flow_config(32, 16480, 5120, cpu) is False
    assert looked_up == [("w12.matmul", "flow")] * 2


def test_layout_cache_follows_the_planes():
    p = w12.pack(hostile_weight(20, 70, seed=4), layout="planes")
    planes = (p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val)
    a = flow.tiled(*planes, 70)
    assert flow.tiled(*planes, 70).tiles is a.tiles
    assert torch.equal(layout.untile(a).hi, p.hi)
    p.hi[0, 0] ^= 1  # changed in place: rebuilt
    b = flow.tiled(*planes, 70)
    assert b.tiles is not a.tiles and not torch.equal(b.tiles, a.tiles)
    hi2 = p.hi.clone()
    assert flow.tiled(hi2, *planes[1:], 70).tiles is not b.tiles
    n = len(flow._LAYOUTS)
    del hi2
    assert len(flow._LAYOUTS) == n - 1  # dropped with its planes


def test_forced_flow_config_reaches_the_cuda_path():
    """w12.matmul under autotune.force(config=FlowConfig()) plans the CUDA kernel: on CPU tensors it says why it
    cannot run; the 8-bit view on the fixed base is refused by name (before any launch)."""
    p = w12.pack(hostile_weight(20, 70, seed=4), layout="planes")
    x = _x(2, 70, seed=1)
    with autotune.force("w12.matmul", config=FlowConfig()):
        with pytest.raises((ValueError, RuntimeError), match="FlowConfig"):
            w12.matmul(x, p)
    with pytest.raises(ValueError, match="exact base only"):
        flow.launch(FlowConfig(fixed=True), x, *(p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val), None,
                    torch.empty(2, 20, dtype=torch.bfloat16), q8=True)
    with pytest.raises(ValueError, match="exact base only"):
        flow.spec(FlowConfig(fixed=True), 1, (9, 0), q8=True)


# M, N, K, warps, kw, kc, rb: partial and inactive row blocks, masked tails, a K split in one CTA and across two,
# two row blocks per warp, 1 and 4 token tiles
Q8_CASES = [(1, 75, 200, 4, 2, 1, 1), (13, 17, 64, 2, 1, 1, 1), (32, 33, 100, 8, 8, 1, 1), (9, 130, 256, 4, 4, 2, 1),
            (20, 40, 130, 8, 4, 1, 2)]


@pytest.mark.parametrize("M,N,K,warps,kw,kc,rb", Q8_CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-w{c[3]}-k{c[4]}-q{c[5]}-r{c[6]}" for c in Q8_CASES])
def test_q8_build_matches_the_8_bit_view_bitwise(M, N, K, warps, kw, kc, rb):
    """W12F_Q8 (hi bytes only, dec_pair_q8, escapes added as x * escape): `w12.matmul_q8_reference`'s BF16 bits on
    hostile rows (zeros, subnormal rows, huge and tiny rows, salted escapes), with a bias."""
    w = hostile_weight(N, K, seed=7 * N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=3 * K + M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    got, _ = emulate(x, t, warps=warps, kw=kw, bias=b, fixed=False, rb=rb, kc=kc, q8=True)
    _assert_bf16_equal(got, w12.matmul_q8_reference(x, p, b))


def test_q8_build_reads_the_hi_pieces_only():
    """The 8-bit view's build never looks at the lo nibbles: tiles whose lo bytes are scrambled give the same bits,
    and the exact build on the same scrambled tiles does not (so the lo bytes were really changed)."""
    N, K, M = 40, 200, 5
    p = w12.pack(hostile_weight(N, K, seed=11), layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=12)
    buf = t.tiles.clone()
    geo = layout.Geometry(N, K)
    for rb in range(geo.row_blocks):  # the lo half of every full tile: bytes 1024..1535 of each 1536
        R = 16 if rb < geo.NF else geo.nr
        for c in range(geo.KF):
            base = rb * geo.SB + 96 * R * c + 64 * R
            buf[base:base + 32 * R] ^= 0x5A
    scrambled = layout.TiledW12(buf, t.e0, t.esc_rowptr, t.esc_col, t.esc_val, t.N, t.K)
    a, _ = emulate(x, t, warps=4, kw=2, fixed=False, q8=True)
    b, _ = emulate(x, scrambled, warps=4, kw=2, fixed=False, q8=True)
    assert np.array_equal(a, b, equal_nan=True)
    e, _ = emulate(x, t, warps=4, kw=2, fixed=False)
    f, _ = emulate(x, scrambled, warps=4, kw=2, fixed=False)
    assert not np.array_equal(e, f, equal_nan=True)


@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_q8_build_compiles_without_lo_reads(arch, jit_cache):
    for cfg, nt in ((FlowConfig(warps=4, kw=4, cps=4), 1), (FlowConfig(warps=8, kw=8), 4)):
        b = flow.build(cfg, nt, arch, q8=True)
        exact = flow.build(cfg, nt, arch).ptx.read_text()
        ptx = b.ptx.read_text()
        r = b.resources()
        assert r["spill_stores"] == 0 and r["stack"] == 0
        # two cp.async pieces per tile instead of three, and no 8-byte shared loads of the lo nibbles
        assert ptx.count("cp.async.cg.shared.global") < exact.count("cp.async.cg.shared.global")
        assert "ld.shared.v2.u32" not in ptx.split(".entry")[1] and "ld.shared.v2.u32" in exact


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M", [1, 33])
def test_matmul_tiled_on_the_cpu_is_the_planes_torch_path(M, q8):
    """w12.matmul_tiled on CPU tensors (no flow kernel there): w12.matmul / matmul_q8 on the planes bit for bit,
    bias, out and a leading batch dim included; NaN where they give NaN (hostile rows hold NaN weights, and the CPU
    linear's NaN payload follows its memory alignment)."""
    N, K = 37, 150
    p = w12.pack(hostile_weight(N, K, seed=13), layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=14)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    def op(x, p, b=None):  # the planes' torch path (under the interpreter w12.matmul would run a Triton kernel)
        return (w12.matmul_q8 if q8 else w12.matmul)(x, p, b, variant="torch")

    def same(a, e):
        nan = torch.isnan(e.float())
        assert torch.equal(torch.isnan(a.float()), nan) and nan.any()
        assert torch.equal(a.view(torch.int16)[~nan], e.view(torch.int16)[~nan])

    want = op(x, p, b)
    same(w12.matmul_tiled(x, t, b, q8=q8), want)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert w12.matmul_tiled(x, t, b, q8=q8, out=out) is out
    same(out, want)
    same(w12.matmul_tiled(x.reshape(1, M, K), t, q8=q8)[0], op(x, p))


def test_matmul_tiled_rejects_at_the_call():
    p = w12.pack(hostile_weight(20, 70, seed=4), layout="planes")
    t = layout.tile(p)
    x = _x(2, 70, seed=1)
    with pytest.raises(TypeError, match=r"w12\.matmul_tiled \(matmul\): tiled must be a TiledW12.*call w12\.matmul"):
        w12.matmul_tiled(x, p)
    with pytest.raises(ValueError, match=r"w12\.matmul: variant='gemv' does not apply to a TiledW12"):
        w12.matmul(x, t, variant="gemv")  # w12.matmul takes a TiledW12 (matmul_tiled's paths), without a variant
    with pytest.raises(ValueError, match=r"the last dim of x must be K=70"):
        w12.matmul_tiled(_x(2, 71, seed=1), t)
    with pytest.raises(TypeError, match=r"x must be bfloat16 or float16"):
        w12.matmul_tiled(x.float(), t)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(20,\)"):
        w12.matmul_tiled(x, t, torch.zeros(3))


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("N,K", [(16, 64), (37, 150), (5, 63), (70, 300), (33, 1), (20, 581)])
def test_decode_tiled_is_unpack_bitwise(N, K, groups, monkeypatch):
    """w12.ops.decode_tiled (one Triton program per row block and `groups` column groups, under the interpreter here;
    at K = 581 nine full groups: with 4, chunks of 4, 4 and 1, then the masked tail): the BF16 bits of
    w12.unpack and of w12.decode_q8 on hostile rows (zeros, subnormals, huge and tiny rows, salted +-0, +-Inf, NaN,
    out-of-window values), with partial row blocks and masked tails."""
    from w12 import ops
    from w12.ops import decode_tiled

    monkeypatch.setattr(ops, "UNTILE_GROUPS", groups)
    p = w12.pack(hostile_weight(N, K, seed=N * K), layout="planes")
    t = layout.tile(p)
    assert autotune.is_interpreter()  # the kernel, not the planes' torch path
    assert torch.equal(decode_tiled(t).view(torch.int16), w12.unpack(p).view(torch.int16))
    assert torch.equal(decode_tiled(t, q8=True).view(torch.int16), w12.decode_q8(p).view(torch.int16))


def test_programmatic_dependent_launch_waits_for_a_fresh_or_rewritten_layout(monkeypatch):
    """launch_tiled's default `pdl`: off at a layout's first launch and at the first after an in-place write to any
    of its tensors (the previous kernel may be the one that wrote it, and the kernel reads its tiles before
    griddepcontrol.wait) and above PDL_MAX_M tokens, on otherwise where pdl_enabled allows it; an explicit `pdl` wins; `flow.launch` on the
    version-1 planes never asks for it in the call that builds their layout. The kernel is stood in by a recorder."""
    import w12.cuda as wcuda

    seen = []

    class Recorder:
        def launch(self, grid, block, smem, stream, values, types, pdl=False):
            seen.append(pdl)

    monkeypatch.setattr(flow, "_kernel", lambda *a, **k: (Recorder(), 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wcuda, "pdl_enabled", lambda device, default=False: default)
    p = w12.pack(torch.randn(40, 130).to(torch.bfloat16), layout="planes")
    t = layout.tile(p)
    x = torch.randn(2, 130).to(torch.bfloat16)
    out = torch.empty(2, 40, dtype=torch.bfloat16)
    cfg = FlowConfig()
    for _ in range(3):
        flow.launch_tiled(cfg, x, t, None, out)
    t.tiles[5] += 1  # an in-place write to the tiles
    flow.launch_tiled(cfg, x, t, None, out)
    t.esc_col.add_(0)  # and to the escape list
    flow.launch_tiled(cfg, x, t, None, out)
    flow.launch_tiled(cfg, x, t, None, out)
    flow.launch_tiled(cfg, x, t, None, out, pdl=False)
    assert seen == [False, True, True, False, False, True, False]
    seen.clear()
    p2 = w12.pack(torch.randn(24, 64).to(torch.bfloat16), layout="planes")
    x2 = torch.randn(1, 64).to(torch.bfloat16)
    out2 = torch.empty(1, 24, dtype=torch.bfloat16)
    for _ in range(2):
        flow.launch(cfg, x2, p2.hi, p2.lo, p2.e0, p2.esc_rowptr, p2.esc_col, p2.esc_val, None, out2)
    p2.lo.add_(0)  # the planes change: the layout is built again
    flow.launch(cfg, x2, p2.hi, p2.lo, p2.e0, p2.esc_rowptr, p2.esc_col, p2.esc_val, None, out2)
    assert seen == [False, True, False]
    # above PDL_MAX_M tokens the default is off (it cost the 5120-row layers 12% at M = 16); explicit still wins
    x9 = torch.randn(flow.PDL_MAX_M + 1, 130).to(torch.bfloat16)
    out9 = torch.empty(flow.PDL_MAX_M + 1, 40, dtype=torch.bfloat16)
    flow.launch_tiled(cfg, x9, t, None, out9)
    flow.launch_tiled(cfg, x9, t, None, out9, pdl=True)
    flow.launch_tiled(cfg, x, t, None, out)
    assert seen[-3:] == [False, True, True]
    # pdl_rows (matmul_tiled(pdl=True)) moves the row limit and keeps the layout check
    flow.launch_tiled(cfg, x9, t, None, out9, pdl_rows=flow.MAX_M)
    t.tiles[5] -= 1
    flow.launch_tiled(cfg, x9, t, None, out9, pdl_rows=flow.MAX_M)
    assert seen[-2:] == [True, False]
    monkeypatch.setattr(wcuda, "pdl_enabled", lambda device, default=False: False)
    flow.launch_tiled(cfg, x, t, None, out)
    assert seen[-1] is False


@pytest.mark.parametrize("M,pieces", [(20, [20]), (72, [32, 32, 8]), (96, [32, 32, 32]), (97, [])])
def test_matmul_tiled_runs_the_flow_kernel_per_32_rows(M, pieces, monkeypatch):
    """`w12.ops.CHUNK_MAX_M` = 96: up to 96 rows, w12.matmul_tiled launches the flow kernel once per 32-row piece of
    x into the matching rows of out (here a recording stand-in that computes the piece's product in fp64); above
    it, the decoded weight's product (no launch)."""
    import w12.ops as ops

    N, K = 40, 130
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = _x(M, K, seed=M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    launched = []

    def launch(cfg, xs, tt, bias, out, *, q8=False, swiglu=False, **pdl):
        assert tt is t and bias is b and out.is_contiguous() and cfg == FlowConfig() and not swiglu
        launched.append((xs.shape[0], pdl))
        out.copy_(w12.matmul_reference(xs, p, bias).to(torch.bfloat16))

    monkeypatch.setattr(ops, "CHUNK_MAX_M", 96)
    monkeypatch.setattr(ops, "_flow_config", lambda xs, tt, op: FlowConfig() if 0 < xs.shape[0] <= 32 else None)
    monkeypatch.setattr(flow, "launch_tiled", launch)
    got = w12.matmul_tiled(x, t, b)
    assert launched == [(m, {}) for m in pieces]
    # pdl=True moves the launcher's row limit to every piece; pdl=False turns it off
    for pdl, kw in ((True, {"pdl_rows": flow.MAX_M}), (False, {"pdl": False})):
        launched.clear()
        w12.matmul_tiled(x, t, b, pdl=pdl)
        assert launched == [(m, kw) for m in pieces]
    want = w12.matmul_reference(x, p, b).to(torch.bfloat16)
    if pieces:
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    else:
        assert_close(got, w12.matmul_reference(x, p, b), torch.nn.functional.linear(x, w, b))


def test_chunk_rows_from_the_environment(monkeypatch):
    import w12.ops as ops

    for env, want in (("", 96), ("96", 96), (" 64 ", 64), ("0", 0)):
        monkeypatch.setenv("SPECPILOT_W12_CHUNK_ROWS", env)
        assert ops._chunk_rows() == want
    monkeypatch.delenv("SPECPILOT_W12_CHUNK_ROWS")
    assert ops._chunk_rows() == 96
    for bad in ("x", "-1", "9.5"):
        monkeypatch.setenv("SPECPILOT_W12_CHUNK_ROWS", bad)
        with pytest.raises(ValueError, match="SPECPILOT_W12_CHUNK_ROWS"):
            ops._chunk_rows()


def test_env_defines_reach_every_flow_build(monkeypatch):
    """SPECPILOT_W12F_DEFINES adds W12F_* defines to every flow build (an A/B inside a whole program); a call's own
    defines win; anything but W12F_NAME=integer items is refused with the expected form."""
    monkeypatch.setenv("SPECPILOT_W12F_DEFINES", " W12F_STAGES=5, W12F_WG_STM=1 ")
    d = dict(flow.spec(FlowConfig(), 1, (9, 0)).defines)
    assert d["W12F_STAGES"] == "5" and d["W12F_WG_STM"] == "1"
    assert dict(flow.spec(FlowConfig(), 1, (9, 0), defines={"W12F_STAGES": 3}).defines)["W12F_STAGES"] == "3"
    for bad in ("STAGES=5", "W12F_STAGES", "W12F_STAGES=x"):
        monkeypatch.setenv("SPECPILOT_W12F_DEFINES", bad)
        with pytest.raises(ValueError, match="W12F_NAME=integer"):
            flow.spec(FlowConfig(), 1, (9, 0))
    monkeypatch.delenv("SPECPILOT_W12F_DEFINES")
    assert dict(flow.spec(FlowConfig(), 1, (9, 0)).defines)["W12F_STAGES"] == str(FlowConfig().stages)


def test_launch_above_32_rows_takes_the_warpgroup_build_only():
    """33..64 rows go to `w12.flow.launch_tiled` with a warpgroup config (5-8 token tiles in one launch); a mma.sync
    config is refused there, as is anything above 64 rows; `n_tiles` says the same."""
    t = w12.pack(hostile_weight(37, 150, seed=1))
    out = torch.empty(40, 37, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="33..64 rows: the warpgroup build only"):
        flow.launch_tiled(FlowConfig(warps=8, kw=2, cps=2), _x(40, 150, seed=2), t, None, out)
    with pytest.raises(ValueError, match="1..64"):
        flow.launch_tiled(FlowConfig(warps=8, kw=2, cps=2, wg=True), _x(65, 150, seed=2), t, None,
                          torch.empty(65, 37, dtype=torch.bfloat16))
    assert flow.n_tiles(40, wg=True) == 5 and flow.n_tiles(64, wg=True) == 8
    with pytest.raises(ValueError, match="mma.sync"):
        flow.n_tiles(40)
