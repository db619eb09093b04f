"""Launch configs of the W12 GEMMs: frozen dataclasses, an analytical default, tuned entries as data.

Lookup (autotune.get_config): forced config > tuned JSON entry `w12.matmul/<variant>/M<b>-K<K>-N<N>`
> the heuristic below. Variants and the kernel each one runs:

| variant   | kernel                         | config     | used for                              |
| --------- | ------------------------------ | ---------- | ------------------------------------- |
| `mma`     | `w12_matmul_mma_kernel` (CUDA  | MmaConfig  | default on sm_80+ GPUs: bf16 x,      |
|           | C++, csrc/w12_mma.cu)          |            | M <= 32; else the Triton rows below   |
| `mma`     | `w12_matmul_tma_kernel` (CUDA  | TmaConfig  | sm_90, where a tuned entry under      |
|           | C++, csrc/w12_tma.cu)          |            | variant `tma` exists (it won there)   |
| `tc`      | `w12_matmul_tc_kernel`         | TcConfig   | sm_90 (wgmma), M > TC_GEMV_MAX_M (1)  |
| `tc`      | `w12_matmul_gemv_kernel`       | GemvConfig | sm_90, M = 1; tuned under `gemv`      |
| `tc`      | `w12_matmul_gemv_kernel`       | GemvConfig | sm_90, 1 < M <= GEMV_MAX_M only where |
|           |                                |            | a `tc.gemv` entry exists (GEMV won)   |
| `gemv`    | `w12_matmul_gemv_kernel`       | GemvConfig | no-wgmma GPUs, M <= GEMV_MAX_M        |
| `gemv`    | `w12_matmul_tc_kernel` (mma)   | TcConfig   | no-wgmma GPUs, M > GEMV_MAX_M; tuned  |
|           |                                |            | entries under variant `gemv.mma`      |

On the runtime layout (`w12.matmul_tiled`): `FlowConfig` (the flow kernel, up to 32 rows a launch; tuned entries
under variant `flow`) and `BatchConfig` (the batch kernel, many rows of x; it runs where forced or where a tuned
entry under variant `batch` exists).

A forced config picks its kernel: `force("w12.matmul", config=GemvConfig(...))` runs the CUDA-core
kernel at any M, `config=TcConfig(...)` the tensor-core one, `config=MmaConfig(...)` / `TmaConfig(...)` the CUDA C++ ones,
`config=FlowConfig(...)` the flow kernel on the runtime layout (csrc/w12_flow.cu, w12/layout.py; never chosen
automatically, not yet measured on a GPU). `matmul_q8` looks configs up under
op `w12.matmul_q8` (its bytes per weight differ), with the same variants.

The heuristic is written in bytes in flight. Decode at small M is memory-bound: the kernel must
keep about bandwidth x latency = 4.8 TB/s x ~1 us ~ 5 MB in flight on an H200, i.e. ~36 KB per
SM. A tensor-core CTA holds `(num_stages - 1) x BN x BK x bytes/weight` in its cp.async ring; a
CUDA-core CTA holds one tile per iteration (its loads are not software-pipelined) so it relies on
several CTAs per SM. Then split-K is chosen so that the grid fills the machine in whole waves.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

import autotune

__all__ = ["TcConfig", "GemvConfig", "MmaConfig", "FlowConfig", "BatchConfig", "flow_heuristic", "flow_config",
           "batch_heuristic", "GEMV_MAX_M", "tc_heuristic", "gemv_heuristic", "sm_count", "pick_split_k",
           "mma_heuristic"]

GEMV_MAX_M = 4  # the no-wgmma variant runs the CUDA-core kernel up to this M
_TARGET_INFLIGHT = 40 << 10  # bytes per SM the loads should keep in flight (see module doc)
_SMEM_PER_SM = 227 << 10
_MIN_ITERS_PER_SPLIT = 4  # below this a split's pipeline never reaches steady state


@dataclass(frozen=True)
class TcConfig:
    """Tensor-core kernel: tile [block_n weight rows] x [block_t tokens] x [block_k columns]."""

    block_n: int = 128  # MMA M (weight rows): 64 per warpgroup on wgmma
    block_t: int = 16  # MMA N (tokens): >= 16 for tl.dot
    block_k: int = 128  # multiple of 64 (one `lo` interleave group); >= 128 gives 16-byte loads
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 4
    select_zero: bool = False  # spec-literal `code 0 -> 0` select per weight (see kernels/tc.py)
    asm: bool = False  # packed PTX decode (kernels/pk_decode.py); GPU only, the interpreter ignores it
    fuse: bool = False  # one [BN, BK] operand and one tl.dot per K iteration (kernels/tc.py, FUSE)

    def __post_init__(self):
        _check_common(self)
        if self.block_t < 16 or self.block_n < 16:
            raise ValueError(f"TcConfig needs block_n, block_t >= 16 (tl.dot), got {self}")


@dataclass(frozen=True)
class GemvConfig:
    """CUDA-core kernel: fp32 FMA over a [block_n, block_k/2, block_t] accumulator."""

    block_n: int = 32
    block_t: int = 1  # tokens per program (power of two)
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    select_zero: bool = False
    asm: bool = False  # packed PTX decode (kernels/pk_decode.py); GPU only, the interpreter ignores it
    tok2d: bool = False  # one 2-D accumulator per token (block_t <= 4), see kernels/gemv.py

    def __post_init__(self):
        _check_common(self)
        if self.tok2d and self.block_t > 4:
            raise ValueError(f"GemvConfig(tok2d=True) needs block_t <= 4, got {self}")


@dataclass(frozen=True)
class MmaConfig:
    """CUDA C++ kernel (csrc/w12_mma.cu): a CTA of `wr` x `wk` warps owns 16 * `mt` * `wr` weight
    rows; `wk` warp groups split K, `wr` split the rows (and share x through L1). Each warp keeps
    `pipe` 64-column chunks in registers (pipe - 1 loading while one computes). Token tiles
    (8 tokens each) follow from M; they are not part of the config."""

    mt: int = 1
    wk: int = 4
    pipe: int = 2
    wr: int = 1
    async_copy: bool = False  # pipe-stage cp.async ring in shared memory (loads in flight hold no registers)
    split: int = 1  # CTAs along K per row block (fp32 partials, the last CTA finishes; one launch)

    def __post_init__(self):
        pipes = (2, 3, 4, 6, 8) if self.async_copy else (2, 3, 4)
        if self.mt not in (1, 2, 4) or self.wk not in (1, 2, 4, 8, 16) or self.pipe not in pipes \
                or self.wr not in (1, 2, 4, 8) or self.wk * self.wr > 16 or self.mt > 2 * self.wk \
                or not 1 <= self.split <= 64:
            raise ValueError("MmaConfig needs mt in (1, 2, 4), wk in (1, 2, 4, 8, 16), wr in (1, 2, 4, 8), "
                             f"wk * wr <= 16 (512 threads), mt <= 2 * wk, 1 <= split <= 64 and pipe in {pipes}; got {self}")

    def tag(self) -> str:
        return f"mt{self.mt}-wk{self.wk}-p{self.pipe}" + (f"-wr{self.wr}" if self.wr > 1 else "") + \
            ("-a" if self.async_copy else "") + (f"-s{self.split}" if self.split > 1 else "")


@dataclass(frozen=True)
class TmaConfig:
    """CUDA C++ kernel for sm_90 (csrc/w12_tma.cu): one producer warp streams 64-column chunks of
    the planes (2-D TMA boxes) and of x (one bulk copy per token) into a `stages`-deep ring; `cw` consumer
    warps, each owning 16 * `mt` rows, decode them in registers into mma.sync. A CTA owns
    16 * `mt` * `cw` rows (<= 256, one TMA box); `split` CTAs share a row block along K.
    Options, both correct on the H200 and both opt-in (docs/w12.md, "What was tried"):
    `ahead` (consumers read stage i + 1 before computing stage i; within noise of the default) and
    `wg` (each warpgroup of 4 consumer warps issues one wgmma m64 x n(8 NT) x k16 per k-step with
    the decoded A from registers and x permuted into a K-major shared-memory B; sm_90a; slower
    than mma.sync on every measured cell: the per-stage permutation copy costs more than it saves).
    `xcp`: x copied by cp.async from all 32 producer lanes (M / 4 instructions per stage) instead of
    M bulk copies, which make M = 32 ~2.5x slower than M = 1 (H200: correct in 400 launches of the
    race probe; the LM head at M = 32 went from 0.90x to 1.20x cuBLAS).
    `sk` (stream-K): the grid is sk CTAs per SM and each CTA takes an equal contiguous
    range of the (row block, 64-column chunk) units, crossing row blocks, so no SM idles in a last
    partial wave; a row block shared by several CTAs is summed in the workspace in CTA order
    (deterministic) by the last of them to arrive; each CTA publishes its shares as it goes and
    arrives (fence, counters, fix-ups) only after its last unit, so its ring never stalls mid-range.
    `xbox`: x as one 2-D TMA box per stage with the 128-byte swizzle (no per-token bulk copies); with
    the consumers' proxy fence it is correct on the H200 (0 of 1200 race-probe launches wrong,
    20261130-w12-tma-race-xbox.json, in git history) and 16 tuned entries use it, mostly at M = 16-32."""

    mt: int = 2
    cw: int = 4
    stages: int = 6
    split: int = 1
    ahead: bool = False  # consumers read stage i + 1's fragments before computing stage i
    wg: bool = False  # wgmma (sm_90a) with the decoded A from registers; needs mt = 1, cw in (4, 8)
    xcp: bool = False  # x by cp.async from the whole producer warp, not one bulk copy per token
    sk: int = 0  # stream-K: a grid of sk CTAs per SM, each an equal contiguous range of (row block, chunk) units
    xbox: bool = False  # x by one 2-D TMA box per stage (128-byte swizzle) instead of a bulk copy per token

    def __post_init__(self):
        if self.mt not in (1, 2, 4) or self.cw not in (1, 2, 4, 8, 16) or 16 * self.mt * self.cw > 256 \
                or not 2 <= self.stages <= 16 or not 1 <= self.split <= 64 \
                or (self.wg and (self.mt != 1 or self.cw not in (4, 8) or self.ahead)) \
                or self.sk not in (0, 1, 2, 3, 4) or (self.sk and (self.split != 1 or self.wg or self.ahead)) \
                or (self.xbox and (self.xcp or self.wg)):
            raise ValueError("TmaConfig needs mt in (1, 2, 4), cw in (1, 2, 4, 8, 16), 16 * mt * cw <= 256 rows, "
                             "2 <= stages <= 16, 1 <= split <= 64, for wg=True mt = 1, cw in (4, 8) and no "
                             "look-ahead, sk in 0..4 (CTAs per SM) with split = 1, no wg and no look-ahead, and "
                             f"xbox without xcp or wg; got {self}")

    @property
    def rows(self) -> int:
        return 16 * self.mt * self.cw

    def tag(self) -> str:
        return f"tma-mt{self.mt}-cw{self.cw}-st{self.stages}" + (f"-s{self.split}" if self.split > 1 else "") + \
            ("-ah" if self.ahead else "") + ("-wg" if self.wg else "") + ("-xcp" if self.xcp else "") + \
            (f"-sk{self.sk}" if self.sk else "") + ("-xbox" if self.xbox else "")


@dataclass(frozen=True)
class FlowConfig:
    """CUDA C++ kernel (csrc/w12_flow.cu, sm_80+) on the runtime layout (w12/layout.py): a CTA of `warps` warps owns
    warps / `kw` row blocks of 16 rows, and the `kw` warps of a row block split its K (their shares are added in
    shared memory, in warp order). Each warp streams its tiles through its own `stages`-slot cp.async ring, with
    the evict-first L2 policy when `evict`. `cps`: CTAs per SM the launch bound is set for. `fixed`: the fixed-base
    decode with the exact power-of-two scale (its x-range guard sends rows outside the identity's range to the
    exact base); the default is the exact base, which measured faster on the H200 at every layer and M of the
    ladder (docs/w12-kernels.md, "The flow kernel"). `rb`: row blocks per warp (1 or 2; exact base only), which
    multiply the same x fragments, so that at 2 one x read feeds 32 weight rows; every row block's result is the
    same bit for bit. `kc`: CTAs of one thread-block cluster (sm_90) that split the row groups' K as well (1 to 4;
    exact base only): rank 0 adds the others' sums, received in its shared memory, in rank order. `wg`: the
    warpgroup build (sm_90a: wgmma; exact base, rb = 1, warps a multiple of 4 kw): each 4 warps own 64 consecutive
    rows and one K piece and multiply them by x with wgmma, x staged once per warpgroup in shared memory, so that one
    x read feeds 64 weight rows (docs/w12-kernels.md, "The warpgroup build"). `xd` (mma.sync build only, 0 to 2):
    x held in xd + 1 register sets, each loaded xd units before its mma (the loop unrolled by xd + 1); 0 keeps one
    set, copied from the set loaded one unit ahead, which makes the compiler wait for that load within the unit
    that issued it (docs/w12-kernels.md, "x loaded ahead"); every xd gives the same bits. `kg`: the kc CTAs
    splitting K are not a cluster but meet in a global workspace, the last of them adding the others' sums in rank
    order (any sm_80+ GPU; kc up to 8; the cluster build's bits; tag `-p<kc>`). `late`: the first tile copies go out
    before the decode constants and the escapes' dependent loads are waited for (tag `-l`; the same bits). `escx`: x at each
    finished row's first escape column is copied into shared memory (4-byte cp.async) right after the wait for the
    previous kernel, and the epilogue's first escape reads it there instead of from global memory (tag `-e`; the same
    bits). `xh` (mma.sync build with xd = 0): one x set, each half of it (k-steps 0-1, 2-3) reloaded with the next
    unit's as soon as this unit's mma on it are issued, so that x takes half the registers of two sets while each
    load still has about half a unit to land (tag `-h`; the same bits).
    `xs` (mma.sync build, one x set, exact base): each unit's x is staged in shared memory, one ring of
    `stages` slots per K piece, copied (cp.async through L1, in the commit group of the weight tiles, stages - 1 units
    ahead) by the warps of that piece, which meet at a named barrier per unit and read their fragments from the slot:
    x is fetched once per CTA and K piece instead of once per warp, holds no registers in flight, and with rb = 2
    feeds both row blocks of a warp (tag `-xs`; the same bits). `w12.matmul_tiled` (the engine's path) takes
    `flow_config`'s; under `w12.matmul` on the planes it runs only when forced."""

    warps: int = 8
    kw: int = 2
    stages: int = 4
    cps: int = 2
    fixed: bool = False
    evict: bool = True
    rb: int = 1
    kc: int = 1
    wg: bool = False
    xd: int = 0
    kg: bool = False
    late: bool = False
    escx: bool = False
    xh: bool = False
    xs: bool = False

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8, 16) or self.kw not in (1, 2, 4, 8, 16) or self.warps % self.kw \
                or not 2 <= self.stages <= 12 or not 1 <= self.cps <= 8 or self.warps * self.cps > 32:
            raise ValueError("FlowConfig needs warps in (1, 2, 4, 8, 16), kw in (1, 2, 4, 8, 16) dividing warps, "
                             f"2 <= stages <= 12, cps in 1..8 and warps * cps <= 32 (warps per SM); got {self}")
        if self.rb not in (1, 2) or (self.rb == 2 and self.fixed):
            raise ValueError(f"FlowConfig needs rb (row blocks per warp) 1 or 2, and 2 only with the exact base "
                             f"(fixed=False); got {self}")
        if not 1 <= self.kc <= (8 if self.kg else 4) or (self.kc > 1 and self.fixed) or (self.kg and self.kc < 2):
            raise ValueError(f"FlowConfig needs kc (CTAs splitting K) 1 to 4 in a cluster or 2 to 8 through global "
                             f"memory (kg=True), and above 1 only with the exact base (fixed=False); got {self}")
        if self.wg and (self.fixed or self.rb != 1 or self.warps % (4 * self.kw)):
            raise ValueError(f"FlowConfig(wg=True) needs the exact base (fixed=False), rb=1 and warps a multiple of "
                             f"4 * kw (warpgroups of 4 warps per K piece); got {self}")
        if self.xd not in (0, 1, 2) or (self.xd and self.wg):
            raise ValueError(f"FlowConfig needs xd (x sets loaded ahead) 0, 1 or 2, and 0 in the warpgroup build "
                             f"(wg=True), which stages x in shared memory; got {self}")
        if self.xh and (self.xd or self.wg):
            raise ValueError(f"FlowConfig(xh=True) reloads the mma.sync build's one x set by halves: it needs xd=0 and "
                             f"wg=False; got {self}")
        if self.xs and (self.xd or self.xh or self.wg or self.fixed or self.kw > 15):
            raise ValueError(f"FlowConfig(xs=True) stages the mma.sync build's one x set in shared memory: it needs "
                             f"xd=0, xh=False, wg=False, the exact base (fixed=False) and kw <= 15; got {self}")

    @property
    def row_blocks(self) -> int:
        """Row blocks of 16 rows per CTA."""
        return self.warps // self.kw * self.rb

    @property
    def rows(self) -> int:
        return 16 * self.row_blocks

    def tag(self) -> str:
        return f"flow-w{self.warps}-k{self.kw}-s{self.stages}-c{self.cps}" + ("-fixed" if self.fixed else "") + \
            ("" if self.evict else "-keep") + (f"-r{self.rb}" if self.rb > 1 else "") + \
            (f"-{'p' if self.kg else 'q'}{self.kc}" if self.kc > 1 else "") + (f"-x{self.xd}" if self.xd else "") + \
            ("-l" if self.late else "") + ("-e" if self.escx else "") + ("-h" if self.xh else "") + \
            ("-g" if self.wg else "") + ("-xs" if self.xs else "")

    @classmethod
    def from_tag(cls, tag: str) -> "FlowConfig":
        """The config whose `tag()` is `tag` (the leading "flow-" may be left out), e.g. "w4-k1-s6-c3-q4-g"."""
        m = re.fullmatch(r"(?:flow-)?w(\d+)-k(\d+)-s(\d+)-c(\d+)(-fixed)?(-keep)?(?:-r(\d+))?(?:-([qp])(\d+))?(?:-x(\d+))?"
                         r"(-l)?(-e)?(-h)?(-g)?(-xs)?", tag)
        if m is None:
            raise ValueError(f"FlowConfig.from_tag: {tag!r} is not a flow config tag (e.g. 'flow-w4-k1-s4-c4-q2-g')")
        w, k, st, c, fixed, keep, rb, split, kc, xd, late, escx, xh, wg, xs = m.groups()
        return cls(warps=int(w), kw=int(k), stages=int(st), cps=int(c), fixed=bool(fixed), evict=not keep,
                   rb=int(rb or 1), kc=int(kc or 1), wg=bool(wg), xd=int(xd or 0), kg=split == "p",
                   late=bool(late), escx=bool(escx), xh=bool(xh), xs=bool(xs))


@dataclass(frozen=True)
class BatchConfig:
    """The runtime layout's tensor-core GEMM for many rows of x (kernels/batch.py, swap-AB): a program owns
    `block_n` weight rows and `block_t` rows of x (the MMA's N: up to 256, so a batch of that many rows reads the
    weight once) and takes `groups` 64-column groups a K step; `split_k` K shares meet in an fp32 workspace (a fixed
    order). `asm`: the packed PTX decode (kernels/pk_decode.py; a GPU only, the interpreter takes the plain one).
    `fixup` (with split_k > 1): the last K share of a tile to finish adds the shares' partials, in the same order as
    the split-K reduce kernel (the same bits), so the call is one launch (tag `-f`). `kt`: the MMA's k order in which
    a thread's pairs of a row are adjacent in the tile (tag `-kt`; kernels/batch.py): 16-byte tile copies, x read in
    4-byte runs; another order of the fp32 sums, so other bits than without it."""

    block_n: int = 64  # MMA M (weight rows): 64 per warpgroup on wgmma
    block_t: int = 128  # MMA N (rows of x)
    groups: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True
    fixup: bool = False
    kt: bool = False

    def __post_init__(self):
        for f in ("block_n", "block_t"):
            v = getattr(self, f)
            if not 16 <= v <= 256 or v & (v - 1):
                raise ValueError(f"BatchConfig needs {f} a power of two from 16 to 256, got {self}")
        if self.groups not in (1, 2, 4) or self.split_k < 1 or self.num_warps not in (1, 2, 4, 8, 16) \
                or self.num_stages < 1:
            raise ValueError(f"BatchConfig needs groups in (1, 2, 4), split_k >= 1, num_warps in (1, 2, 4, 8, 16) "
                             f"and num_stages >= 1; got {self}")

    def tag(self) -> str:
        return f"batch-n{self.block_n}-t{self.block_t}-g{self.groups}-k{self.split_k}-w{self.num_warps}-" \
            f"s{self.num_stages}" + ("" if self.asm else "-plain") + ("-f" if self.fixup else "") + \
            ("-kt" if self.kt else "")

    @classmethod
    def from_tag(cls, tag: str) -> "BatchConfig":
        """The config whose `tag()` is `tag` (the leading "batch-" may be left out), e.g. "n64-t128-g1-k2-w4-s3"."""
        m = re.fullmatch(r"(?:batch-)?n(\d+)-t(\d+)-g(\d+)-k(\d+)-w(\d+)-s(\d+)(-plain)?(-f)?(-kt)?", tag)
        if m is None:
            raise ValueError(f"BatchConfig.from_tag: {tag!r} is not a batch config tag "
                             "(e.g. 'batch-n64-t128-g1-k2-w4-s3')")
        bn, bt, g, k, w, st, plain, fixup, kt = m.groups()
        return cls(block_n=int(bn), block_t=int(bt), groups=int(g), split_k=int(k), num_warps=int(w),
                   num_stages=int(st), asm=not plain, fixup=bool(fixup), kt=bool(kt))


def batch_heuristic(M: int, N: int, K: int, device: torch.device) -> BatchConfig:
    """The batch kernel's default (docs/w12-kernels.md, "The batch kernel"): 64 weight rows and one warpgroup a
    program, x's rows on the MMA's N up to 128 (more take a second program over the same weight rows), three stages,
    and two 64-column groups a K step up to 64 rows of x (one above: two groups' stages would leave one CTA an SM
    there); from 64 rows of x a program, the `kt` order (on an H100 this config took 0.44-0.94x its time without it
    in each of the 28 layer and row-count cells of 64-256 rows timed; docs/w12-kernels.md). The sm_90 builds (Triton
    3.6, compiled on a CPU) hold the step without spills: with kt 247 registers at 128 rows of x and 230 at 64 (two
    CTAs an SM), without it 128 at 32 and fewer (four). Split-K fills whole waves of those CTAs. The 8-bit view takes
    the same config (its step decodes the same tile)."""
    bt = min(128, max(16, _pow2(M)))
    bn, warps, stages = 64, 4, 3
    kf = K // 64
    groups = 2 if bt <= 64 and kf >= 2 and kf % 2 == 0 else 1
    ctas_per_sm = 2 if bt >= 64 else 4
    tiles = -(-N // bn) * -(-M // bt)
    split = pick_split_k(tiles, max(1, kf // groups), sm_count(device) * ctas_per_sm)
    return BatchConfig(block_n=bn, block_t=bt, groups=groups, split_k=split, num_warps=warps, num_stages=stages,
                       kt=bt >= 64)


def _check_common(c) -> None:
    if c.block_k < 64 or c.block_k % 64:
        raise ValueError(f"block_k must be a multiple of 64 (the lo-plane group), got {c.block_k}")
    for f in ("block_n", "block_t", "block_k"):
        v = getattr(c, f)
        if v < 1 or v & (v - 1):
            raise ValueError(f"{f} must be a power of two, got {v}")
    if c.split_k < 1 or c.num_warps < 1 or c.num_stages < 1:
        raise ValueError(f"split_k, num_warps and num_stages must be >= 1, got {c}")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device`; 4 under the interpreter / on CPU (keeps test grids small but split)."""
    if device.type != "cuda" or autotune.is_interpreter():
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _pow2(m: int) -> int:
    return 1 << (max(1, int(m)) - 1).bit_length()


def pick_split_k(tiles: int, n_iters: int, slots: int, overhead_iters: float = 2.0) -> int:
    """Split-K minimising a wave model of the run time: waves x (K iterations per split + a fixed
    per-CTA cost of `overhead_iters` for prologue, epilogue and the reduce), where a wave is
    `slots` co-resident CTAs. Each split keeps >= _MIN_ITERS_PER_SPLIT iterations; ties within
    3% go to the smaller split (less partial-sum traffic)."""
    s_max = max(1, min(64, n_iters // _MIN_ITERS_PER_SPLIT))

    def cost(s: int) -> float:
        per = math.ceil(n_iters / s)
        s_real = math.ceil(n_iters / per)  # splits that actually get work
        return math.ceil(tiles * s_real / slots) * (per + overhead_iters)

    costs = {s: cost(s) for s in range(1, s_max + 1)}
    best = min(costs.values())
    return min(s for s, c in costs.items() if c <= 1.03 * best)


def tc_heuristic(M: int, N: int, K: int, device: torch.device, *, q8: bool = False, mma_only: bool = False) -> TcConfig:
    """Tensor-core default. BT covers M (16..64). A small W tile (BN=64 x BK=128, 4 warps): the
    decoded tile lives in registers before the MMA, so [64, 64] int32 halves per 128 threads keep
    ~32 live values per thread (the first H200 run's 128x128 / 8-warp tiles read at ~1.6 TB/s).
    Bytes in flight come from stages and from several CTAs per SM; split-K fills whole waves."""
    bpw = 1.0 if q8 else 1.5
    bt = min(64, max(16, _pow2(M)))
    sms = sm_count(device)
    bn, bk, warps = 64, 128, 4
    kp = -(-K // 64) * 64
    stage = bn * bk * bpw + bk * bt * 2
    stages = 4
    ctas_per_sm = max(1, min(_SMEM_PER_SM // int(stages * stage), 4))
    tiles = -(-N // bn) * -(-M // bt)
    split = pick_split_k(tiles, -(-kp // bk), sms * ctas_per_sm)
    # asm: on the H200 the packed PTX decode won 1.10x (geomean) on this tile at every M (ignored off-GPU)
    return TcConfig(block_n=bn, block_t=bt, block_k=bk, split_k=split, num_warps=warps, num_stages=stages, asm=True)


_GEMV_LIVE = 16  # fp32 accumulator elements per thread (BN x BK/2 x BT / threads)


def mma_heuristic(M: int, N: int, K: int, device: torch.device) -> MmaConfig:
    """CUDA kernel default (the H200 sweep of the CUDA configs, 20261130T225618-explore.log in git history):
    32 rows per CTA and 4 warps along K when that still gives >= 3 CTAs per SM, else 16 rows and 8 warps
    along K (more warps, hence more loads in flight, for the N = 5120 projections)."""
    if -(-N // 32) >= 3 * sm_count(device):
        return MmaConfig(mt=2, wk=4, pipe=2)
    return MmaConfig(mt=1, wk=8, pipe=2)


def gemv_heuristic(M: int, N: int, K: int, device: torch.device, *, q8: bool = False) -> GemvConfig:
    """CUDA-core default: per thread <= _GEMV_LIVE accumulators and <= 32 bytes of hi per iteration
    (no spills), 4 warps, many CTAs per SM (~8) to keep bytes in flight; split-K fills waves."""
    bt = min(16, _pow2(M))
    kp = -(-K // 64) * 64
    if M == 1:
        # H200 sweep: 8x256 tiles with the packed PTX decode and a 2-D accumulator won every M=1
        # cell of the explore set (G8x256w4s2AD, mm and q8); untuned shapes get the same shape.
        tiles = -(-N // 8)
        split = pick_split_k(tiles, -(-kp // 256), sm_count(device) * 8)
        return GemvConfig(block_n=8, block_t=1, block_k=256, split_k=split, num_warps=4, num_stages=2,
                          asm=True, tok2d=True)
    bk = 256 if bt <= 2 else 128
    threads = 128
    bn = max(4, min(64, _GEMV_LIVE * threads // (bk // 2 * bt)))
    tiles = -(-N // bn) * -(-M // bt)
    split = pick_split_k(tiles, -(-kp // bk), sm_count(device) * 8)
    return GemvConfig(block_n=bn, block_t=bt, block_k=bk, split_k=split, num_warps=4, num_stages=2)


# CTAs of the 4-warp mma.sync build resident per SM at M <= 8 on sm_90: its 84-90 registers a thread leave room for
# 5 of them in 64K registers (flow_heuristic's one-wave rule)
FLOW_ONE_WAVE_CTAS = 5


def flow_heuristic(M: int, N: int, K: int, device: torch.device, *, warps: int | None = None, stages: int | None = None,
                   cps: int | None = None, clusters: bool | None = None, wgmma: bool | None = None,
                   q8: bool = False) -> FlowConfig:
    """FlowConfig default: the CTA shape and K split `kw` that minimise a wave model, waves x (64-column units per
    warp + one unit for the shared-memory reduction when kw > 1). The shapes: for M <= 8, CTAs of 4 warps at 4 per
    SM or of 8 warps at 2 per SM (ties go to the 4-warp ones); above, 8 warps at 2 per SM; `warps` and `cps` fix
    one. Ties in `kw` go to the smaller split. On the H200 (docs/w12-kernels.md, "The flow kernel") the 4-warp CTAs
    were 7-9% faster than 8-warp ones on the 5120-row layers at M = 1..8 and within 2% on the large ones, except
    gate_up at M = 8 (1.13 against 1.27x cuBLAS), where this model gives the 8-warp CTAs fewer waves; at M = 32 the
    8-warp ones were faster.

    Where there are fewer than 3 row blocks per SM (the 5120-row layers: 320 row blocks on 132 SMs, so some SMs
    stream 3 row blocks and others 2) and thread-block clusters exist (`clusters`; default: a CUDA device of
    sm_90 or later), the K split goes across the 2 CTAs of a cluster as well (`kc = 2`), in CTAs of one row block:
    4 warps splitting K at 4 per SM for M <= 8, 2 warps at 4 per SM above (at 9..16 tokens the full format takes CTAs
    of two row blocks, 4 warps, with 3 ring slots: the ring-depth paragraph below). On the H200 that took down_proj from
    42.6 to 37.9 µs at M = 1 and from 77.9 to 65.5 µs at M = 32, o_proj from 18.4 to 17.1 µs at M = 8 and from
    31.4 to 25.4 µs at M = 32 (docs/w12-kernels.md, "K split across CTAs"); on in_proj and gate_up (8 and 16 row
    blocks per SM) it was slower, except gate_up at M = 32 in 4-warp CTAs of two row blocks (121.4 to 111.0 µs),
    which this rule does not take. At M = 9..16 the full format splits K across 3 CTAs (`kc = 3`, given at least
    6 units of K): o_proj 21.3 -> 20.7 µs and down_proj 53.4 -> 49.9 µs at M = 16 on the H200, timed against the 2-CTA
    split in one run (perf/results/h200/20261203T0035-w12-flow-configs-ab.json); the 8-bit view keeps 2 (unmeasured).

    Where wgmma exists (`wgmma`; default: a CUDA device of sm_90) the warpgroup build (`wg`: x staged once per 64
    rows) takes M > 16, in the shape that measured fastest for its count of row groups per SM r (docs/w12-kernels.md,
    "The warpgroup build"): r >= 3, 4-warp CTAs at 4 per SM with the K split across a 2-CTA cluster (gate_up at
    M = 32: 120.6 -> 91.1 µs), with 6 ring slots where r < 8; 1 <= r < 3, 16-warp CTAs of two row groups and two
    K pieces (in_proj at M = 32: 48.7 -> 39.7 µs); r < 1 (the 5120-row layers), 8-warp CTAs of one row group and two K pieces at 2 per SM with
    the K split across 3 CTAs through global memory (`kg`: 240 CTAs that the hardware places freely; down_proj at
    M = 32: 57.9 -> 50.9 µs against 16-warp CTAs of one row group and four K pieces, o_proj 24.4 -> 23.4; the same
    split in a cluster of 3 took 69.2 and 28.6 µs). At M <= 16 the mma.sync build measured faster on every layer
    (at M = 16 gate_up took 0.90-0.92x the warpgroup build's time in its 8-warp shapes, the LM head 0.96x), and
    above 16 tokens on the 5120-row layers of 6 to 128 units of K (o_proj, out_proj: 0.950-0.964x), which take the
    mma.sync build's 3-CTA clusters of two row blocks a CTA with x one unit ahead.

    Ring depth (`stages`, unless given): 3 for the 4-warp CTAs at M <= 8, 4 otherwise. On the H200 the shallower
    ring was faster there for both formats (out_proj at M = 1 15.1 µs against 16.1, the 8-bit view 11.4 against
    11.8; in_proj, qkv_proj, down_proj 1-3%; the LM head level) and slower in gate_up's 8-warp CTAs (70.5 against
    68.5 µs); docs/w12-kernels.md, "Ring depth at M <= 8". At 9..32 tokens (docs/w12-kernels.md, "Ring depth at 9-32
    tokens"): the full format's 5120-row layers take 3 slots in CTAs of two row blocks at M = 9..16, the layers of
    12 or more row blocks per SM (gate_up, the LM head) 4-warp CTAs of 4 row blocks, each warp one row block over the
    whole K, with 3 slots, and the warpgroup build 3 slots below 3 row groups per SM (in_proj 0.982-0.985x, qkv_proj
    0.989-0.990x, down_proj 0.975-0.982x at M = 32); gate_up keeps 6 and the LM head 4 (3: level).

    One wave of whole rows at M <= 8 (full format): where 4-warp CTAs of 4 row blocks, each warp one row block over
    the whole K (`kw = 1`), number between 4 and FLOW_ONE_WAVE_CTAS per SM, they run as one wave of 16-20 warps per SM
    with no reduction, and the layer streams with one ramp and one tail instead of one per CTA of a multi-wave grid
    (gate_up: 544 CTAs on 132 SMs, against 2176 8-warp CTAs in 8 waves). In the engine's W12 AR step on the H200
    (hybrid-27b, 64 gate_up launches) that took the step from 11.91-11.92 to 11.72 ms, interleaved in one device
    call; in a chain of the four linears of a decoder layer alone gate_up took 73.7 against 74.5 µs (docs/w12-kernels.md,
    "Where a launch's time goes").

    `q8`: the 8-bit view's build, which takes the mma.sync shapes only and, for M <= 8, one CTA shape by row blocks
    per SM: 8 warps at 2 per SM from 4 to 12 of them (in_proj, qkv_proj: 0.91-0.95x the 4-warp CTAs' time at
    M = 1..8 on the H200; the full format level there, 0.985-1.013x), 4 warps at 4 per SM elsewhere (gate_up at M = 8
    51.1 µs against 58.1 in 8-warp CTAs; docs/w12-kernels.md, "The 8-bit view")."""
    if q8:
        wgmma = False
    if wgmma is None:
        wgmma = device.type == "cuda" and not autotune.is_interpreter() and \
            torch.cuda.get_device_capability(device) == (9, 0)
    if clusters is None:
        clusters = device.type == "cuda" and not autotune.is_interpreter() and \
            torch.cuda.get_device_capability(device)[0] >= 9
    deep = 4 if stages is None else stages
    shallow = 3 if stages is None else stages  # the 3-slot rings (module doc, "Ring depth")
    if wgmma and warps is None and cps is None and M > 16 and K > 64:
        groups = -(-N // 64) / sm_count(device)
        if groups >= 3:
            # a 6-slot ring below 8 row groups per SM (gate_up: 0.970-0.983x the 4-slot ring's time in three
            # interleaved pairs on the H200); the LM head's 29 took 1.11x longer with it
            return FlowConfig(warps=4, kw=1, stages=(6 if groups < 8 else 4) if stages is None else stages, cps=4,
                              kc=2, wg=True)
        # 3 ring slots below 3 row groups per SM (docs/w12-kernels.md, "Ring depth at 9-32 tokens")
        if groups < 1 and 320 < K <= 8192 and clusters:
            # at most 128 units of K (o_proj, out_proj): the mma.sync build's 3-CTA cluster of two row blocks a CTA,
            # x one unit ahead, 3 ring slots (0.950-0.964x the warpgroup build's time below in five interleaved pairs
            # on the H200; down_proj, 272 units, level: 0.998-1.003x; "Ring depth at 9-32 tokens")
            return FlowConfig(warps=4, kw=2, stages=shallow, cps=4, kc=3, xd=1)
        if groups < 1:
            # the K split in 3 through global memory, 2 row groups of 64 rows in flight per SM (docs/w12-kernels.md,
            # "K split through memory"): down_proj at M = 32 57.9 -> 50.9 µs, o_proj 24.4 -> 23.4 against
            # 16-warp CTAs of one row group and four K pieces
            return FlowConfig(warps=8, kw=2, stages=shallow, cps=2, kc=3, kg=True, wg=True)
        return FlowConfig(warps=16, kw=2, stages=shallow, cps=1, wg=True)
    blocks, units = -(-N // 16), -(-K // 64)
    sms = sm_count(device)
    per_sm = blocks / sms
    if warps is not None or cps is not None:
        shapes = [(warps or (4 if M <= 8 else 8), cps or (4 if M <= 8 else 2))]
    elif M > 8:
        shapes = [(8, 2)]
    elif q8:
        shapes = [(8, 2)] if 4 <= per_sm < 12 else [(4, 4)]
    else:
        shapes = [(4, 4), (8, 2)]

    def cost(w: int, c: int, kw: int) -> int:
        ctas = -(-blocks // (w // kw))
        return -(-ctas // (sms * c)) * (-(-units // kw) + (kw > 1))

    cands = [(cost(w, c, kw), i, kw, w, c) for i, (w, c) in enumerate(shapes) for kw in (1, 2, 4, 8, 16) if kw <= w]
    _, _, kw, w, c = min(cands)
    # x sets loaded ahead (docs/w12-kernels.md, "x loaded ahead"): two units ahead at M <= 8 where a layer has fewer
    # than 12 row blocks per SM (the 8-bit view) or 4 to 12 (the full format: in_proj, qkv_proj), one ahead at
    # M = 9..16 (but in the full format's one-row-block-a-warp CTAs below); none elsewhere (gate_up, the LM head, the
    # 5120-row layers' full format at M <= 8: within 2-3%, or slower; M > 16: unmeasured)
    xd = (2 if per_sm < 12 and (q8 or per_sm >= 4) else 0) if M <= 8 else (1 if M <= 16 else 0)
    if clusters and warps is None and cps is None and blocks < 3 * sms and units >= 2:
        if M <= 8:
            # x at each row's first escape column copied before the main loop (the full format): o_proj 0.964-0.976x,
            # down_proj 0.986-0.988x the time at M = 1 and 8 on the H200 (docs/w12-kernels.md, "Where the time goes
            # at M = 32"); 1.01-1.03x slower above 16 tokens, where the loop, not the epilogue, holds the time
            return FlowConfig(warps=4, kw=4, stages=shallow, cps=4, kc=2, xd=xd, escx=not q8)
        kc = 3 if M <= 16 and units >= 6 and not q8 else 2
        # the first copies before the prologue's waits at 9..16 tokens: o_proj 18.7 -> 18.2 µs, out_proj 18.8 ->
        # 18.3, down_proj 43.2 -> 42.0 at M = 16 on the H200 (docs/w12-kernels.md, "K split through memory"); there
        # the full format takes CTAs of two row blocks and 3 ring slots (o_proj 0.966-0.974x, down_proj 0.970-0.972x
        # the time of one row block and 4 slots; "Ring depth at 9-32 tokens")
        if M <= 16 and kc == 3:
            return FlowConfig(warps=4, kw=2, stages=shallow, cps=4, kc=3, xd=xd, late=True)
        return FlowConfig(warps=2, kw=2, stages=deep, cps=4, kc=kc, xd=xd, late=M <= 16)
    if 8 < M <= 16 and not q8 and warps is None and cps is None and per_sm >= 12:
        # 4-warp CTAs of 4 row blocks, each warp one row block over the whole K, 3 ring slots, x loaded one unit at a
        # time (gate_up at M = 16: 70.1-70.9 µs against 73.7-74.4 for one row block a CTA and K in 4 pieces, x one
        # unit ahead, in three runs of interleaved pairs on the H200, 69.6 against 73.8 at M = 12; the LM head at
        # M = 12-16 0.979-0.985x the wave model's 8-warp CTAs; in_proj and qkv_proj, under 12 row blocks per SM,
        # 1.35-1.48x slower so; docs/w12-kernels.md, "Ring depth at 9-32 tokens")
        return FlowConfig(warps=4, kw=1, stages=shallow, cps=4)
    if M <= 8 and not q8 and warps is None and cps is None and \
            4 * sms <= -(-blocks // 4) <= FLOW_ONE_WAVE_CTAS * sms:
        # one row block per warp over the whole K, in one wave of 4-warp CTAs (module doc above)
        return FlowConfig(warps=4, kw=1, stages=shallow, cps=4, xd=xd)
    return FlowConfig(warps=w, kw=kw, stages=(3 if M <= 8 and w == 4 else 4) if stages is None else stages, cps=c,
                      xd=xd)


def flow_config(M: int, N: int, K: int, device: torch.device, *, q8: bool = False) -> FlowConfig:
    """The flow kernel's config for a call: the tuned entry `w12.matmul/flow/<key>` of this GPU where one exists
    (`specpilot tune --op w12.matmul` explores `w12.space.FLOW_SPACE`), else `flow_heuristic`. `q8`: for the 8-bit
    view, whose heuristic keeps the mma.sync build at every M: its warpgroup build measured slower on the H200 at
    M = 16-32 (o_proj at M = 32 0.55x cuBLAS against 0.64x; docs/w12-kernels.md, "The warpgroup build"). The view
    takes the full format's tuned entries (the tuner promotes on the full format): on the H100 gate_up at M = 32 took
    80.0 us in the view with its entry (`w4-k1-s3-c5-xs`) and 112.7 us at the view's heuristic, in two benchmark runs
    whose other cells agreed within 1% (docs/w12-kernels.md, "The 8-bit view")."""
    return autotune.get_config("w12.matmul", "flow", FlowConfig,
                               lambda: flow_heuristic(M, N, K, device, q8=q8),
                               key=autotune.shape_key(M=M, N=N, K=K), device=device)
