"""Launch configs of the gdn kernels: frozen dataclasses, analytical heuristics by default,
tuned entries (autotune/configs/<gpu>.json, keys `gdn.<op>/<variant>/<bucket>`) when present."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import triton

from autotune import bucket_m, get_config, shape_key
from autotune.hardware import has_wgmma

__all__ = ["WYConfig", "CudaConfig", "RecurrentConfig", "OneConfig", "one_config", "cuda_config", "ConvConfig",
           "CommitConfig", "wy_config", "recurrent_config", "conv_config", "commit_config", "wy_constexprs", "WY_WGMMA",
           "wy_heuristic", "cuda_heuristic"]


@dataclass(frozen=True)
class WYConfig:
    BV: int = 32
    num_warps: int = 4
    num_stages: int = 1
    # fp32-operand products when q/k are not bf16: "ieee" (fp32 FMA), "tf32x3" (~2-4x fp32's
    # rounding: over the derived 2x bound at hybrid-27b dims on H200), "tf32"
    dot_precision: str = "ieee"
    small_precision: str = "ieee"  # [BT,BT] inverse, T.rhs and (q.k).U products: tiny, fp32 FMA
    split: bool = True  # bf16 q/k: exact bf16 tensor-core products, fp32 state split in 3 bf16
    # "square": floor(log2(depth)) rounds, unrolled (5 guarded copies); "loop": the same rounds as a
    # runtime loop (one copy); "levels": one product per depth level; "fold": (q.k^T d).T built directly,
    # its rounds stacked over the powers' (r + 2 products instead of 2r + 2; gdn/kernels/wy.py); "split":
    # fold's N built by a first launch, the state products overlapping it (PDL on sm_90)
    inverse: str = "square"
    # inverse="split": warps of the first launch (gdn_tree_split_kernel, one program per request and
    # value head, the inverse alone)
    inverse_warps: int = 4
    inverse_stack: bool = False  # the first launch's q.k^T and k.k^T as one [2BT, K] x [K, BT] product
    inverse_loop: bool = False  # the first launch's fold rounds as a runtime loop (one copy of the code)
    # inverse="split": how N reaches the state programs. "grid": two launches, the second waiting on the
    # first grid (PDL); "flag": one launch, the B * HV inverse programs first, each raising a flag in
    # TreePlan.sync that its head's state programs poll (no grid boundary). "flag" runs only where the
    # whole grid fits on the GPU at once (else the launcher uses "grid") and takes num_warps/maxnreg
    # for both roles (inverse_warps and inverse_maxnreg are the "grid" first launch's). Opt-in: slower on
    # H200 (docs/gdn.md), and with other kernels sharing the GPU its progress rests on in-order dispatch
    handoff: str = "grid"
    # register caps (ptxas .maxnreg; None: the compiler's choice). With "split" the two launches' programs
    # must fit one SM together for the state phase to overlap the inverse: 8 warps x 168 + 4 x 168 <= 64K
    maxnreg: int | None = None
    inverse_maxnreg: int | None = None
    min_bt: int = 16  # node tile floor; 64 makes the tensor-core dots M=64 (wgmma on sm_90)
    # transposed orientation: the big products are [BV, K] x [K, BT], M = BV (64: wgmma on sm_90
    # at any node count, no 64-row padding)
    trans: bool = False
    # untransposed bf16 path: q rows stacked over k rows, one set of [2BT, K] x [K, BV] state
    # products (M = 64 at 32 nodes) and one [2BT, K] x [K, BT] for q.k^T / k.k^T
    stack: bool = False
    # precision of the inverse's rounds alone (None: small_precision); "tf32x3" puts them on tensor cores
    inverse_precision: str | None = None
    # programmatic dependent launch (sm_90): the kernel waits on the previous grid before its first
    # load and lets the next kernel's programs be placed early; hides launch gaps in a graph
    pdl: bool = False
    # diagnostic only, WRONG outputs: bit mask of phases removed for timing (see gdn/kernels/wy.py)
    skip: int = 0


@dataclass(frozen=True)
class CudaConfig:
    """The CUDA C++ kernel (gdn/csrc/gdn_tree.cu): one CTA per (V block, value head, request), BV / 8 mma
    warps (one 8-column tile of the state each) beside one warp that solves for N by substitution."""

    BV: int = 64  # state columns per CTA (8 to 64, a multiple of 8)
    pieces: int = 3  # bf16 pieces of the fp32 state in the state products (3: exact, 2: 16 mantissa bits)
    pdl: bool = True  # sm_90: programmatic dependent launch, state rows prefetched into L2 before the wait
    min_blocks: int = 2  # __launch_bounds__ CTAs per SM (caps registers)
    skip: int = 0  # diagnostic only, WRONG outputs: bit mask of phases removed for timing (GDN_SKIP in the source)
    # half the mma warps do the norms, gram and M/A build while the other half do the state products (two 8-column
    # tiles each), so the products overlap the inverse's chain instead of following it; needs BV >= 16
    split_warps: bool = False
    unroll_out: int = 4  # unroll of the N.rhs loop over nodes (each CTA runs its code once: code size costs fetches)
    unroll_ks: int = 8  # unroll of the state products' k-steps (K / 16 of them)
    trace: bool = False  # diagnostic: phase stamps per CTA into gdn.cuda.TRACE

    def __post_init__(self):
        if self.BV % 8 or not 8 <= self.BV <= 64:
            raise ValueError(f"CudaConfig.BV must be a multiple of 8 between 8 and 64, got {self.BV!r}")
        if self.pieces not in (2, 3):
            raise ValueError(f"CudaConfig.pieces must be 2 or 3, got {self.pieces!r}")
        if self.unroll_out not in (1, 2, 4, 8, 16, 32) or self.unroll_ks not in (1, 2, 4, 8, 16):
            raise ValueError(f"CudaConfig.unroll_out (1-32) and unroll_ks (1-16) must be powers of two, got "
                             f"{self.unroll_out!r}, {self.unroll_ks!r}")
        if self.split_warps and self.BV < 16:
            raise ValueError(f"CudaConfig.split_warps needs BV >= 16 (two groups of mma warps), got BV={self.BV}")
        if self.min_blocks not in (1, 2, 3, 4):
            raise ValueError(f"CudaConfig.min_blocks must be 1 to 4, got {self.min_blocks!r}")

    def tag(self) -> str:
        return f"bv{self.BV}-p{self.pieces}-m{self.min_blocks}-u{self.unroll_out}k{self.unroll_ks}" + (
            "-sw" if self.split_warps else "") + (f"-skip{self.skip}" if self.skip else "") + (
            "-trace" if self.trace else "")


@dataclass(frozen=True)
class RecurrentConfig:
    BV: int = 32
    num_warps: int = 4


@dataclass(frozen=True)
class OneConfig:
    """The one-node kernel (gdn/kernels/one.py), which `tree_verify` runs for plans of one node a request: one
    program per (V block of BV columns, value head, request)."""

    # H100, the engine's W12 AR step (hybrid-27b, 48 layers): BV = 16 with 1 or 2 warps and BV = 32 with 4 within
    # 0.04 ms of each other, every one 0.24-0.27 ms below the CUDA tree kernel's step (docs/gdn.md)
    BV: int = 16
    num_warps: int = 1
    # programmatic dependent launch (sm_90): the step's inputs are read after griddepcontrol.wait
    pdl: bool = True
    # the state block is loaded before that wait (while the kernel before still runs; the kernel's contract)
    early: bool = True


@dataclass(frozen=True)
class ConvConfig:
    BD: int = 256
    num_warps: int = 4
    # programmatic dependent launch (sm_90): each program waits on the previous grid before its first load, then
    # lets the next grid (the tree kernel, which prefetches its state rows before its own wait) be placed
    pdl: bool = True


@dataclass(frozen=True)
class CommitConfig:
    BV: int = 32
    BD: int = 256
    num_warps: int = 4


_INVERSE = {"levels": 0, "square": 1, "loop": 2, "fold": 3, "split": 4}  # WYConfig.inverse -> the kernel's INV


@functools.cache
def wy_constexprs(cfg: WYConfig) -> types.MappingProxyType:
    """The WY kernel's compile-time arguments that come from the config alone (the launcher adds the
    shape ones, SPLIT from the input dtype and PDL from the device)."""
    inv = _INVERSE.get(cfg.inverse)
    if inv is None:
        raise ValueError(f"WYConfig.inverse must be one of {sorted(_INVERSE)}, got {cfg.inverse!r}")
    if cfg.inverse != "split" and (cfg.inverse_stack or cfg.inverse_loop or cfg.inverse_maxnreg is not None
                                   or cfg.inverse_warps != 4):
        raise ValueError(f"WYConfig.inverse_stack, inverse_loop, inverse_warps and inverse_maxnreg configure the first "
                         f"launch of inverse='split' and do nothing with inverse={cfg.inverse!r}: leave them at their "
                         f"defaults")
    if cfg.handoff not in ("grid", "flag"):
        raise ValueError(f"WYConfig.handoff must be 'grid' or 'flag', got {cfg.handoff!r}")
    if cfg.handoff == "flag" and cfg.inverse != "split":
        raise ValueError(f"WYConfig.handoff='flag' hands the inverse of inverse='split' over inside one launch; "
                         f"with inverse={cfg.inverse!r} there is nothing to hand over: leave handoff='grid'")
    for name in ("num_warps", "inverse_warps"):
        w = getattr(cfg, name)
        if w not in (1, 2, 4, 8, 16):
            raise ValueError(f"WYConfig.{name} must be 1, 2, 4, 8 or 16, got {w!r}")
    for name in ("maxnreg", "inverse_maxnreg"):
        r = getattr(cfg, name)
        if r is not None and not 24 <= r <= 255:
            raise ValueError(f"WYConfig.{name} is a per-thread register cap between 24 and 255 (or None), got {r!r}")
    return types.MappingProxyType(dict(BV=cfg.BV, PREC=cfg.dot_precision, PREC_S=cfg.small_precision,
                PREC_I=cfg.inverse_precision or cfg.small_precision, INV=inv, TRANS=cfg.trans, STACK=cfg.stack,
                SKIP=cfg.skip))  # cached per config: read-only


def _bv(V: int) -> int:
    return max(16, min(32, triton.next_power_of_2(V)))


# The transposed orientation, M = BV = 64: the config whose big products are wgmma on sm_90.
# Not a default: slower than mma.sync untransposed on H200 (B1-N32 933 vs 682 us).
WY_WGMMA = WYConfig(BV=64, num_warps=4, trans=True)


def _sm_count(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count  # cached by torch


def wy_heuristic(max_nodes: int, K: int, V: int, device=None, *, batch: int = 1, HV: int = 1) -> WYConfig:
    """The analytical default of `wy_config` (no tuned entry, nothing forced)."""
    # node tile from the plan's largest request (an 8-node tree padded to 64 rows did 64x the
    # [BT,BT] work); bf16 [BT, K] q/k tiles sit in registers next to the [K, BV] fp32 state.
    bt = max(16, triton.next_power_of_2(max_nodes))
    if has_wgmma(device) and V >= 64:
        # sm_90, H200 (48 layers): untransposed BV=64 was fastest everywhere. Less than
        # one wave of programs (B1: 96 on 132 SMs) is latency-bound: 8 warps (B1-N32 682 vs 709
        # us, chain8 375 vs 396); many programs (B24: 2304) are throughput-bound: 4 warps
        # (3301 vs 4948 us).
        # Under one wave, stacking q over k (one [2BT, K] set of state products, M = 64
        # at 32 nodes: wgmma, 0 spills) is faster still (B1-N32 586 vs 694 us, chain32 627 vs
        # 737); at B24 it is a tie (3006 vs 2999), so the many-program case keeps plain BV=64.
        # PDL on by default (the chained-graph GPU test passes). With vs
        # without: B1-N32 554 vs 581 us, chain8 325 vs 352, chain32 597 vs 622. "fold", fp64
        # small products and 16 warps were slower (gdn/kernels/wy.py, docs/gdn.md).
        # inverse="split" (fold's N from a first launch of one program per request and value
        # head; the second launch's state products overlap it). Same run on H200, vs the config above:
        # B1-N32 530 vs 555 us and chain32 588 vs 597 (BV=32, 4 warps, stack); chain8 285 vs 323 and
        # chain16 296 vs 342 (the same without stack, which is slower at 32 nodes: 665 and 751). Not
        # measured beyond 32 nodes, where the config above stays. After the inverse's guard
        # (gdn/kernels/wy.py, GROWTH_MAX) this config measured 594 us at B1-N32 and 672 at chain32;
        # BV=32, 4 warps, stack, inverse_stack, inverse_warps=8, inverse_maxnreg=128 measured 529 and
        # 580 in the same run.
        # The first launch's rounds as a runtime loop (inverse_loop: ~5K SASS instructions instead of
        # ~10-16K run once per program). One run (perf/results/h200/20261201-gdn-wy-inverse-loop.json), against the
        # previous default: 32 nodes with inverse_stack and 8 uncapped warps, B1-N32 524 vs
        # 600 us, chain32 582 vs 684 (the 128-register cap: 559 / 630); <= 16 nodes, no stack, 4 warps,
        # chain8 281 vs 332, chain16 314 vs 362. The one-launch form (handoff="flag") was slower.
        programs = batch * HV * triton.cdiv(V, 64)
        if programs <= _sm_count(device):
            if bt <= 16:
                return WYConfig(BV=32, num_warps=4, inverse="split", pdl=True, inverse_loop=True)
            if bt <= 32:
                return WYConfig(BV=32, num_warps=4, stack=True, inverse="split", pdl=True, inverse_stack=True,
                                inverse_warps=8, inverse_loop=True)
            return WYConfig(BV=64, num_warps=8, stack=True, pdl=True)
        return WYConfig(BV=64, num_warps=4, pdl=True)
    return WYConfig(BV=_bv(V), num_warps=8 if bt >= 64 else 4)


def wy_config(max_nodes: int, K: int, V: int, device=None, *, batch: int = 1, HV: int = 1) -> WYConfig:
    key = shape_key(B=bucket_m(batch), M=max_nodes, K=K, V=V)
    return get_config("gdn.tree_verify", "wy", WYConfig,
                      lambda: wy_heuristic(max_nodes, K, V, device, batch=batch, HV=HV), key=key, device=device)


def cuda_config(max_nodes: int, K: int, V: int, device=None, *, batch: int = 1, HV: int = 1) -> CudaConfig:
    # H200 (perf/results/h200/20261201-gdn-cuda-bv64.log, one run): BV=64 (8 mma warps + the solver)
    # beat BV=32 at B1-N32 (420 vs 441 us), chain32 (422 vs 441), chain8 (280 vs 289) and B24-N8 (2779 vs 4797);
    # BV=16 was slower everywhere, and so were 2 state pieces at B1 (431) and min_blocks=1 at B1 and B24
    key = shape_key(B=bucket_m(batch), M=max_nodes, K=K, V=V)
    return get_config("gdn.tree_verify", "cuda", CudaConfig, lambda: cuda_heuristic(V), key=key, device=device)


def cuda_heuristic(V: int) -> CudaConfig:
    """The default of `cuda_config`: the widest BV (<= 64) that divides V."""
    return CudaConfig(BV=64 if V % 64 == 0 else 32 if V % 32 == 0 else 16 if V % 16 == 0 else 8)


def recurrent_config(K: int, V: int, device=None) -> RecurrentConfig:
    return get_config("gdn.tree_verify", "recurrent", RecurrentConfig, lambda: RecurrentConfig(BV=_bv(V)),
                      key=shape_key(K=K, V=V), device=device)


def one_config(K: int, V: int, device=None) -> OneConfig:
    return get_config("gdn.tree_verify", "one", OneConfig, OneConfig,
                      key=shape_key(K=K, V=V), device=device)


def conv_config(D: int, device=None) -> ConvConfig:
    return get_config("gdn.tree_conv1d", "triton", ConvConfig,
                      lambda: ConvConfig(BD=min(256, triton.next_power_of_2(D))), key=shape_key(D=D), device=device)


def commit_config(K: int, V: int, D: int, device=None) -> CommitConfig:
    return get_config("gdn.commit", "triton", CommitConfig,
                      lambda: CommitConfig(BV=_bv(V), BD=min(256, triton.next_power_of_2(max(D, 1)))),
                      key=shape_key(K=K, V=V, D=D), device=device)
