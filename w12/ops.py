"""W12 GEMMs: `matmul` (exact weights) and `matmul_q8` (the 8-bit view), in three layers.

1. Launch-only: `_plan` makes the one decision of a call, an `autotune.Plan` (variant, kernel,
   config) cached per shape key, and `_launch` composes that plan's kernel launches into a
   preallocated `out`.
2. Torch registration: `torch.ops.specpilot_w12.matmul` via `torch.library.triton_op` +
   `wrap_triton`, so `torch.compile(fullgraph=True)` sees the Triton kernels, and
   `torch.ops.specpilot_w12.matmul_mma` (`custom_op` + `register_fake`) for the CUDA C++ kernel, and
   `torch.ops.specpilot_w12.matmul_tiled` for `matmul_tiled` (the runtime layout's paths) as one opaque op.
   Eager calls skip the dispatcher and launch directly (it costs ~10 us, a whole small kernel
   at M=1).
3. Public `matmul` / `matmul_q8`: check shapes, dtypes and devices and say how to fix a bad call.

Nothing here syncs the host or allocates by data, so every call is CUDA-graph capturable.
"""

from __future__ import annotations

import contextlib

import dataclasses
import os
from typing import Optional

import torch
import triton
from torch.library import triton_op, wrap_triton

import autotune

from . import cuda as wcuda
from .configs import (GEMV_MAX_M, BatchConfig, FlowConfig, GemvConfig, MmaConfig, TcConfig, TmaConfig, gemv_heuristic,
                      mma_heuristic, tc_heuristic)
from .flow import MAX_M as FLOW_MAX_M
from .format import W12Weight, unpack
from .layout import TiledW12, untile
from .kernels import w12_batch_kernel, w12_matmul_gemv_kernel, w12_matmul_tc_kernel, w12_splitk_reduce_kernel

__all__ = ["matmul", "matmul_q8", "matmul_tiled", "matmul_swiglu", "pair_rows", "unpair_cols", "swiglu_reference",
           "decode_tiled", "launch_batch", "VARIANTS", "OP", "OP_Q8"]

OP = "w12.matmul"
OP_Q8 = "w12.matmul_q8"
# "mma": the CUDA C++ kernels (w12/cuda.py, sm_80+, built with NVRTC) where they take the call (bf16 x, M <= 32),
# the generation's Triton variant (_TRITON) for the other calls. "tc" (wgmma, sm_90) and "gemv" are the
# Triton kernels; "torch" decodes the weight and calls F.linear (CPU tensors without the interpreter).
VARIANTS = autotune.Variants(OP, by_arch={9: "mma", 8: "mma"}, known=("mma", "tc", "gemv", "torch"), fallback="torch",
                             portable="gemv")
_TRITON = autotune.Variants(OP, by_arch={9: "tc", 8: "gemv"}, known=VARIANTS.known, fallback="torch", public=False)
TC_GEMV_MAX_M = 1  # the "tc" variant runs the CUDA-core GEMV up to this M, and above it where tuned (see _make_plan)
_REDUCE_BLOCK = 1024
_FORCED_KERNEL = ((GemvConfig, "gemv"), (TcConfig, "tc"), (MmaConfig, "mma"), (TmaConfig, "mma"), (FlowConfig, "mma"))
_PLANS = autotune.PlanCache()

# --------------------------------------------------------------------------------------
# 1. Launch-only
# --------------------------------------------------------------------------------------


def _plan(op: str, variant: str | None, x2d: torch.Tensor, hi: torch.Tensor) -> autotune.Plan:
    """The one decision of a call (M >= 1), cached per shape key: M bucketed to a power of two, N, K,
    x's dtype, the hi plane's contiguity, the device, and what `autotune.force` pins.

    Variant: the `variant=` keyword > `force(op, variant=)` > `force("w12.matmul", variant=)` (it pins
    matmul_q8 too) > `VARIANTS` by GPU. A forced config picks its kernel."""
    forced_variant, forced_cfg = autotune.forced(op)
    if variant is None and op == OP_Q8:
        variant = forced_variant
    M, K = x2d.shape
    key = (op, variant, forced_variant if op == OP else autotune.forced(OP)[0], forced_cfg, autotune.bucket_m(M), hi.shape[0], K, x2d.dtype,
           hi.is_contiguous(), x2d.device, autotune.is_interpreter())
    return _PLANS.get(key, lambda: _make_plan(op, variant, forced_cfg, x2d, hi))


def _make_plan(op: str, variant: str | None, forced_cfg, x2d: torch.Tensor, hi: torch.Tensor) -> autotune.Plan:
    device = x2d.device
    variant, by_name = VARIANTS.choose(variant, device, where=op)
    M, K = x2d.shape
    N = hi.shape[0]
    # the only capability questions of the call: can the CUDA C++ kernels run here, can they take x
    missing = wcuda.unavailable(device) if variant == "mma" or forced_cfg is not None else None
    if variant == "mma" and missing is not None:
        if by_name:
            raise RuntimeError(f"{op}: variant 'mma' {missing}; use variant='tc' or 'gemv'")
        variant = _TRITON.default(device)  # no CUDA C++ on this machine: the generation's Triton variant
    kernel = variant
    if variant == "mma" and forced_cfg is None and wcuda.unsupported(x2d, hi) is not None:
        kernel = _TRITON.default(device)  # fp16 x or M > 32: the generation's Triton kernel
    if forced_cfg is not None:
        kernel = next((k for cls, k in _FORCED_KERNEL if isinstance(forced_cfg, cls)), None)
        if isinstance(forced_cfg, BatchConfig):
            raise TypeError(f"{op}: the forced BatchConfig runs on the runtime layout only (a TiledW12, w12.pack's "
                            "default form); pass w12.layout.tile(packed), or force a TcConfig for the planes")
        if kernel is None:
            raise TypeError(f"{op}: force({op!r}, config=...) takes a FlowConfig, TmaConfig, MmaConfig, TcConfig or GemvConfig, "
                            f"got {type(forced_cfg).__name__}; pass one of those")
        if autotune.hardware.host_only(device):
            raise ValueError(f"{op}: the forced {type(forced_cfg).__name__} is a kernel config, and no kernel runs CPU "
                             "tensors without the Triton interpreter; start Python with TRITON_INTERPRET=1 set (before "
                             "torch or triton is imported), or drop the forced config (the torch path runs)")
        why = None if kernel != "mma" else (
            missing if missing is not None else wcuda.unsupported(x2d, hi))
        if why is None and isinstance(forced_cfg, FlowConfig) and op == OP_Q8 and forced_cfg.fixed:
            why = "the flow kernel's 8-bit view builds on the exact base only (FlowConfig(fixed=False))"
        if why is not None:
            raise ValueError(f"{op}: the CUDA kernel ({type(forced_cfg).__name__}) cannot take this call: {why}; "
                             "force a TcConfig or GemvConfig instead")
    if forced_cfg is not None or kernel == "torch":
        return autotune.Plan(variant, kernel, forced_cfg)
    # configs are looked up and built at the bucketed M, so a plan never depends on which M came first
    Mb = autotune.bucket_m(M)
    key = autotune.shape_key(M=M, N=N, K=K)
    tuned = autotune.load_tuned(device)
    q8 = op == OP_Q8

    def config(entry: str, cls, heuristic):
        return autotune.get_config(op, entry, cls, heuristic, key=key, device=device)

    def gemv(entry: str) -> autotune.Plan:
        return autotune.Plan(variant, "gemv", config(entry, GemvConfig, lambda: gemv_heuristic(Mb, N, K, device, q8=q8)))

    if kernel == "mma" and f"{op}/tma/{key}" in tuned and wcuda.tma_available(device):
        # a tuned tma entry: the sm_90 TMA kernel won this cell
        return autotune.Plan(variant, "mma", config("tma", TmaConfig, TmaConfig))
    if kernel == "mma":
        return autotune.Plan(variant, "mma", config("mma", MmaConfig, lambda: mma_heuristic(Mb, N, K, device)))
    if kernel == "tc" and Mb <= TC_GEMV_MAX_M:
        # H200: the CUDA-core GEMV beat every tensor-core tile at M=1 in all 10 cells (mm 0.84-1.14x cuBLAS
        # vs 0.58-0.76x); its tuned entries live under variant "gemv"
        return gemv("gemv")
    if kernel == "tc" and Mb <= GEMV_MAX_M and f"{op}/tc.gemv/{key}" in tuned:
        return gemv("tc.gemv")  # a tuned entry says the GEMV beat every tensor-core tile here (tok2d at M=2)
    if kernel == "tc":
        return autotune.Plan(variant, "tc", config("tc", TcConfig, lambda: tc_heuristic(Mb, N, K, device, q8=q8)))
    if Mb <= GEMV_MAX_M:
        return gemv("gemv")
    return autotune.Plan(variant, "tc", config("gemv.mma", TcConfig,
                                               lambda: tc_heuristic(Mb, N, K, device, q8=q8, mma_only=True)))


def _launch(plan: autotune.Plan, x2d, hi, lo, e0, rowptr, col, val, bias, out, *, q8: bool, wrap=None):
    """out[M, N] = x2d[M, K] @ W^T (+ bias) as `plan` says. `wrap` is `wrap_triton` when traced by torch.
    Returns the main Triton kernel's launch handle (eager: the compiled kernel, for n_regs / n_spills)."""
    if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
        with torch.cuda.device(x2d.device):
            return _launch(plan, x2d, hi, lo, e0, rowptr, col, val, bias, out, q8=q8, wrap=wrap)
    M, K = x2d.shape
    N, Kp = hi.shape
    cfg = plan.config
    if plan.kernel == "torch":
        out.copy_(_torch_fallback(x2d, hi, lo, e0, rowptr, col, val, bias, K=K, q8=q8))
        return None
    if plan.kernel == "mma":
        wcuda.launch(cfg, x2d, hi, lo, e0, rowptr, col, val, bias, out, q8=q8)
        return None
    if wrap is not None and autotune.is_interpreter() and _is_fake(x2d):
        return None  # wrap_triton passes interpreter kernels through untraced; fake tensors need no launch
    cfg = _whole_k_tiles(cfg, Kp)
    bt = cfg.block_t
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, bt), cfg.split_k)
    ws = out if cfg.split_k == 1 else torch.empty((cfg.split_k, M, N), device=out.device, dtype=torch.float32)
    has_bias = bias is not None
    b = bias if has_bias else out
    common = dict(HAS_BIAS=has_bias, Q8=q8, SELECT_ZERO=bool(cfg.select_zero),
                  ZERO_DENSE=bool(cfg.select_zero) and not q8, SPLIT_K=cfg.split_k, SPLIT=cfg.split_k > 1, BLOCK_N=cfg.block_n, BLOCK_T=bt,
                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2d, hi, lo, e0, rowptr, col, val, b, out, ws, M, N, K, Kp, Kp // 2, x2d.stride(0), x2d.stride(1))
    # the packed PTX decode needs a real GPU (the interpreter runs no inline asm)
    use_asm = bool(cfg.asm) and x2d.is_cuda and not autotune.is_interpreter()
    if plan.kernel == "tc":
        k = w12_matmul_tc_kernel if wrap is None else wrap(w12_matmul_tc_kernel)
        ck = k[grid](*args, X_F16=x2d.dtype == torch.float16, USE_ASM=use_asm, FUSE=bool(cfg.fuse), **common)
    else:
        k = w12_matmul_gemv_kernel if wrap is None else wrap(w12_matmul_gemv_kernel)
        ck = k[grid](*args, USE_ASM=use_asm, TOK2D=bool(cfg.tok2d), **common)
    if cfg.split_k > 1:
        r = w12_splitk_reduce_kernel if wrap is None else wrap(w12_splitk_reduce_kernel)
        r[(triton.cdiv(M * N, _REDUCE_BLOCK),)](ws, b, out, M, N, SPLIT_K=cfg.split_k, HAS_BIAS=has_bias,
                                                BLOCK=_REDUCE_BLOCK, num_warps=4)
    return ck


def _whole_k_tiles(cfg, Kp: int):
    """`cfg` with a `block_k` that divides Kp. The Triton kernels read whole BLOCK_K-column tiles of hi and lo
    without a mask (16-byte loads; only x is masked past K), so a partial last tile would read past every row, and
    past the end of the planes on the last row: an out-of-bounds read (its bytes meet x = 0, so the result does not
    change, but the read can fault). Kp is a multiple of 64, so 64 always divides it."""
    if Kp % cfg.block_k == 0:
        return cfg
    return dataclasses.replace(cfg, block_k=64)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _torch_fallback(x2d, hi, lo, e0, rowptr, col, val, bias, *, K: int, q8: bool) -> torch.Tensor:
    """No Triton backend (CPU without the interpreter): decode and F.linear in fp32."""
    from .reference import decode_q8

    packed = W12Weight(hi, lo, e0, rowptr, col, val, K)
    w = decode_q8(packed) if q8 else unpack(packed)
    out = torch.nn.functional.linear(x2d.float(), w.float(), None if bias is None else bias.float())
    return out.to(x2d.dtype)


def _empty_out(x2d: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.empty((x2d.shape[0], hi.shape[0]), device=x2d.device, dtype=x2d.dtype)


# --------------------------------------------------------------------------------------
# 2. Torch registration
# --------------------------------------------------------------------------------------


@triton_op("specpilot_w12::matmul", mutates_args=())
def _matmul_op(x2d: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor, esc_rowptr: torch.Tensor,
               esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor], q8: bool,
               variant: str) -> torch.Tensor:
    """[M, K] x W12 [N, Kp] -> [M, N] in x's dtype. `variant` "auto" is the automatic choice, planned here,
    at trace time under torch.compile (dynamo cannot read the `autotune.force` context variable)."""
    if x2d.shape[0] == 0:
        return _empty_out(x2d, hi)
    plan = _plan(OP_Q8 if q8 else OP, None if variant == "auto" else variant, x2d, hi)
    if plan.kernel == "mma":  # traced as the opaque CUDA op, not decomposed
        return torch.ops.specpilot_w12.matmul_mma(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, q8)
    if plan.kernel == "torch":  # opaque too: inductor would fuse its fp32 -> x.dtype cast away (see _matmul_torch_op)
        return torch.ops.specpilot_w12.matmul_torch(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, q8)
    out = _empty_out(x2d, hi)
    _launch(plan, x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, out, q8=q8, wrap=wrap_triton)
    return out


@torch.library.custom_op("specpilot_w12::matmul_mma", mutates_args=())
def _matmul_mma_op(x2d: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor, esc_rowptr: torch.Tensor,
                   esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor], q8: bool) -> torch.Tensor:
    """The CUDA C++ kernel as an opaque op for torch.compile (inductor cannot trace a driver-API launch)."""
    out = _empty_out(x2d, hi)
    _launch(_plan(OP_Q8 if q8 else OP, "mma", x2d, hi), x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, out, q8=q8)
    return out


def _fake_out(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, q8):
    """The shape of both opaque ops' output: [M, N] in x's dtype."""
    return x2d.new_empty((x2d.shape[0], hi.shape[0]))


_matmul_mma_op.register_fake(_fake_out)


@torch.library.custom_op("specpilot_w12::matmul_torch", mutates_args=())
def _matmul_torch_op(x2d: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor,
                     esc_rowptr: torch.Tensor, esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor],
                     q8: bool) -> torch.Tensor:
    """The decode + fp32 F.linear path as an opaque op. Traced inside the `triton_op`, inductor fuses its final
    cast to x's dtype with the consumer and skips that rounding, so a compiled model would differ from eager by
    an ulp; opaque, the rounding stays where eager has it."""
    return _torch_fallback(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, K=x2d.shape[1], q8=q8)


_matmul_torch_op.register_fake(_fake_out)


@torch.library.custom_op("specpilot_w12::matmul_tiled", mutates_args=())
def _matmul_tiled_op(x2d: torch.Tensor, tiles: torch.Tensor, e0: torch.Tensor, esc_rowptr: torch.Tensor,
                     esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor], n: int, q8: bool,
                     pdl: Optional[bool]) -> torch.Tensor:
    """`matmul_tiled` on the runtime layout's tensors as an opaque op for torch.compile (the flow kernel's driver-API
    launch cannot be traced). The layout object is rebuilt per call, so the flow kernel runs without programmatic
    dependent launch under torch.compile (a layout's first launch waits for the previous kernel)."""
    tiled = TiledW12(tiles, e0, esc_rowptr, esc_col, esc_val, n, x2d.shape[1])
    out = x2d.new_empty((x2d.shape[0], n))
    _matmul_tiled_eager(x2d, tiled, bias, q8=q8, out2d=out, pdl=pdl)
    return out


@_matmul_tiled_op.register_fake
def _(x2d, tiles, e0, esc_rowptr, esc_col, esc_val, bias, n, q8, pdl):
    return x2d.new_empty((x2d.shape[0], n))


# --------------------------------------------------------------------------------------
# 3. Public API
# --------------------------------------------------------------------------------------


def _check(x, packed, bias, variant, out, name: str) -> None:
    fn = f"w12.{name}"
    if not isinstance(packed, W12Weight):
        raise TypeError(f"{fn}: packed must be a W12Weight or a TiledW12, got {type(packed).__name__}; "
                        "build one with w12.pack(weight)")
    packed.validate(deep=False)
    _check_args(x, packed, bias, variant, out, fn)


def _tiled_call(x, tiled: TiledW12, bias, variant, out, name: str, q8: bool) -> torch.Tensor:
    """`matmul` / `matmul_q8` on a TiledW12: `matmul_tiled`'s paths, which take no variant."""
    if variant is not None:
        raise ValueError(f"w12.{name}: variant={variant!r} does not apply to a TiledW12 (the runtime layout runs the "
                         "flow kernel, or the weight decoded for the call, see w12.matmul_tiled); pass variant=None, "
                         "or the W12Weight (w12.layout.untile(tiled)) to choose a variant")
    return _matmul_tiled(x, tiled, bias, q8=q8, out=out, pdl=None, fn=f"w12.{name}")


def _check_args(x, packed, bias, variant, out, fn: str) -> None:
    """The checks of x, bias, variant and out against a weight with N, K and device (W12Weight or TiledW12)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}; pass the activations as a tensor")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: x must be bfloat16 or float16, got x.dtype={x.dtype}; convert with x.to(torch.bfloat16)")
    if x.dim() < 1 or x.shape[-1] != packed.K:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)} but the weight is [N={packed.N}, K={packed.K}]; "
                         f"the last dim of x must be K={packed.K} (F.linear semantics: out = x @ W.T)")
    if x.device != packed.device:
        raise ValueError(f"{fn}: x is on {x.device} but the weight is on {packed.device}; "
                         f"move one of them, e.g. packed = packed.to(x.device)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (packed.N,):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{fn}: bias must be a tensor of shape ({packed.N},), got {shape}; "
                             "pass the layer's bias vector or None")
        if not bias.is_floating_point():
            raise TypeError(f"{fn}: bias must be floating point, got {bias.dtype}; use bias.to(x.dtype)")
        if bias.device != x.device:
            raise ValueError(f"{fn}: bias is on {bias.device} but x is on {x.device}; use bias.to(x.device)")
    if variant is not None:
        VARIANTS.choose(variant, x.device, fn)  # an unknown variant, or one that cannot run here, raises at the call
    if out is not None:
        want = (*x.shape[:-1], packed.N)
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype
                or out.device != x.device or not out.is_contiguous()):
            got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" + ("" if out.is_contiguous() else ", strided")
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"{fn}: out must be a contiguous {x.dtype} tensor of shape {want} on {x.device}, "
                             f"got {got}; allocate it with torch.empty({want}, dtype=x.dtype, device=x.device)")


def _call(x, packed: W12Weight, bias, op: str, variant: str | None, out: torch.Tensor | None) -> torch.Tensor:
    N, K = packed.N, packed.K
    x2d = x.reshape(-1, K)  # a view when possible; the kernels take any strides
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    planes = (packed.hi, packed.lo, packed.e0, packed.esc_rowptr, packed.esc_col, packed.esc_val)
    if torch.compiler.is_compiling():
        y = torch.ops.specpilot_w12.matmul(x2d, *planes, bias, op == OP_Q8, variant or "auto")
        y = y.reshape(*x.shape[:-1], N)
        return y if out is None else out.copy_(y)
    out2d = _empty_out(x2d, packed.hi) if out is None else out.view(-1, N)
    if x2d.shape[0]:
        _launch(_plan(op, variant, x2d, packed.hi), x2d, *planes, bias, out2d, q8=op == OP_Q8)
    return out2d.reshape(*x.shape[:-1], N) if out is None else out


def matmul(x: torch.Tensor, packed: W12Weight | TiledW12, bias: Optional[torch.Tensor] = None, *,
           variant: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w12.unpack(packed), bias)` without unpacking: x [..., K] (bf16 or fp16) -> [..., N]
    in x's dtype, fp32 accumulation, one rounding at the end.

    The weight is read at 12 bits (1.5 bytes) per element and decoded in registers; escapes are
    added exactly from the CSR list in each tile's epilogue. Error against fp64 is that of a
    same-precision F.linear. Non-finite escaped weights (Inf, NaN) propagate as in F.linear.
    One known difference: where x itself is +-Inf/NaN and the weight column holds an escape,
    the result may be NaN where F.linear gives +-Inf.

    `variant` (None: by GPU, `w12.ops.VARIANTS`): "mma", the CUDA C++ kernels (mma.sync, decode in
    registers, built on first use) for bf16 x with M <= 32: the register-pipelined kernel (sm_80+), or on
    sm_90 the TMA kernel where a tuned entry chose it; other calls run the generation's Triton variant.
    "tc" (Triton, sm_90: wgmma, swap-AB; the CUDA-core GEMV at M = 1), "gemv" (Triton: CUDA cores for
    M <= 4, mma above), "torch" (decode + F.linear; the default for CPU tensors without the Triton
    interpreter, where a named Triton or CUDA variant raises). `autotune.force("w12.matmul", variant=...,
    config=MmaConfig(...))` pins one in a scope; `autotune.which_variant("w12.matmul", device)` says which
    variant a call runs.
    `out`: a preallocated contiguous [..., N] tensor of x's dtype, written and returned.

    `packed` may also be a `TiledW12` (the runtime layout: `w12.pack(weight, layout="runtime")`,
    `w12.layout.tile`): the call is then `w12.matmul_tiled(x, packed, bias, out=out)`, the flow kernel
    on a GPU for bf16 x up to 96 rows, otherwise the weight decoded for the call and F.linear (on CPU
    tensors the torch path above, bit for bit). `variant` must be None there (a ValueError otherwise).
    """
    if isinstance(packed, TiledW12):
        return _tiled_call(x, packed, bias, variant, out, "matmul", q8=False)
    _check(x, packed, bias, variant, out, "matmul")
    return _call(x, packed, bias, OP, variant, out)


def matmul_q8(x: torch.Tensor, packed: W12Weight | TiledW12, bias: Optional[torch.Tensor] = None, *,
              variant: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Like `matmul`, but reads only the `hi` plane (1 byte per weight) plus the escapes: the
    product with the 8-bit view `w12.decode_q8(packed)` (docs/w12-format.md).

    Error: every dense weight is replaced by the midpoint of its 16-value bin, a relative
    per-weight error of at most 2^-4 (6.25%, half a bin); weights whose hi byte is 0 (the
    row's smallest positive bin, mantissa < 16) read as 0. Escapes are exact. So the result
    differs from `matmul` by up to 2^-4 * sum_k |x_k w_k| per output, and matches the fp64
    product with `decode_q8` to within same-precision F.linear error. `variant` and `out` as for
    `matmul`; configs are looked up under op "w12.matmul_q8", and forcing a variant of "w12.matmul"
    also applies here. A `TiledW12` runs `w12.matmul_tiled(x, packed, bias, q8=True, out=out)`, with
    `variant=None` only, as for `matmul`.
    """
    if isinstance(packed, TiledW12):
        return _tiled_call(x, packed, bias, variant, out, "matmul_q8", q8=True)
    _check(x, packed, bias, variant, out, "matmul_q8")
    return _call(x, packed, bias, OP_Q8, variant, out)


def matmul_tiled(x: torch.Tensor, tiled: TiledW12, bias: Optional[torch.Tensor] = None, *, q8: bool = False,
                 out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """`w12.matmul` (`q8=True`: `w12.matmul_q8`) on the runtime layout alone: `tiled = w12.layout.tile(packed)`
    holds the weight in about 12.1 bits per element without the version-1 planes, so a model can keep only it.

    - bf16 x with 1..32 rows on a GPU where the CUDA kernels build: the flow kernel (docs/w12-kernels.md, "The flow
      kernel"), at `w12.configs.flow_config`'s config (a tuned entry, else the heuristic) or the `FlowConfig` that
      `autotune.force("w12.matmul", config=...)` (`"w12.matmul_q8"` for q8) pins; fp32 accumulation, one rounding.
    - Where this GPU's tuned file names the batch kernel for the call's shape key (`perf/w12_ladder.py --batch
      --promote` stores such entries), or a `BatchConfig` is forced (at any row count; under the interpreter too):
      the batch kernel (kernels/batch.py: one read of the weight for up to 256 rows of x), instead of the paths
      below.
    - bf16 x with 33..`CHUNK_MAX_M` (96) rows there: the flow kernel once per 32-row piece of x.
    - fp16 x with 1..`CHUNK_MAX_M` / 2 (48) rows there: x split into two bf16 halves that add up to it exactly
      (`split_fp16`), both multiplied in one launch per 16 rows of x by the flow kernel's fp32-output build, the
      halves' fp32 sums added, one rounding to fp16 (`fp16_by_bf16_pair`): the error of a same-precision F.linear.
    - Any other call (more rows, fp16 x above 48 rows, a GPU without the CUDA kernels): the weight decoded for the call
      (`untile` + `unpack`, or `decode_q8`) and `F.linear` in x's dtype (for fp16 x in fp32 over slices of
      `FP32_SLICE_ROWS` weight rows, with TF32 off whatever the caller set, then rounded once: a bf16 weight does
      not fit fp16), the error of a
      same-precision F.linear; on CPU tensors in fp32, then rounded to x's dtype (as `w12.matmul`'s torch path).

    Same results as `w12.matmul` on the planes up to the order of the fp32 sums; `out` as there.

    `pdl`: programmatic dependent launch of the flow kernel (`w12.flow.launch_tiled`). None: on sm_90 up to
    `w12.flow.PDL_MAX_M` rows (in a chain of flow kernels alone it slowed the 5120-row layers at 16 rows); True: at
    every row count, where the kernel after a PDL-launched glue kernel starts its weight stream early (the engine's
    32-row verify step: 17.33 -> 16.93 ms on the H200, docs/engine.md); False: never. Either way only on sm_90, and
    not on a layout's first launch or the first after an in-place write to it. The batch kernel takes `pdl` as
    `launch_batch` does (None: off unless SPECPILOT_PDL=1)."""
    name = "matmul_q8" if q8 else "matmul"
    fn = f"w12.matmul_tiled ({name})"
    if not isinstance(tiled, TiledW12):
        raise TypeError(f"{fn}: tiled must be a TiledW12, got {type(tiled).__name__}; build one with "
                        "w12.pack(weight) (its default form)" + ("; for a W12Weight call w12.matmul"
                                                               if isinstance(tiled, W12Weight) else ""))
    return _matmul_tiled(x, tiled, bias, q8=q8, out=out, pdl=pdl, fn=fn)


def _matmul_tiled(x, tiled: TiledW12, bias, *, q8: bool, out, pdl, fn: str) -> torch.Tensor:
    """`matmul_tiled` after its type check; `fn` names the public call in error messages."""
    _check_args(x, tiled, bias, None, out, fn)
    N, K = tiled.N, tiled.K
    x2d = x.reshape(-1, K)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if torch.compiler.is_compiling():
        y = torch.ops.specpilot_w12.matmul_tiled(x2d, tiled.tiles, tiled.e0, tiled.esc_rowptr, tiled.esc_col,
                                                 tiled.esc_val, bias, N, q8, pdl)
        y = y.reshape(*x.shape[:-1], N)
        return y if out is None else out.copy_(y)
    out2d = torch.empty((x2d.shape[0], N), device=x.device, dtype=x.dtype) if out is None else out.view(-1, N)
    _matmul_tiled_eager(x2d, tiled, bias, q8=q8, out2d=out2d, pdl=pdl)
    return out2d.reshape(*x.shape[:-1], N) if out is None else out


def _matmul_tiled_eager(x2d, tiled: TiledW12, bias, *, q8: bool, out2d: torch.Tensor, pdl) -> None:
    """`matmul_tiled`'s paths into `out2d` [M, N] (x2d [M, K], bias contiguous or None)."""
    N, K = tiled.N, tiled.K
    M = x2d.shape[0]
    if M:
        op = OP_Q8 if q8 else OP
        bcfg = _batch_config(x2d, tiled, op)
        cfg = None if bcfg is not None else _flow_first(x2d, tiled, op)
        if bcfg is not None:
            launch_batch(bcfg, x2d, tiled, bias, out2d, q8=q8, pdl=pdl)
        elif cfg is not None:
            _launch_flow_pieces(x2d, tiled, bias, out2d, cfg, op=op, pdl=pdl)
        elif M <= CHUNK_MAX_M // 2 and _flow_config(x2d[:FLOW_MAX_M // 2], tiled, op, torch.float16) is not None:
            from . import flow

            def product32(xb: torch.Tensor) -> torch.Tensor:
                o = torch.empty((xb.shape[0], N), device=xb.device, dtype=torch.float32)
                flow.launch_tiled(_flow_config(xb, tiled, op), xb, tiled, None, o, q8=q8, **_pdl_args(pdl))
                return o

            for i in range(0, M, FLOW_MAX_M // 2):
                fp16_by_bf16_pair(x2d[i:i + FLOW_MAX_M // 2], product32, bias, out2d[i:i + FLOW_MAX_M // 2],
                                  kernels=True)
        else:
            if x2d.device.type == "cuda" and x2d.dtype == torch.float16:
                # bf16 -> fp16 would lose the weight's range and low bits: fp32 products, one rounding to fp16, over
                # row slices of the weight so that its fp32 copy stays small
                w = decode_tiled(tiled, q8=q8)
                xf, bf = x2d.float(), None if bias is None else bias.float()
                with _ieee_fp32():
                    for n0 in range(0, N, FP32_SLICE_ROWS):
                        n1 = min(N, n0 + FP32_SLICE_ROWS)
                        out2d[:, n0:n1] = torch.nn.functional.linear(xf, w[n0:n1].float(),
                                                                     None if bf is None else bf[n0:n1])
            elif x2d.device.type == "cuda":
                w = decode_tiled(tiled, q8=q8).to(x2d.dtype)
                torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(x2d.dtype), out=out2d)
            else:
                packed = untile(tiled)
                planes = (packed.hi, packed.lo, packed.e0, packed.esc_rowptr, packed.esc_col, packed.esc_val)
                out2d.copy_(_torch_fallback(x2d, *planes, bias, K=K, q8=q8))


def pair_rows(w: torch.Tensor) -> torch.Tensor:
    """A gate-and-up weight [2F, K] (gate rows, then up rows) with its rows paired for `matmul_swiglu`: rows
    16 b + r and 16 b + 8 + r are gate row 8 b + r and up row 8 b + r, so that one lane of the flow kernel holds both
    sums of an output (F a multiple of 8). `unpair_cols` undoes it on a product's columns."""
    if w.dim() != 2 or w.shape[0] % 16:
        raise ValueError(f"w12.pair_rows: needs a [2F, K] gate-and-up weight with F a multiple of 8, got "
                         f"{tuple(w.shape)}")
    f = w.shape[0] // 2
    return torch.stack((w[:f].reshape(f // 8, 8, -1), w[f:].reshape(f // 8, 8, -1)), 1).reshape(2 * f, -1)


def unpair_cols(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) [..., F] from a product [..., 2F] with `pair_rows`' weight."""
    f = y.shape[-1] // 2
    y = y.reshape(*y.shape[:-1], f // 8, 2, 8)
    return y[..., 0, :].reshape(*y.shape[:-3], f), y[..., 1, :].reshape(*y.shape[:-3], f)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(s up) with s = bf16(g / (1 + e^-g)), g and up rounded to bf16 first, in fp32: what the W12F_SWIGLU
    build computes (its e^-g is CUDA's expf, within 2 ulp of exact, so the two may differ in the last bit)."""
    g, u = gate.to(torch.bfloat16).float(), up.to(torch.bfloat16).float()
    s = (g * (1.0 / (1.0 + torch.exp(-g)))).to(torch.bfloat16).float()
    return (s * u).to(torch.bfloat16)


def matmul_swiglu(x: torch.Tensor, tiled: TiledW12, *, q8: bool = False, out: torch.Tensor | None = None,
                  pdl: bool | None = None) -> torch.Tensor:
    """SwiGLU of x's product with a gate-and-up weight held with its rows paired (`tiled = w12.pack(
    w12.pair_rows(w))`): [..., F] = `swiglu_reference(gate, up)` of `w12.matmul_tiled(x, tiled)`'s two halves.

    bf16 x with 1..`CHUNK_MAX_M` rows on a GPU where the flow kernel runs (and no batch kernel is tuned for the
    shape): the flow kernel's W12F_SWIGLU build, per 32-row piece, which finishes each lane's gate and up sums and
    writes the product alone (half the output, no separate SwiGLU kernel). Elsewhere `matmul_tiled`, then, for a bf16
    product on a GPU or under the interpreter, one Triton kernel that reads the product's paired columns and writes
    SwiGLU's output (`w12/kernels/swiglu.py`: the epilogue's arithmetic, `swiglu_reference`'s bits on the same GPU
    but for NaN payloads); otherwise `unpair_cols` and `swiglu_reference`. `q8`, `out` ([..., F] bf16) and `pdl` as
    in `matmul_tiled`."""
    fn = "w12.matmul_swiglu"
    if not isinstance(tiled, TiledW12):
        raise TypeError(f"{fn}: tiled must be a TiledW12 of w12.pair_rows(weight), got {type(tiled).__name__}")
    if tiled.N % 16:
        raise ValueError(f"{fn}: the weight's rows must be paired in 16-row blocks (w12.pair_rows), so N a "
                         f"multiple of 16, got N={tiled.N}")
    F = tiled.N // 2
    _check_args(x, tiled, None, None, None, fn)
    shape = (*x.shape[:-1], F)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.bfloat16 or not out.is_contiguous()
                            or out.device != x.device):
        raise ValueError(f"{fn}: out must be a contiguous bf16 {shape} tensor on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    x2d = x.reshape(-1, tiled.K)
    M = x2d.shape[0]
    o2d = torch.empty((M, F), device=x.device, dtype=torch.bfloat16) if out is None else out.view(M, F)
    op = OP_Q8 if q8 else OP
    fused = M and not torch.compiler.is_compiling() and _batch_config(x2d, tiled, op) is None
    cfg = _flow_first(x2d, tiled, op) if fused else None
    if cfg is not None:
        _launch_flow_pieces(x2d, tiled, None, o2d, cfg, op=op, pdl=pdl, swiglu=True)
    elif M:
        y = matmul_tiled(x2d, tiled, q8=q8, pdl=pdl)
        if (y.dtype == torch.bfloat16 and (y.is_cuda or autotune.is_interpreter())
                and not torch.compiler.is_compiling()):
            from .kernels import w12_swiglu_pairs_kernel

            rows = min(16, triton.next_power_of_2(M)) if autotune.is_interpreter() else 1
            w12_swiglu_pairs_kernel[(triton.cdiv(M, rows), triton.cdiv(F, SWIGLU_BLOCK))](
                y, o2d, M, F, y.stride(0), o2d.stride(0), BLOCK=SWIGLU_BLOCK, ROWS=rows,
                EXPF=not autotune.is_interpreter(), num_warps=4)
        else:
            o2d.copy_(swiglu_reference(*unpair_cols(y)))
    return o2d.reshape(shape) if out is None else out


SWIGLU_BLOCK = 1024  # output columns a program of `w12_swiglu_pairs_kernel` takes


def _flow_first(x2d: torch.Tensor, tiled: TiledW12, op: str) -> FlowConfig | None:
    """The config of the first `FLOW_MAX_M`-row piece where the flow kernel takes this call (bf16 x of
    1..`CHUNK_MAX_M` rows on a GPU where it runs, once per piece: `_launch_flow_pieces`), else None."""
    return _flow_config(x2d[:FLOW_MAX_M], tiled, op) if x2d.shape[0] <= CHUNK_MAX_M else None


def _launch_flow_pieces(x2d, tiled: TiledW12, bias, out2d: torch.Tensor, first: FlowConfig, *, op: str, pdl,
                        swiglu: bool = False) -> None:
    """The flow kernel once per `FLOW_MAX_M`-row piece of x2d into the same rows of out2d: the first piece at
    `first` (`_flow_first`), each other at its own config (`swiglu`: the W12F_SWIGLU build, `matmul_swiglu`)."""
    from . import flow

    for i in range(0, x2d.shape[0], FLOW_MAX_M):
        xs = x2d[i:i + FLOW_MAX_M]
        flow.launch_tiled(first if i == 0 else _flow_config(xs, tiled, op), xs, tiled, bias, out2d[i:i + FLOW_MAX_M],
                          q8=op == OP_Q8, swiglu=swiglu, **_pdl_args(pdl))


FP32_SLICE_ROWS = 8192  # weight rows per fp32 F.linear of the decode path for fp16 x (168 MB at K = 5120)


@contextlib.contextmanager
def _ieee_fp32():
    """fp32 matmuls in full fp32 inside the block whatever the caller set (`allow_tf32` would round the operands to
    10-bit mantissas), restored after it."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    flags.allow_tf32 = False
    try:
        yield
    finally:
        flags.allow_tf32 = before
_PAIR_BLOCK = 1024  # columns a program of the fp16 split and sum kernels takes


def split_fp16(x: torch.Tensor, *, kernels: bool = False) -> torch.Tensor:
    """fp16 x [m, K] as bf16 [2 m, K]: rows hi = bf16(x) (round to nearest even), then lo = x - hi, so that
    x = hi + lo exactly wherever x is finite (x's 11 significant bits less hi's 8 leave lo at most 4, and bf16's
    exponent range holds every fp16 value, subnormals included). Where x is +-Inf or NaN, hi carries it and lo is
    0. `kernels`: one Triton launch (`w12.kernels.fp16_pair`, the same bits) instead of torch's elementwise ops."""
    if kernels:
        from .kernels.fp16_pair import fp16_split_kernel

        m, K = x.shape
        x = x if x.stride(1) == 1 else x.contiguous()
        xb = torch.empty((2 * m, K), device=x.device, dtype=torch.bfloat16)
        fp16_split_kernel[(m, triton.cdiv(K, _PAIR_BLOCK))](x, x.stride(0), xb, m, K, BLOCK=_PAIR_BLOCK, num_warps=4)
        return xb
    xf = x.float()
    hi = xf.to(torch.bfloat16)
    lo = xf - hi.float()
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo)).to(torch.bfloat16)
    return torch.cat([hi, lo])


def fp16_by_bf16_pair(x: torch.Tensor, product32, bias: torch.Tensor | None, out: torch.Tensor, *,
                      kernels: bool = False) -> None:
    """out [m, N] (fp16) = x @ W^T (+ bias) for fp16 x [m, K] from a bf16 product: `product32(xb)` gives xb @ W^T
    [2 m, N] in fp32, unrounded, for xb = split_fp16(x) (the flow kernel's W12F_OUT32 build on a GPU). The two
    halves are added in fp32, then the bias, then one rounding to fp16. Where the hi half's sum is not finite it is
    the result: an infinite or NaN weight already gives it for every x there, and the lo half's 0 * Inf would add a
    NaN x itself does not ask for. Where the lo half's sum is zero the hi half's is kept as it is (a -0.0 stays).
    `kernels`: the split and the sum as one Triton launch each (`w12.kernels.fp16_pair`, the same bits)."""
    m = x.shape[0]
    o = product32(split_fp16(x, kernels=kernels))
    if kernels:
        from .kernels.fp16_pair import fp16_pair_sum_kernel

        N = o.shape[1]
        fp16_pair_sum_kernel[(m, triton.cdiv(N, _PAIR_BLOCK))](
            o, out, out.stride(0), o if bias is None else bias, m, N, HAS_BIAS=bias is not None, BLOCK=_PAIR_BLOCK,
            num_warps=4)
        return
    h, lo = o[:m], o[m:]
    s = torch.where(torch.isfinite(h) & (lo != 0), h + lo, h)
    if bias is not None:
        s = s + bias.float()  # no +0.0 without a bias: it would turn -0.0 into +0.0
    out.copy_(s)


def _pdl_args(pdl: bool | None) -> dict:
    """matmul_tiled's `pdl` as launch_tiled's arguments."""
    if pdl is None:
        return {}
    return {"pdl_rows": FLOW_MAX_M} if pdl else {"pdl": False}


# The flow kernel takes 1..FLOW_MAX_M (`w12.flow.MAX_M`) rows. Up to CHUNK_MAX_M rows, `matmul_tiled` runs it once
# per FLOW_MAX_M-row piece of x (the weight read ceil(M / 32) times, 12 bits a weight each) instead of decoding the
# weight to BF16 for the call (12 + 16 + 16 bits a weight); SPECPILOT_W12_CHUNK_ROWS sets it at import (0 keeps the
# decode above 32 rows). 96 from the H200 (docs/w12-kernels.md, "Above 32 rows"): the pieces beat the decode at
# 40-96 rows on in_proj, o_proj, gate_up and down_proj (o_proj at 72 rows 64.7 us against 91.5, gate_up 257.6
# against 377.7), tie or lose at 136 (o_proj 115.0 against 98.0) and lose at 200 on every one of the four.


def _chunk_rows() -> int:
    """CHUNK_MAX_M's value: SPECPILOT_W12_CHUNK_ROWS (a count of rows >= 0) where set, else 96."""
    env = os.environ.get("SPECPILOT_W12_CHUNK_ROWS", "").strip()
    if not env:
        return 96
    if not env.isdigit():
        raise ValueError(f"w12: SPECPILOT_W12_CHUNK_ROWS={env!r}; set a count of rows (e.g. 96), or 0 or nothing "
                         "to decode the weight above 32 rows")
    return int(env)


CHUNK_MAX_M = _chunk_rows()


def _flow_config(x2d: torch.Tensor, tiled: TiledW12, op: str, dtype: torch.dtype = torch.bfloat16
                 ) -> FlowConfig | None:
    """The flow kernel's config for this call, or None where it does not run (see `matmul_tiled`). `dtype`: the x
    dtype the call runs the kernel on (fp16 x runs it on its bf16 halves)."""
    if x2d.device.type != "cuda" or x2d.dtype != dtype or not 0 < x2d.shape[0] <= FLOW_MAX_M:
        return None
    if wcuda.unavailable(x2d.device) is not None:
        return None
    _, forced = autotune.forced(op)
    if isinstance(forced, BatchConfig):
        return None
    if forced is not None:
        if not isinstance(forced, FlowConfig):
            raise TypeError(f"w12.matmul_tiled: the forced {type(forced).__name__} is not a FlowConfig or BatchConfig; "
                            "the runtime layout runs the flow and batch kernels only (force one of those, or call "
                            "w12.matmul on the planes)")
        return forced
    from .configs import flow_config

    return flow_config(x2d.shape[0], tiled.N, tiled.K, x2d.device, q8=op == OP_Q8)


def _batch_config(x2d: torch.Tensor, tiled: TiledW12, op: str) -> BatchConfig | None:
    """The batch kernel's config for this call, or None where it does not run: a forced `BatchConfig` (on a GPU or
    under the interpreter, at any row count), else this GPU's tuned entry `<op>/batch/<key>` for the shape, which
    `perf/w12_ladder.py --batch --promote` stores where the kernel beat the path the call would take otherwise. With
    neither, the call keeps the flow kernel's pieces or the decode (see `matmul_tiled`)."""
    _, forced = autotune.forced(op)
    if isinstance(forced, BatchConfig):
        if not (x2d.is_cuda or autotune.is_interpreter()):
            raise ValueError("w12.matmul_tiled: the forced BatchConfig is a Triton kernel's config, and no kernel runs "
                             "CPU tensors without the Triton interpreter; set TRITON_INTERPRET=1 before torch or "
                             "triton is imported, or drop the forced config")
        return forced
    if forced is not None or not x2d.is_cuda:
        return None
    # no tuned entry: None, so that the call keeps its other paths (not the batch kernel's heuristic)
    return autotune.get_config(op, "batch", BatchConfig, lambda: None,
                               key=autotune.shape_key(M=x2d.shape[0], N=tiled.N, K=tiled.K), device=x2d.device)


_COUNTERS: dict[tuple, torch.Tensor] = {}  # the batch kernel's tile counters by (device, stream), zero between launches


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 counters of at least `tiles` tiles for the batch kernel's FIXUP on `device`'s current stream: zero, and
    left zero by every launch (the last K share of a tile puts its counter back). Kernels on one stream run in order
    (a PDL launch waits for the grid before it at its start), so one buffer a stream serves them all."""
    idx = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    key = (device.type, idx, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < tiles:
        have = _COUNTERS[key] = torch.zeros(max(tiles, 0 if have is None else 2 * have.numel()), device=device,
                                            dtype=torch.int32)
    return have


def launch_batch(cfg: BatchConfig, x2d: torch.Tensor, tiled: TiledW12, bias: torch.Tensor | None, out: torch.Tensor,
                 *, q8: bool = False, pdl: bool | None = None):
    """out [M, N] = x2d [M, K] @ W^T (+ bias) by the batch kernel (kernels/batch.py) at `cfg`, on a GPU or under
    the interpreter: fp32 sums, one rounding to out's dtype (x's). `cfg.groups` is halved until it divides the
    layout's full column groups (the main loop reads whole K steps without a mask). No host sync. Returns the
    kernel's launch handle (on a GPU the compiled kernel: n_regs, n_spills, asm).
    `pdl`: programmatic dependent launch on sm_90 (each program waits for the previous kernel before its first load
    and lets the next one launch; it hides the launch, not the weight stream's start). None: as
    `w12.cuda.pdl_enabled` says for a launcher whose default is off (SPECPILOT_PDL=1 turns it on)."""
    if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
        with torch.cuda.device(x2d.device):
            return launch_batch(cfg, x2d, tiled, bias, out, q8=q8, pdl=pdl)
    M, K = x2d.shape
    geo = tiled.geometry
    groups = cfg.groups
    while groups > 1 and geo.KF % groups:
        groups //= 2
    split = max(1, min(cfg.split_k, geo.KF // groups))  # every K share holds a step (the tail rides the last)
    grid = (triton.cdiv(tiled.N, cfg.block_n), triton.cdiv(M, cfg.block_t), split)
    ws = out if split == 1 else torch.empty((split, M, tiled.N), device=out.device, dtype=torch.float32)
    fixup = bool(cfg.fixup) and split > 1
    cnt = _tile_counters(x2d.device, grid[0] * grid[1]) if fixup else ws
    has_bias = bias is not None
    b = bias if has_bias else out
    on_gpu = x2d.is_cuda and not autotune.is_interpreter()
    use_asm = bool(cfg.asm) and on_gpu
    if not on_gpu:
        pdl = False
    elif pdl is None:
        pdl = wcuda.pdl_enabled(x2d.device)
    else:
        pdl = bool(pdl) and autotune.hardware.has_pdl(x2d.device)
    launch = {"launch_pdl": True} if pdl else {}
    ck = w12_batch_kernel[grid](x2d, tiled.tiles, tiled.e0, tiled.esc_rowptr, tiled.esc_col, tiled.esc_val, b, out, ws,
                                cnt, M, tiled.N, K, geo.KF, geo.kr, geo.NF, geo.nr, geo.SB, x2d.stride(0),
                                x2d.stride(1), split, HAS_BIAS=has_bias, Q8=bool(q8),
                                X_F16=x2d.dtype == torch.float16, SPLIT=split > 1, BLOCK_N=cfg.block_n,
                                BLOCK_T=cfg.block_t, GROUPS=groups, USE_ASM=use_asm, PDL=pdl, FIXUP=fixup,
                                KT=bool(cfg.kt), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
    if split > 1 and not fixup:
        w12_splitk_reduce_kernel[(triton.cdiv(M * tiled.N, _REDUCE_BLOCK),)](
            ws, b, out, M, tiled.N, SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return ck


# 64-column groups a program of decode_tiled's kernel decodes: 4 makes one row's store 512 bytes. On the H200 4 took
# gate_up from 273.0 to 249.0 µs and down_proj from 147.3 to 137.2 against 1, the same bits
# (perf/results/h200/20261203T0035-w12-flow-configs-ab.json, "decode_tiled_groups")
UNTILE_GROUPS = 4


def decode_tiled(tiled: TiledW12, *, q8: bool = False) -> torch.Tensor:
    """The BF16 weight [N, K] of the runtime layout, `w12.unpack(untile(tiled))` bit for bit (`q8`: the 8-bit view,
    `w12.decode_q8`), decoded tile by tile by one Triton kernel on a GPU or under the interpreter (the escapes then
    written as `unpack` writes them), and through the planes elsewhere. No host sync."""
    if not isinstance(tiled, TiledW12):
        raise TypeError(f"w12.ops.decode_tiled: expected a TiledW12 (from w12.layout.tile), got {type(tiled).__name__}")
    if not (tiled.tiles.is_cuda or autotune.is_interpreter()):
        from .reference import decode_q8

        packed = untile(tiled)
        return decode_q8(packed) if q8 else unpack(packed)
    from .format import _escape_rows
    from .kernels import w12_untile_kernel

    geo = tiled.geometry
    out = torch.empty((tiled.N, tiled.K), dtype=torch.int16, device=tiled.device)
    grid = (geo.row_blocks, -(-geo.KF // UNTILE_GROUPS) + (geo.kr > 0))
    w12_untile_kernel[grid](tiled.tiles, tiled.e0, out, tiled.N, tiled.K, geo.KF, geo.kr, geo.NF, geo.nr, geo.SB,
                            Q8=bool(q8), BC=UNTILE_GROUPS, num_warps=4)
    E = tiled.num_escapes
    if E:
        out[_escape_rows(tiled.esc_rowptr, E), tiled.esc_col.long()] = tiled.esc_val
    return out.view(torch.bfloat16)
