"""W12 GEMMs: `matmul` (exact weights) and `matmul_q8` (the 8-bit view), in three layers.

1. Launch-only: `_plan` picks (kernel, config) per shape (cached) and `_launch` composes the
   kernel launches into a preallocated `out`.
2. Torch registration: `torch.ops.specpilot_w12.matmul` via `torch.library.triton_op` +
   `wrap_triton`, so `torch.compile(fullgraph=True)` sees the Triton kernels, and
   `torch.ops.specpilot_w12.matmul_mma` (`custom_op` + `register_fake`) for the CUDA C++ kernel.
   Eager calls skip the dispatcher and launch directly (it costs ~10 us, a whole small kernel
   at M=1).
3. Public `matmul` / `matmul_q8`: check shapes, dtypes and devices and say how to fix a bad call.

Nothing here syncs the host or allocates by data, so every call is CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch.library import triton_op, wrap_triton

import autotune

from . import cuda as wcuda
from .configs import GEMV_MAX_M, GemvConfig, MmaConfig, TcConfig, TmaConfig, gemv_heuristic, mma_heuristic, tc_heuristic
from .format import W12Weight, unpack
from .kernels import w12_matmul_gemv_kernel, w12_matmul_tc_kernel, w12_splitk_reduce_kernel

__all__ = ["matmul", "matmul_q8", "VARIANTS", "OP", "OP_Q8", "clear_config_cache"]

OP = "w12.matmul"
OP_Q8 = "w12.matmul_q8"
# GPU generation -> variant (autotune.select_variant); "torch" is the no-Triton fallback.
# "mma" is the CUDA C++ kernel (w12/cuda.py, sm_80+, needs nvcc): bf16 x with M <= 32. Other calls,
# and machines without nvcc, run the generation's Triton variant (TRITON_VARIANTS).
VARIANTS: dict[int, str] = {9: "mma", 8: "mma"}
TRITON_VARIANTS: dict[int, str] = {9: "tc", 8: "gemv"}
TC_GEMV_MAX_M = 1  # the "tc" variant runs the CUDA-core GEMV up to this M, and above it where tuned (see _plan)
_KNOWN = ("mma", "tc", "gemv", "torch")
_REDUCE_BLOCK = 1024

# --------------------------------------------------------------------------------------
# 1. Launch-only
# --------------------------------------------------------------------------------------

_PLANS: dict[tuple, tuple[str, object]] = {}


def clear_config_cache() -> None:
    """Forget cached per-shape configs (after storing new tuned entries)."""
    _PLANS.clear()


def _select(op: str, device: torch.device) -> str:
    v, _ = autotune.forced(op)
    if v is None and op == OP_Q8:
        v, _ = autotune.forced(OP)  # forcing w12.matmul also pins matmul_q8
    forced = v is not None
    if v is None:
        if device.type != "cuda" and not autotune.is_interpreter():
            return "torch"
        v = autotune.select_variant(op, VARIANTS, device=device, fallback="torch")
    if v not in _KNOWN:
        raise ValueError(f"unknown {op} variant {v!r}; choose one of {_KNOWN}")
    if v == "mma" and not wcuda.available(device):
        if forced:
            raise RuntimeError(f"{op}: variant 'mma' needs an sm_80+ GPU and nvcc (see w12/cuda.py)")
        v = _triton_variant(device)
    return v


def _triton_variant(device: torch.device) -> str:
    """The generation's Triton variant: what "mma" falls back to for inputs it does not take."""
    if device.type != "cuda" and not autotune.is_interpreter():
        return "torch"
    return autotune.select_variant("w12.triton", TRITON_VARIANTS, device=device, fallback="torch")


def _plan(op: str, variant: str, M: int, N: int, K: int, device: torch.device) -> tuple[str, object]:
    """(kernel name, config) for one call: forced config > per-shape cache > get_config."""
    _, forced_cfg = autotune.forced(op)
    q8 = op == OP_Q8
    if forced_cfg is not None:
        if isinstance(forced_cfg, GemvConfig):
            return "gemv", forced_cfg
        if isinstance(forced_cfg, TcConfig):
            return "tc", forced_cfg
        if isinstance(forced_cfg, (MmaConfig, TmaConfig)):
            return "mma", forced_cfg
        raise TypeError(f"force({op!r}, config=...) expects a TmaConfig, MmaConfig, TcConfig or GemvConfig, "
                        f"got {type(forced_cfg).__name__}")
    ck = (op, variant, autotune.bucket_m(M), N, K, device)
    hit = _PLANS.get(ck)
    if hit is not None:
        return hit
    key = autotune.shape_key(M=M, N=N, K=K)
    if variant == "mma" and f"{op}/tma/{key}" in autotune.load_tuned(device) and wcuda.tma_available(device):
        # the sm_90 TMA kernel won this cell in the sweep (perf/w12_mma_explore.py stores one of the two)
        plan = ("mma", autotune.get_config(op, "tma", TmaConfig, TmaConfig, key=key, device=device))
    elif variant == "mma":
        plan = ("mma", autotune.get_config(op, "mma", MmaConfig, lambda: mma_heuristic(M, N, K, device),
                                           key=key, device=device))
    elif variant == "tc" and M <= TC_GEMV_MAX_M:
        # H200 round 1: the CUDA-core GEMV beat every tensor-core tile at M=1 in all 10 cells
        # (mm 0.84-1.14x cuBLAS vs 0.58-0.76x); tuned entries live under variant "gemv"
        plan = ("gemv", autotune.get_config(op, "gemv", GemvConfig, lambda: gemv_heuristic(M, N, K, device, q8=q8),
                                            key=key, device=device))
    elif variant == "tc" and M <= GEMV_MAX_M and f"{op}/tc.gemv/{key}" in autotune.load_tuned(device):
        # a tuned entry says the GEMV beat every tensor-core tile at this shape (H200 round 2: tok2d at M=2)
        plan = ("gemv", autotune.get_config(op, "tc.gemv", GemvConfig, lambda: gemv_heuristic(M, N, K, device, q8=q8),
                                            key=key, device=device))
    elif variant == "tc":
        plan = ("tc", autotune.get_config(op, "tc", TcConfig, lambda: tc_heuristic(M, N, K, device, q8=q8),
                                          key=key, device=device))
    elif M <= GEMV_MAX_M:
        plan = ("gemv", autotune.get_config(op, "gemv", GemvConfig, lambda: gemv_heuristic(M, N, K, device, q8=q8),
                                            key=key, device=device))
    else:
        plan = ("tc", autotune.get_config(op, "gemv.mma", TcConfig,
                                          lambda: tc_heuristic(M, N, K, device, q8=q8, mma_only=True),
                                          key=key, device=device))
    _PLANS[ck] = plan
    return plan


def _launch(x2d, hi, lo, e0, rowptr, col, val, bias, out, *, op: str, variant: str, wrap=None):
    """out[M, N] = x2d[M, K] @ W^T (+ bias). `wrap` is `wrap_triton` when traced by torch.
    Returns the main kernel's launch handle (eager: the compiled kernel, for n_regs / n_spills)."""
    M, K = x2d.shape
    N, Kp = hi.shape
    if M == 0:
        return None
    if wrap is not None and autotune.is_interpreter() and _is_fake(x2d):
        return None  # wrap_triton passes interpreter kernels through untraced; fake tensors need no launch
    kernel_name, cfg = _plan(op, variant, M, N, K, x2d.device)
    q8 = op == OP_Q8
    if kernel_name == "mma":
        if not wcuda.supports(x2d, hi):
            raise ValueError(f"{op}: the CUDA kernel (MmaConfig) takes bfloat16 x with 1 <= M <= {wcuda.MAX_M}, "
                             f"got {x2d.dtype} with M={M}; force a TcConfig or GemvConfig instead")
        wcuda.launch(cfg, x2d, hi, lo, e0, rowptr, col, val, bias, out, q8=q8)
        return None
    bt = cfg.block_t
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, bt), cfg.split_k)
    ws = out if cfg.split_k == 1 else torch.empty((cfg.split_k, M, N), device=out.device, dtype=torch.float32)
    has_bias = bias is not None
    b = bias if has_bias else out
    common = dict(HAS_BIAS=has_bias, Q8=q8, SELECT_ZERO=bool(cfg.select_zero),
                  ZERO_DENSE=q8 or bool(cfg.select_zero), SPLIT_K=cfg.split_k, SPLIT=cfg.split_k > 1, BLOCK_N=cfg.block_n, BLOCK_T=bt,
                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2d, hi, lo, e0, rowptr, col, val, b, out, ws, M, N, K, Kp, Kp // 2, x2d.stride(0), x2d.stride(1))
    # the packed PTX decode needs a real GPU (the interpreter runs no inline asm)
    use_asm = bool(cfg.asm) and x2d.is_cuda and not autotune.is_interpreter()
    if kernel_name == "tc":
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


def _run(x2d, hi, lo, e0, rowptr, col, val, bias, op: str, variant: str, wrap=None) -> torch.Tensor:
    if variant == "mma" and not wcuda.supports(x2d, hi):
        variant = _triton_variant(x2d.device)  # fp16 x, M > 32: the Triton kernels
    if variant == "torch":
        return _torch_fallback(x2d, hi, lo, e0, rowptr, col, val, bias, K=x2d.shape[1], q8=op == OP_Q8)
    out = torch.empty((x2d.shape[0], hi.shape[0]), device=x2d.device, dtype=x2d.dtype)
    if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
        with torch.cuda.device(x2d.device):
            _launch(x2d, hi, lo, e0, rowptr, col, val, bias, out, op=op, variant=variant, wrap=wrap)
    else:
        _launch(x2d, hi, lo, e0, rowptr, col, val, bias, out, op=op, variant=variant, wrap=wrap)
    return out


# --------------------------------------------------------------------------------------
# 2. Torch registration
# --------------------------------------------------------------------------------------


@triton_op("specpilot_w12::matmul", mutates_args=())
def _matmul_op(x2d: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor, esc_rowptr: torch.Tensor,
               esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor], q8: bool,
               variant: str) -> torch.Tensor:
    """[M, K] x W12 [N, Kp] -> [M, N] in x's dtype. `variant` "auto" is resolved here, at trace
    time under torch.compile (dynamo cannot read the `autotune.force` context variable)."""
    if variant == "auto":
        variant = _select(OP_Q8 if q8 else OP, x2d.device)
    if variant == "mma" and wcuda.supports(x2d, hi):  # traced as the opaque CUDA op, not decomposed
        return torch.ops.specpilot_w12.matmul_mma(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, q8)
    return _run(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, OP_Q8 if q8 else OP, variant, wrap=wrap_triton)


@torch.library.custom_op("specpilot_w12::matmul_mma", mutates_args=())
def _matmul_mma_op(x2d: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor, esc_rowptr: torch.Tensor,
                   esc_col: torch.Tensor, esc_val: torch.Tensor, bias: Optional[torch.Tensor], q8: bool) -> torch.Tensor:
    """The CUDA C++ kernel as an opaque op for torch.compile (inductor cannot trace a driver-API launch)."""
    return _run(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, OP_Q8 if q8 else OP, "mma")


@_matmul_mma_op.register_fake
def _(x2d, hi, lo, e0, esc_rowptr, esc_col, esc_val, bias, q8):
    return x2d.new_empty((x2d.shape[0], hi.shape[0]))


# --------------------------------------------------------------------------------------
# 3. Public API
# --------------------------------------------------------------------------------------


def _check(x, packed, bias, name: str) -> None:
    if not isinstance(packed, W12Weight):
        raise TypeError(f"w12.{name} expects a W12Weight as `packed` (build one with w12.pack(weight)), "
                        f"got {type(packed).__name__}")
    packed.validate(deep=False)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"w12.{name} expects x to be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w12.{name} takes bfloat16 or float16 activations, got x.dtype={x.dtype}; "
                        f"convert with x.to(torch.bfloat16)")
    if x.dim() < 1 or x.shape[-1] != packed.K:
        raise ValueError(f"w12.{name}: x has shape {tuple(x.shape)} but the weight is [N={packed.N}, K={packed.K}]; "
                         f"the last dim of x must be K={packed.K} (F.linear semantics: out = x @ W.T)")
    if x.device != packed.device:
        raise ValueError(f"w12.{name}: x is on {x.device} but the weight is on {packed.device}; "
                         f"move one of them, e.g. packed = packed.to(x.device)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (packed.N,):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"w12.{name}: bias must be a tensor of shape ({packed.N},), got {shape}")
        if not bias.is_floating_point():
            raise TypeError(f"w12.{name}: bias must be floating point, got {bias.dtype}; use bias.to(x.dtype)")
        if bias.device != x.device:
            raise ValueError(f"w12.{name}: bias is on {bias.device} but x is on {x.device}; use bias.to(x.device)")


def _call(x, packed: W12Weight, bias, op: str) -> torch.Tensor:
    K = packed.K
    x2d = x.reshape(-1, K)  # a view when possible; the kernels take any strides
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    args = (x2d, packed.hi, packed.lo, packed.e0, packed.esc_rowptr, packed.esc_col, packed.esc_val, bias)
    if torch.compiler.is_compiling():
        out = torch.ops.specpilot_w12.matmul(*args, op == OP_Q8, "auto")
    else:
        out = _run(*args, op, _select(op, x.device))
    return out.reshape(*x.shape[:-1], packed.N)


def matmul(x: torch.Tensor, packed: W12Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, w12.unpack(packed), bias)` without unpacking: x [..., K] (bf16 or fp16) -> [..., N]
    in x's dtype, fp32 accumulation, one rounding at the end.

    The weight is read at 12 bits (1.5 bytes) per element and decoded in registers; escapes are
    added exactly from the CSR list in each tile's epilogue. Error against fp64 is that of a
    same-precision F.linear. Non-finite escaped weights (Inf, NaN) propagate as in F.linear.
    One known difference: where x itself is +-Inf/NaN and the weight column holds an escape,
    the result may be NaN where F.linear gives +-Inf.

    Variant by GPU (`w12.ops.VARIANTS`): "mma", the CUDA C++ kernels (mma.sync, decode in
    registers, built with nvcc on first use) for bf16 x with M <= 32: the register-pipelined kernel
    (sm_80+), or on sm_90 the TMA kernel where a tuned entry chose it; otherwise the Triton variants
    "tc" (sm_90, wgmma, swap-AB) or "gemv" (CUDA cores for M <= 4, mma above). Pin one with
    `autotune.force("w12.matmul", variant="tc")` or `config=MmaConfig(...)` / `TmaConfig(...)`.
    """
    _check(x, packed, bias, "matmul")
    return _call(x, packed, bias, OP)


def matmul_q8(x: torch.Tensor, packed: W12Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Like `matmul`, but reads only the `hi` plane (1 byte per weight) plus the escapes: the
    product with the 8-bit view `w12.decode_q8(packed)` (docs/w12-format.md).

    Error: every dense weight is replaced by the midpoint of its 16-value bin, a relative
    per-weight error of at most 2^-4 (6.25%, half a bin); weights whose hi byte is 0 (the
    row's smallest positive bin, mantissa < 16) read as 0. Escapes are exact. So the result
    differs from `matmul` by up to 2^-4 * sum_k |x_k w_k| per output, and matches the fp64
    product with `decode_q8` to within same-precision F.linear error. Variants and configs
    as for `matmul` (op name "w12.matmul_q8"; forcing "w12.matmul" also applies here).
    """
    _check(x, packed, bias, "matmul_q8")
    return _call(x, packed, bias, OP_Q8)
