"""CPU checks of the CUDA W12 kernels (w12/csrc/w12_mma.cu, w12/csrc/w12_tma.cu) without a GPU.

1. `emulate` replays the kernel's integer decode, its thread -> column mapping, the mma.sync
   m16n8k16 fragment layouts (PTX ISA) and its epilogue indexing, lane by lane, in numpy; the
   result must match the fp64 reference product. This pins down the bit tricks and the
   slot/column bookkeeping before any GPU time is spent; the GPU tests then check the real thing.
   `emulate_tma` does the same for the TMA kernel's stage images, shared-memory offsets and epilogue.
2. NVRTC (autotune.jit, no GPU needed) compiles every shipped shape of the kernels for sm_80 and sm_90
   (sm_90a for wgmma): the PTX has the instructions each path needs (mma.sync, TMA, mbarriers,
   griddepcontrol, wgmma) and no local memory (a register array indexed at run time).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import w12
from w12.configs import MmaConfig
from w12.reference import matmul_q8_reference, matmul_reference
from specpilot import testing

from flow_emu import dec_q8, q8_base, q8_dense
from stream_k import run_stream_k

# --------------------------------------------------------------------------------------
# integer helpers, as the CUDA intrinsics define them
# --------------------------------------------------------------------------------------

U32 = np.uint32


def byte_perm(x, y, s: int):
    """PTX `prmt.b32` (default mode: a selector nibble with bit 3 set replicates the sign of the
    byte) on uint32 arrays. CUDA's `__byte_perm` drops bit 3, so the kernel calls it only with
    selectors below 8 per nibble (test_byte_perm_selectors) and uses inline prmt otherwise."""
    src = [(x >> U32(8 * i)) & U32(0xFF) for i in range(4)] + [(y >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    out = np.zeros_like(x, dtype=U32)
    for i in range(4):
        sel = (s >> (4 * i)) & 0xF
        b = src[sel & 7]
        if sel & 8:
            b = np.where(b & U32(0x80), U32(0xFF), U32(0))
        out |= (b.astype(U32) << U32(8 * i))
    return out


def dec_pair(y, e0x):
    return ((y & U32(0x800F800F)) + ((y >> U32(4)) & U32(0x07F007F0)) + e0x).astype(U32)


def dec_pair_q8(t, e0x):
    """w12_common.cuh's decode_a for the 8-bit view: dec_pair_q8 (lanes `hi`, two multiply-adds) with the row
    constant q8_base(e0x)."""
    return dec_q8(np.asarray(t, dtype=U32), q8_base(e0x))


def words(b: np.ndarray) -> np.ndarray:
    """[..., 16] uint8 -> [..., 4] little-endian uint32 (what a uint4 load gives)."""
    return b.astype(U32).reshape(*b.shape[:-1], 4, 4) @ (U32(1) << (U32(8) * np.arange(4, dtype=U32)))


def bf16_pair(r):
    """bf16x2 register -> (low lane, high lane) as float64."""
    lo = ((r & U32(0xFFFF)) << U32(16)).view(np.float32).astype(np.float64)
    hi = (r & U32(0xFFFF0000)).view(np.float32).astype(np.float64)
    return lo, hi


# --------------------------------------------------------------------------------------
# the kernel, lane by lane
# --------------------------------------------------------------------------------------


def _decode_a(fh, fl, e0x, s, sh, q8):
    """k-step s of one m-tile as the kernels decode it: the A operand (16 rows x 16 k slots) that
    the lanes' registers form under the mma.m16n8k16 fragment layout."""
    (ha, la, ea), (hb, lb, eb) = [(fh[h][:, s], (fl[h][:, s] >> sh) & U32(0x0F0F0F0F), e0x[h]) for h in range(2)]
    if q8:
        z = np.zeros(32, dtype=U32)
        regs = (dec_pair_q8(byte_perm(ha, z, 0x4140), ea), dec_pair_q8(byte_perm(hb, z, 0x4140), eb),
                dec_pair_q8(byte_perm(ha, z, 0x4342), ea), dec_pair_q8(byte_perm(hb, z, 0x4342), eb))
    else:
        regs = (dec_pair(byte_perm(ha, la, 0x1504), ea), dec_pair(byte_perm(hb, lb, 0x1504), eb),
                dec_pair(byte_perm(ha, la, 0x3726), ea), dec_pair(byte_perm(hb, lb, 0x3726), eb))
    lane = np.arange(32)
    g, q = lane // 4, lane % 4
    A = np.zeros((16, 16))
    for reg, (dr, dk) in zip(regs, ((0, 0), (8, 0), (0, 8), (8, 8))):
        l0, l1 = bf16_pair(reg)
        A[g + dr, 2 * q + dk] = l0
        A[g + dr, 2 * q + dk + 1] = l1
    return A


def _accumulate(D, nt):
    """D [16, 8 nt] -> the lanes' accumulators [nt, 4, 32] (mma.m16n8 C layout per n-tile)."""
    lane = np.arange(32)
    g, q = lane // 4, lane % 4
    return np.stack([np.stack([D[g, 8 * j + 2 * q], D[g, 8 * j + 2 * q + 1], D[g + 8, 8 * j + 2 * q],
                               D[g + 8, 8 * j + 2 * q + 1]]) for j in range(nt)])


def _decode_mma(fh, fl, fx, e0x, s, sh, q8, nt):
    """One k-step of one m-tile with mma.sync: the decoded A times each n-tile's B registers
    (token g, k slots 2q, 2q + 1, 2q + 8, 2q + 9). Returns [nt, 4, 32]."""
    A = _decode_a(fh, fl, e0x, s, sh, q8)
    lane = np.arange(32)
    g, q = lane // 4, lane % 4
    out = np.zeros((nt, 4, 32))
    for j in range(nt):
        xv = fx[j][s >> 1]
        B = np.zeros((16, 8))
        for reg, dk in ((xv[:, 2 * (s & 1)], 0), (xv[:, 2 * (s & 1) + 1], 8)):
            l0, l1 = bf16_pair(reg)
            B[2 * q + dk, g] = l0
            B[2 * q + dk + 1, g] = l1
        out[j] = _accumulate(A @ B, 1)[0]
    return out


def _wg_b_operand(st_x: np.ndarray, toks: int) -> list[np.ndarray]:
    """The TMA kernel's wgmma path: its threads copy the stage's x (rows of 144 bytes) into the
    permuted buffer (piece at byte 16 pc = k-step ks, token, half ph; four 4-byte words from byte
    32 q' + 8 ks + 4 ph of the token's row), and wgmma reads that buffer through the no-swizzle
    K-major descriptor (core matrix of 8 tokens x 8 k at ks * toks * 32 + (n / 8) * 256 + (k / 8) * 128,
    LBO 128, SBO 256). Returns B [16 k slots, toks] per k-step, as the tensor core would see it."""
    buf = np.zeros(toks * 128, dtype=np.uint8)
    for pc in range(toks * 8):
        off = 16 * pc
        ks, rem = off // (toks * 32), off % (toks * 32)
        tok, ph = (rem // 256) * 8 + (rem % 128) // 16, (rem % 256) // 128
        src = 8 * ks + 4 * ph
        buf[off:off + 16] = np.concatenate([st_x[tok, src + 32 * w4:src + 32 * w4 + 4] for w4 in range(4)])
    vals = buf.view(np.uint16).astype(U32) << U32(16)
    bf = vals.view(np.float32).astype(np.float64)
    out = []
    for ks in range(4):
        B = np.zeros((16, toks))
        for n in range(toks):
            for k in range(16):
                B[k, n] = bf[(ks * toks * 32 + (n // 8) * 256 + (k // 8) * 128 + (n % 8) * 16 + (k % 8) * 2) // 2]
        out.append(B)
    return out


def _add_escapes(s_, p: w12.W12Weight, xb: torch.Tensor, row: int, tok: int, q8: bool) -> float:
    """The epilogue's escape correction for one output, in CSR order: + x * escape, minus x * 2^(e0 - 127)
    (what the dense decode gave there; the 8-bit view gave its value of hi byte 0: flow_emu.q8_dense)."""
    e0 = int(p.e0[row])
    v0 = q8_dense(e0) if q8 else float(np.array([e0 << 23], dtype=U32).view(np.float32)[0])
    ev = p.esc_val.numpy().view(np.uint16)
    for pp in range(int(p.esc_rowptr[row]), int(p.esc_rowptr[row + 1])):
        xv = float(xb[tok, int(p.esc_col[pp])].float())
        evf = float(np.array([U32(ev[pp]) << U32(16)], dtype=U32).view(np.float32)[0])
        s_ += xv * evf - xv * v0
    return s_


def emulate(x: torch.Tensor, p: w12.W12Weight, *, mt: int, wk: int, wr: int = 1, q8: bool = False) -> torch.Tensor:
    M = x.shape[0]
    N, Kp = p.hi.shape
    nt = 1 if M <= 8 else 2 if M <= 16 else 4
    hi = p.hi.numpy()
    lo = p.lo.numpy()
    e0 = p.e0.numpy().astype(U32)
    xb = torch.zeros((M, Kp), dtype=torch.bfloat16)
    xb[:, : x.shape[1]] = x
    xbytes = xb.view(torch.uint8).numpy()  # [M, 2 Kp]
    lane = np.arange(32)
    g, q = lane // 4, lane % 4
    sh = U32(4) * (q >> 1).astype(U32)
    nch = Kp // 64
    rows_cta = 16 * mt * wr
    out = np.full((M, N), np.nan)
    for r0 in range(0, N, rows_cta):
        red = np.zeros((wk, wr, mt, nt, 4, 32))
        for w, wr_i in [(a, b) for a in range(wk) for b in range(wr)]:
            acc = red[w, wr_i]
            for c in range(w, nch, wk):
                for t in range(mt):
                    regs = []  # per m-tile half h: (hi words [32, 4], lo words, e0x)
                    for h in range(2):
                        row = np.minimum(r0 + 16 * (mt * wr_i + t) + 8 * h + g, N - 1)
                        hw = words(np.stack([hi[row[i], 64 * c + 16 * q[i]: 64 * c + 16 * q[i] + 16] for i in lane]))
                        lw = words(np.stack([lo[row[i], 32 * c + 16 * (q[i] & 1): 32 * c + 16 * (q[i] & 1) + 16]
                                             for i in lane]))
                        e = e0[row]
                        regs.append((hw, lw, ((e << U32(7)) | (e << U32(23))).astype(U32)))
                    xw = []
                    for j in range(nt):
                        tok = 8 * j + g
                        xwj = np.zeros((32, 8), dtype=U32)
                        for i in lane:
                            if tok[i] < M:
                                seg = xbytes[tok[i], 2 * (64 * c + 16 * q[i]): 2 * (64 * c + 16 * q[i] + 16)]
                                xwj[i] = words(seg.reshape(2, 16)).reshape(8)
                        xw.append(xwj)
                    fx = [[xw[j][:, :4], xw[j][:, 4:]] for j in range(nt)]
                    for s in range(4):
                        acc[t] += _decode_mma([r[0] for r in regs], [r[1] for r in regs], fx, [r[2] for r in regs],
                                              s, sh, q8, nt)
        acc_n = mt * nt * 4
        flat = red.reshape(wk, wr * acc_n * 32)
        for o in range(rows_cta * 8 * nt):
            rl, tok = o % rows_cta, o // rows_cta
            row = r0 + rl
            if row >= N or tok >= M:
                continue
            tw, gg, hh = rl >> 4, rl & 7, (rl >> 3) & 1
            j, tt = tok >> 3, tok & 7
            idx = ((tw // mt) * acc_n + ((tw % mt) * nt + j) * 4 + hh * 2 + (tt & 1)) * 32 + gg * 4 + (tt >> 1)
            out[tok, row] = _add_escapes(flat[:, idx].sum(), p, xb, row, tok, q8)
    return torch.from_numpy(out)


class _TmaImage:
    """The operands of csrc/w12_tma.cu as its copies leave them: planes, x padded to Kp, lane maps."""

    def __init__(self, x: torch.Tensor, p: w12.W12Weight, mt: int, cw: int, q8: bool, wg: bool, xbox: bool = False):
        self.M = x.shape[0]
        self.N, self.Kp = p.hi.shape
        self.nt = 1 if self.M <= 8 else 2 if self.M <= 16 else 4
        self.mt, self.cw, self.q8, self.wg, self.p, self.xbox = mt, cw, q8, wg, p, xbox
        self.R = 16 * mt * cw
        self.hi, self.lo = p.hi.numpy(), p.lo.numpy()
        self.e0 = p.e0.numpy().astype(U32)
        self.xb = torch.zeros((self.M, self.Kp), dtype=torch.bfloat16)
        self.xb[:, : x.shape[1]] = x
        self.xbytes = self.xb.view(torch.uint8).numpy()
        self.lane = np.arange(32)
        self.g, self.q = self.lane // 4, self.lane % 4
        self.sh = U32(4) * (self.q >> 1).astype(U32)

    def chunk(self, r0: int, c: int) -> np.ndarray:
        """One stage (row block r0, chunk c): the image the TMA / bulk copies write (row-major boxes,
        rows past N zero, tokens past M zero, pitches 64 / 32 / 144 bytes), read back at the
        consumers' LDS offsets; returns the accumulator increments [cw, mt, nt, 4, 32]."""
        mt, cw, nt, R, N, M = self.mt, self.cw, self.nt, self.R, self.N, self.M
        lane, g, q = self.lane, self.g, self.q
        st_hi = np.zeros((R, 64), dtype=np.uint8)
        st_lo = np.zeros((R, 32), dtype=np.uint8)
        n_in = min(R, N - r0)
        st_hi[:n_in] = self.hi[r0:r0 + n_in, 64 * c:64 * c + 64]
        st_lo[:n_in] = self.lo[r0:r0 + n_in, 32 * c:32 * c + 32]
        st_x = np.zeros((8 * nt, 144), dtype=np.uint8)
        st_x[:M, :128] = self.xbytes[:, 128 * c:128 * c + 128]
        bw = _wg_b_operand(st_x, 8 * nt) if self.wg else None
        if self.xbox:
            # TMA's 128-byte swizzle writes 16-byte unit u of token t at unit u ^ (t % 8) of its 128-byte
            # row; the consumers read byte b of token t at x_at(t, b) (csrc/w12_tma.cu, W12_XBOX)
            sw = np.zeros(8 * nt * 128, dtype=np.uint8)
            for tok in range(8 * nt):
                for u in range(8):
                    sw[tok * 128 + 16 * ((u ^ tok) & 7):][:16] = st_x[tok, 16 * u:16 * u + 16]

            def x_at(tok, b):
                return tok * 128 + ((((b >> 4) ^ tok) & 7) << 4) + (b & 15)

            def xread(tok, b):
                return sw[x_at(tok, b):x_at(tok, b) + 16]
        else:
            def xread(tok, b):
                return st_x[tok, b:b + 16]
        acc = np.zeros((cw, mt, nt, 4, 32))
        for w in range(cw):
            fx = [[words(np.stack([xread(8 * j + g[i], 32 * q[i] + 16 * k) for i in lane]))
                   for k in range(2)] for j in range(nt)]
            for t in range(mt):
                rl = [16 * (mt * w + t) + 8 * h + g for h in range(2)]
                fh = [words(np.stack([st_hi[rl[h][i], 16 * q[i]:16 * q[i] + 16] for i in lane])) for h in range(2)]
                fl = [words(np.stack([st_lo[rl[h][i], 16 * (q[i] & 1):16 * (q[i] & 1) + 16] for i in lane]))
                      for h in range(2)]
                e0x = []
                for h in range(2):
                    e = self.e0[np.minimum(r0 + rl[h], N - 1)]
                    e0x.append(((e << U32(7)) | (e << U32(23))).astype(U32))
                for s in range(4):
                    if self.wg:  # this warp's 16 rows of the m64 tile times the descriptor's B
                        acc[w, t] += _accumulate(_decode_a(fh, fl, e0x, s, self.sh, self.q8) @ bw[s], nt)
                    else:
                        acc[w, t] += _decode_mma(fh, fl, fx, e0x, s, self.sh, self.q8, nt)
        return acc

    def epilogue(self, out: np.ndarray, acc: np.ndarray, r0: int) -> None:
        """acc[w, t, j, i, lane] -> (row, token); escapes and the rounding as the kernel applies them."""
        for w in range(self.cw):
            for t in range(self.mt):
                for j in range(self.nt):
                    for i4 in range(4):
                        h, u = i4 // 2, i4 % 2
                        for ln in self.lane:
                            row = r0 + 16 * (self.mt * w + t) + 8 * h + self.g[ln]
                            tok = 8 * j + 2 * self.q[ln] + u
                            if row >= self.N or tok >= self.M:
                                continue
                            assert np.isnan(out[tok, row]), f"output ({tok}, {row}) written twice"
                            out[tok, row] = _add_escapes(acc[w, t, j, i4, ln], self.p, self.xb, row, tok, self.q8)


def emulate_tma(x: torch.Tensor, p: w12.W12Weight, *, mt: int, cw: int, splits: int = 1, q8: bool = False,
                wg: bool = False, xbox: bool = False):
    """csrc/w12_tma.cu, lane by lane (_TmaImage): split-K partials added in split order, and the
    epilogue's (acc -> row, token) mapping. `wg`: the wgmma path (x permuted into the K-major B
    layout, read through the descriptor); `xbox`: x as one swizzled 2-D box per stage."""
    im = _TmaImage(x, p, mt, cw, q8, wg, xbox)
    nch_all = im.Kp // 64
    per = -(-nch_all // splits)
    out = np.full((im.M, im.N), np.nan)
    for r0 in range(0, im.N, im.R):
        acc = np.zeros((cw, mt, im.nt, 4, 32))
        for y in range(splits):
            for c in range(y * per, min(nch_all, (y + 1) * per)):
                acc += im.chunk(r0, c)
        im.epilogue(out, acc, r0)
    return torch.from_numpy(out)


def emulate_tma_sk(x: torch.Tensor, p: w12.W12Weight, *, mt: int, cw: int, ctas: int, q8: bool = False,
                   seed: int = 0):
    """The stream-K path of csrc/w12_tma.cu (TmaConfig.sk): the unit split and fix-up of `stream_k.run_stream_k`
    over the TMA kernel's stage images (row blocks of R rows, 64-column chunks) and its epilogue."""
    im = _TmaImage(x, p, mt, cw, q8, False)
    nch_all = im.Kp // 64
    out = np.full((im.M, im.N), np.nan)

    def share(rb, c0, n):
        acc = np.zeros((cw, mt, im.nt, 4, 32))
        for c in range(c0, c0 + n):
            acc += im.chunk(rb * im.R, c)
        return acc

    run_stream_k(-(-im.N // im.R), nch_all, ctas, share, lambda rb, acc: im.epilogue(out, acc, rb * im.R), seed)
    return torch.from_numpy(out)


def _assert_emulation_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: w12.W12Weight, q8: bool) -> None:
    """An fp64 emulation of exact bf16 products differs from the reference only by reassociation:
    every output written, within 1e-12 of the largest |x| @ |w| sum."""
    want = (matmul_q8_reference if q8 else matmul_reference)(x, p).double()
    assert not torch.isnan(got).any(), "unwritten outputs"
    err = (got - want).abs().max().item()
    scale = (x.double().abs() @ w.double().abs().nan_to_num().T).max().item()
    assert err <= 1e-12 * scale, (err, scale)


def _weight(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    bits = w.view(torch.int16)
    # hostile values: zeros (both signs), subnormals, out-of-window, Inf-free (x is finite)
    flat = bits.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:12]
    flat[idx[:3]] = 0
    flat[idx[3:5]] = torch.tensor([-0x8000, 0x0001], dtype=torch.int16)
    flat[idx[5:8]] = torch.tensor([0x4700, -0x3900, 0x0081], dtype=torch.int16)  # huge, huge negative, tiny
    return bits.view(torch.bfloat16)


@pytest.mark.parametrize("q8", [False, True], ids=["mm", "q8"])
@pytest.mark.parametrize("M,N,K,mt,wk,wr", [(3, 40, 192, 2, 2, 1), (11, 24, 128, 1, 4, 1), (20, 17, 100, 1, 1, 1),
                                            (5, 75, 192, 1, 2, 2)],
                         ids=["M3-N40-K192", "M11-N24-K128", "M20-N17-K100", "M5-N75-K192-wr2"])
def test_emulated_kernel_matches_reference(M, N, K, mt, wk, wr, q8):
    w = _weight(N, K, seed=N * K + M)
    p = w12.pack(w, layout="planes")
    assert p.num_escapes > 0
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2).to(torch.bfloat16)
    got = emulate(x, p, mt=mt, wk=wk, wr=wr, q8=q8)
    _assert_emulation_exact(got, x, w, p, q8)


def test_byte_perm_selectors():
    """__byte_perm ignores a selector's sign bit: no selector given to it in any kernel source has one."""
    import re

    from w12 import cuda

    src = "".join(f.read_text() for f in (cuda.SOURCE, cuda.TMA_SOURCE, cuda.COMMON))
    sels = re.findall(r"__byte_perm\([^;]*?,\s*(0x[0-9A-Fa-f]+)\)", src)
    assert sels, "no __byte_perm calls found: update this test"
    for sel in sels:
        assert all(((int(sel, 16) >> (4 * i)) & 8) == 0 for i in range(4)), f"__byte_perm selector {sel} has a sign bit"


def test_decode_pair_all_codes():
    """Every (code, e0) pair: the 5-op decode equals the format's decode (code 0 -> 2^(e0-127))."""
    codes = np.arange(4096, dtype=U32)
    for e0 in (0, 1, 100, 127, 200, 240):
        h, nib = codes >> U32(4), codes & U32(0xF)
        y = (h << U32(8)) | nib | (((h << U32(8)) | nib) << U32(16))  # both lanes
        got = dec_pair(y, U32(e0 << 7 | e0 << 23))
        want = ((codes & U32(0x7FF)) + U32(e0 << 7)) | ((codes & U32(0x800)) << U32(4))
        assert np.array_equal(got & U32(0xFFFF), want) and np.array_equal(got >> U32(16), want)
        yq = h | (h << U32(16))
        gq = dec_pair_q8(yq, U32(e0 << 7 | e0 << 23))
        wq = (((h & U32(0x7F)) << U32(4)) + U32((e0 << 7) + 8 if e0 else 0)) | ((h & U32(0x80)) << U32(8))
        assert np.array_equal(gq & U32(0xFFFF), wq) and np.array_equal(gq >> U32(16), wq)


# --------------------------------------------------------------------------------------
# NVRTC (no GPU needed): every shipped shape builds, with the instructions its path needs and no
# local memory
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    """w12.cuda with the JIT cache in a fresh directory shared by this module's build tests: every build is
    a real NVRTC compilation, each one once."""
    from w12 import cuda as c

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPILOT_CACHE", str(tmp_path_factory.mktemp("jit")))
    yield c
    mp.undo()


def _ptx(cuda, cfg, nt, q8, arch, **kw) -> str:
    return cuda.build(cfg, nt, q8, arch, out="ptx", **kw).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_kernel_builds_with_mma_and_no_local_memory(arch, cuda):
    for cfg, nt, q8 in [(MmaConfig(1, 4, 2, split=3), 1, False), (MmaConfig(2, 8, 2), 4, False), (MmaConfig(1, 4, 3), 2, True),
                        (MmaConfig(1, 2, 2, wr=4), 2, False), (MmaConfig(2, 4, 4, async_copy=True), 4, False),
                        (MmaConfig(1, 8, 6, async_copy=True), 1, True)]:
        ptx = _ptx(cuda, cfg, nt, q8, arch)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
        assert ".local" not in ptx, f"{cfg} nt={nt}: a register array went to local memory"
        assert f".target sm_{arch[0]}{arch[1]}\n" in ptx


# (TmaConfig arguments, keyword arguments, nt): the CTA shapes the build test covers, one test case each (two
# NVRTC builds apiece, so pytest-xdist spreads them over its workers): 1, 2 and 4 row tiles a warp, 1 to 16
# consumer warps, 2 to 8 stages, the K split, x read ahead, 1, 2 and 4 token tiles
_TMA_BUILDS = [((1, 8, 8), dict(split=3), 4), ((4, 4, 4), {}, 2), ((1, 1, 2), {}, 1), ((1, 16, 4), {}, 4),
               ((2, 4, 4), dict(split=3, ahead=True), 4)]


@pytest.mark.slow
@pytest.mark.parametrize("args,kw,nt", _TMA_BUILDS,
                         ids=["-".join(map(str, a + tuple(f"{k}{v}" for k, v in kw.items()))) + f"-nt{nt}"
                              for a, kw, nt in _TMA_BUILDS])
def test_tma_kernel_builds_for_sm90_with_tma_mbarriers_mma_and_no_local_memory(args, kw, nt, cuda):
    """csrc/w12_tma.cu: TMA tensor copies of the planes, bulk copies of x, mbarrier waits, the
    consumers' proxy fence before each stage release, mma.sync and no local memory, for several
    shapes of the CTA; it refuses other generations."""
    from w12.configs import TmaConfig

    cfg = TmaConfig(*args, **kw)
    tensor_copies = {}
    for q8 in (False, True):
        ptx = _ptx(cuda, cfg, nt, q8, (9, 0))
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        assert "mbarrier.try_wait.parity" in ptx
        # the consumers' reads are ordered before the next async-proxy refill of the stage
        assert "fence.proxy.async.shared::cta" in ptx
        assert ".local" not in ptx, f"{cfg} nt={nt} q8={q8}: a register array went to local memory"
        # the tensor maps arrive as 128-byte, 128-aligned kernel parameters (CUtensorMap's layout)
        assert ".param .align 128 .b8 w12_matmul_tma_kernel_param_0[128]" in ptx
        tensor_copies[q8] = ptx.count("cp.async.bulk.tensor")
    # hi and lo copies (the ring fill is unrolled): the 8-bit view copies half
    assert tensor_copies[False] == 2 * tensor_copies[True] > 0, tensor_copies

    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        cuda.build(TmaConfig(), 1, False, (8, 0), out="ptx")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_mma_kernel_programmatic_launch_only_on_sm90(arch, cuda):
    """griddepcontrol exists from sm_90 on: the mma kernel waits / triggers there and has neither on sm_80."""
    ptx = _ptx(cuda, MmaConfig(2, 4, 2, split=3), 1, False, arch)
    assert ("griddepcontrol.wait" in ptx) == (arch[0] >= 9)
    assert ("griddepcontrol.launch_dependents" in ptx) == (arch[0] >= 9)


@pytest.mark.slow
def test_tma_xcp_path_builds_with_cp_async_and_barrier_arrivals(cuda):
    """TmaConfig(xcp=True): x by 16-byte cp.async from the producer lanes, each completing on the
    stage's full barrier (arrive.noinc, counted in its init), no per-token bulk copies; planes
    still by TMA; no local memory."""
    from w12.configs import TmaConfig

    for cfg, nt, q8 in [(TmaConfig(1, 8, 6, xcp=True), 4, False), (TmaConfig(2, 4, 4, split=3, xcp=True), 1, True),
                        (TmaConfig(1, 8, 6, ahead=True, xcp=True), 2, False)]:
        ptx = _ptx(cuda, cfg, nt, q8, (9, 0))
        assert "cp.async.cg.shared.global" in ptx
        assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx
        assert "mbarrier.init.shared::cta.b64" in ptx and ", 33;" in ptx  # 1 expect_tx + 32 lanes
        assert "cp.async.bulk.shared::cluster.global" not in ptx
        assert "cp.async.bulk.tensor.2d" in ptx
        assert ".local" not in ptx
    plain = _ptx(cuda, TmaConfig(1, 8, 6), 4, False, (9, 0))
    assert "cp.async.mbarrier.arrive" not in plain and "cp.async.bulk.shared::cluster.global" in plain


@pytest.mark.slow
@pytest.mark.parametrize("args,kw,nt,q8", [((1, 8, 6), dict(sk=2), 1, False), ((2, 4, 4), dict(sk=1, xcp=True), 4, True)],
                         ids=["sk2", "xcp-sk1-q8"])
def test_tma_stream_k_path_builds_with_consumer_barrier_and_counters(args, kw, nt, q8, cuda):
    """TmaConfig(sk=...): the consumers' named barrier (the producer is not in it), the per-row-block
    arrival counter, the workspace's L2-only stores and loads; no local memory."""
    from w12.configs import TmaConfig

    cfg = TmaConfig(*args, **kw)
    ptx = _ptx(cuda, cfg, nt, q8, (9, 0))
    assert f"bar.sync 1, {32 * cfg.cw};" in ptx
    assert "atom.global.add" in ptx and "st.global.cg.f32" in ptx and "ld.global.cg.f32" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx
    assert ".local" not in ptx


@pytest.mark.slow
def test_tma_plain_build_has_no_named_barrier_and_sk_is_checked(cuda):
    """The build without stream-K has no named barrier; sk's range, its exclusion of split and its tag."""
    from w12.configs import TmaConfig

    plain = _ptx(cuda, TmaConfig(1, 8, 6), 1, False, (9, 0))
    assert "bar.sync 1," not in plain  # (its split-K path has the counter too)
    with pytest.raises(ValueError, match="sk in 0..4"):
        TmaConfig(1, 8, 6, split=3, sk=2)
    with pytest.raises(ValueError, match="sk in 0..4"):
        TmaConfig(1, 8, 6, sk=5)
    assert TmaConfig(1, 8, 6, xcp=True, sk=2).tag() == "tma-mt1-cw8-st6-xcp-sk2"


@pytest.mark.slow
def test_tma_trace_build_stamps_globaltimer_only_when_asked(cuda):
    """defines={"W12_TRACE": 1} (a diagnostic build) reads %globaltimer and %smid; the shipped build does not."""
    from w12.configs import TmaConfig

    plain = _ptx(cuda, TmaConfig(1, 8, 6), 1, False, (9, 0))
    assert "%globaltimer" not in plain
    traced = _ptx(cuda, TmaConfig(1, 8, 6), 1, False, (9, 0), defines={"W12_TRACE": 1})
    assert "%globaltimer" in traced and "%smid" in traced and ".local" not in traced


@pytest.mark.slow
def test_tma_x_box_path_builds_with_three_tensor_copies(cuda):
    """TmaConfig(xbox=True): x arrives by a third 2-D tensor copy per stage (no per-token bulk copies,
    no zero-fill loop: TMA fills tokens past M), the consumers still fence before each release; the
    other builds' kernel has no x tensor-map parameter."""
    from w12.configs import TmaConfig

    for cfg, nt, q8 in [(TmaConfig(1, 8, 6, xbox=True), 4, False), (TmaConfig(2, 4, 4, split=3, xbox=True), 2, True),
                        (TmaConfig(1, 4, 8, sk=2, xbox=True), 1, False)]:
        ptx = _ptx(cuda, cfg, nt, q8, (9, 0))
        plain = _ptx(cuda, TmaConfig(cfg.mt, cfg.cw, cfg.stages, cfg.split, sk=cfg.sk), nt, q8, (9, 0))
        assert "cp.async.bulk.shared::cluster.global" not in ptx and "cp.async.bulk.shared::cluster.global" in plain
        assert ptx.count("cp.async.bulk.tensor.2d") > plain.count("cp.async.bulk.tensor.2d")
        assert "fence.proxy.async.shared::cta" in ptx and ".local" not in ptx
        assert "w12_matmul_tma_kernel_param_16" in ptx and "w12_matmul_tma_kernel_param_16" not in plain
    with pytest.raises(ValueError, match="xbox without xcp or wg"):
        TmaConfig(1, 8, 6, xcp=True, xbox=True)
    assert TmaConfig(1, 8, 6, xbox=True).tag() == "tma-mt1-cw8-st6-xbox"
    assert cuda.smem_bytes(TmaConfig(2, 4, 6, xbox=True), 1, False) == 6 * 13312 + 1024 + 96


@pytest.mark.slow
def test_tma_wgmma_path_builds_for_sm90a(cuda):
    """TmaConfig(wg=True): wgmma with A from registers (sm_90a), the proxy fence before it reads the
    buffers the threads wrote, immediate named-barrier ids, no local memory, every n-tile count; the
    SASS has HGMMA and no HMMA."""
    from w12.configs import TmaConfig

    for cfg, nt, q8 in [(TmaConfig(1, 4, 6, wg=True), 1, False), (TmaConfig(1, 8, 4, split=3, wg=True), 2, False),
                        (TmaConfig(1, 4, 6, wg=True), 4, True), (TmaConfig(1, 8, 6, wg=True), 4, False)]:
        ptx = _ptx(cuda, cfg, nt, q8, (9, 0))
        assert f"wgmma.mma_async.sync.aligned.m64n{8 * nt}k16.f32.bf16.bf16" in ptx
        assert "mma.sync" not in ptx
        assert "fence.proxy.async.shared::cta" in ptx and "wgmma.wait_group.sync.aligned" in ptx
        assert "bar.sync \t1, 128" in ptx or "bar.sync 1, 128" in ptx
        assert ".local" not in ptx, f"{cfg} nt={nt}: a register array went to local memory"
        assert ".target sm_90a" in ptx
    sass = testing.sass(cuda.build(TmaConfig(1, 8, 6, wg=True), 4, False, (9, 0)))
    assert "HGMMA" in sass and "HMMA" not in sass.replace("HGMMA", "")


def test_build_options_are_parameters_and_part_of_the_cache_key(cuda):
    """Extra defines give another specialisation (another cache file); the same call is one cached build."""
    from w12.configs import TmaConfig

    a = cuda.spec(TmaConfig(1, 8, 6), 1, False, (9, 0))
    b = cuda.spec(TmaConfig(1, 8, 6), 1, False, (9, 0), defines={"W12_TRACE": 1})
    assert a != b and dict(b.defines)["W12_TRACE"] == "1" and a.arch == "sm_90"
    assert cuda.spec(TmaConfig(1, 8, 6, wg=True), 1, False, (9, 0)).arch == "sm_90a"
    assert a.compile() == a.compile() and a.compile().cubin != b.compile().cubin


def test_tma_config_validation_and_smem():
    from w12 import cuda
    from w12.configs import TmaConfig

    with pytest.raises(ValueError, match="16 \\* mt \\* cw <= 256"):
        TmaConfig(mt=4, cw=8)
    with pytest.raises(ValueError, match="stages"):
        TmaConfig(stages=1)
    for bad in (dict(mt=2, cw=4), dict(mt=1, cw=2), dict(mt=1, cw=16), dict(mt=1, cw=4, ahead=True)):
        with pytest.raises(ValueError, match="wg=True"):
            TmaConfig(wg=True, **bad)
    assert TmaConfig(1, 8, 4, wg=True).tag() == "tma-mt1-cw8-st4-wg"
    assert TmaConfig(1, 8, 6, split=3, xcp=True).tag() == "tma-mt1-cw8-st6-s3-xcp"
    # wgmma: the ring, a 1 KiB barrier slot, two permuted-x buffers (32 tokens x 128 B) per warpgroup
    assert cuda.smem_bytes(TmaConfig(1, 8, 4, wg=True), 4, False) == 4 * 17408 + 1024 + 1024 + 2 * 2 * 4096
    c = TmaConfig(2, 4, 6)
    assert c.rows == 128 and c.tag() == "tma-mt2-cw4-st6"
    # stage = hi 128 x 64 + lo 128 x 32 + x 8 tokens x 144 B, rounded up to 1 KiB; + slack + barriers
    assert cuda.smem_bytes(c, 1, False) == 6 * 14336 + 1024 + 96
    assert cuda.smem_bytes(c, 1, True) == 6 * 10240 + 1024 + 96


@pytest.mark.parametrize("q8", [False, True], ids=["mm", "q8"])
@pytest.mark.parametrize("M,N,K,mt,cw,splits,wg", [(3, 40, 192, 1, 2, 1, False), (11, 50, 128, 2, 1, 2, False),
                                                   (20, 17, 100, 1, 1, 3, False), (5, 70, 128, 1, 4, 1, True),
                                                   (13, 40, 192, 1, 4, 2, True), (29, 130, 100, 1, 8, 3, True)],
                         ids=["M3-N40-K192", "M11-N50-K128-split2", "M20-N17-K100-split3", "M5-N70-K128-wg",
                              "M13-N40-K192-wg-split2", "M29-N130-K100-wg2-split3"])
def test_emulated_tma_kernel_matches_reference(M, N, K, mt, cw, splits, wg, q8):
    """The TMA kernel's shared-memory addressing and epilogue mapping (rows past N, tokens past M,
    splits, one with no chunk at all) give the reference product; also on its wgmma path, whose
    permuted B layout and descriptor strides are modelled from the PTX ISA (checked on a GPU by
    the odd-shape tests)."""
    w = _weight(N, K, seed=N * K + M + 1)
    p = w12.pack(w, layout="planes")
    assert p.num_escapes > 0
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M + 1)) * 2).to(torch.bfloat16)
    got = emulate_tma(x, p, mt=mt, cw=cw, splits=splits, q8=q8, wg=wg)
    _assert_emulation_exact(got, x, w, p, q8)


@pytest.mark.parametrize("q8", [False, True], ids=["mm", "q8"])
@pytest.mark.parametrize("M,N,K,mt,cw,splits", [(3, 40, 192, 1, 2, 1), (13, 50, 128, 2, 1, 2), (29, 17, 100, 1, 1, 3)],
                         ids=["M3-N40-K192", "M13-N50-K128-split2", "M29-N17-K100-split3"])
def test_emulated_tma_x_box_matches_reference(M, N, K, mt, cw, splits, q8):
    """TmaConfig(xbox=True): the consumers' swizzled x addresses (x_at) read back exactly what TMA's
    128-byte swizzle wrote, for 1, 2 and 4 token tiles (tokens past M zero)."""
    w = _weight(N, K, seed=N * K + M + 5)
    p = w12.pack(w, layout="planes")
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M + 5)) * 2).to(torch.bfloat16)
    got = emulate_tma(x, p, mt=mt, cw=cw, splits=splits, q8=q8, xbox=True)
    _assert_emulation_exact(got, x, w, p, q8)


@pytest.mark.parametrize("rows,kc,ctas", [(1, 1, 1), (3, 80, 264), (40, 96, 264), (129, 80, 264), (7, 5, 30),
                                          (1940, 80, 264), (5, 96, 7)])
def test_stream_k_bookkeeping(rows, kc, ctas):
    """The stream-K unit split and fix-up (`stream_k.run_stream_k`, the sk_* helpers of w12_common.cuh) on
    grids of 1 to 264 CTAs: every row block's total equals the sum of its units and is finished once."""
    rng = np.random.default_rng(rows * 1000 + kc)
    unit = rng.standard_normal(rows * kc)  # each unit's contribution to its row block
    got = np.full(rows, np.nan)

    def finish(rb, total):
        assert np.isnan(got[rb]), f"row block {rb} finished twice"
        got[rb] = total

    run_stream_k(rows, kc, min(ctas, rows * kc), lambda rb, c0, n: unit[rb * kc + c0:rb * kc + c0 + n].sum(), finish,
                 seed=rows)
    np.testing.assert_allclose(got, unit.reshape(rows, kc).sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q8", [False, True], ids=["mm", "q8"])
@pytest.mark.parametrize("M,N,K,mt,cw,ctas", [(3, 40, 192, 1, 1, 2), (11, 50, 256, 1, 1, 5), (20, 17, 100, 1, 1, 2),
                                              (5, 70, 192, 1, 2, 7), (29, 130, 256, 1, 2, 20), (1, 33, 64, 1, 1, 3)],
                         ids=["M3-N40-K192-P2", "M11-N50-K256-P5", "M20-N17-K100-P2", "M5-N70-K192-P7",
                              "M29-N130-K256-P20-one-unit-each", "M1-N33-K64-P3-no-split"])
def test_emulated_tma_stream_k_matches_reference(M, N, K, mt, cw, ctas, q8):
    """Stream-K (TmaConfig.sk): CTA ranges that start and end inside row blocks, cover one row block
    only in part, span three row blocks, or hold one unit each; every output written exactly once,
    and equal, bit for bit, whichever CTA arrives last."""
    w = _weight(N, K, seed=N * K + M + 2)
    p = w12.pack(w, layout="planes")
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M + 3)) * 2).to(torch.bfloat16)
    got = emulate_tma_sk(x, p, mt=mt, cw=cw, ctas=ctas, q8=q8, seed=0)
    _assert_emulation_exact(got, x, w, p, q8)
    again = emulate_tma_sk(x, p, mt=mt, cw=cw, ctas=ctas, q8=q8, seed=1)  # another arrival order
    assert torch.equal(got, again)
