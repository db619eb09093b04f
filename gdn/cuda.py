"""The CUDA C++ tree-verify kernel (`csrc/gdn_tree.cu`): built with NVRTC, loaded and launched through the
driver API (autotune.jit), on torch's current stream (CUDA graphs capture it).

One CUBIN per (config, node tile, K, dtypes, layout, PDL, arch) (`spec()`), compiled on first use and cached on
disk by autotune.jit. What it takes (`unsupported()` names the first thing that fails, and `gdn.tree_verify`
then runs the Triton WY kernel instead): an sm_80+ GPU with its driver and cuda-python's NVRTC, bf16 q/k/v,
g and beta in fp32/bf16/fp16, at most MAX_CUDA_NODES nodes per request, K a multiple of 32 up to 256, V a
multiple of the config's BV, 16-byte aligned rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from autotune import jit
from autotune.jit import BuildError, available, unavailable

from .configs import CudaConfig

__all__ = ["available", "unavailable", "unsupported", "spec", "build", "run", "BuildError", "SOURCE", "KERNEL",
           "MAX_CUDA_NODES"]

SOURCE = Path(__file__).with_name("csrc") / "gdn_tree.cu"
KERNEL = "gdn_tree_cuda_kernel"
MAX_CUDA_NODES = 32  # the kernel's node tile; gdn.MAX_NODES (the plan's limit) is larger
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KERNELS = jit.FunctionCache()  # (kernel, dynamic smem) by specialisation and device


def _aligned(t: torch.Tensor, elems: int, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in strides)


def unsupported(q, k, v, g, beta, o, pool, state_idx, vk: bool, max_nodes: int, cfg: CudaConfig) -> str | None:
    """Why this call cannot run on the CUDA kernel (None: it can)."""
    why = unavailable(q.device)
    if why is not None:
        return why
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        return "q, k and v must be bf16"
    if o.dtype not in (torch.bfloat16, torch.float32):
        return "the output must be bf16 or fp32"
    if g.dtype not in _DT or beta.dtype not in _DT:
        return "g and beta must be fp32, bf16 or fp16"
    if state_idx.dtype not in (torch.int32, torch.int64):
        return "state_indices must be int32 or int64"
    if max_nodes > MAX_CUDA_NODES:
        return f"at most {MAX_CUDA_NODES} nodes per request (the plan allows {max_nodes})"
    K, V = q.shape[-1], v.shape[-1]
    if K % 32 or K > 256:
        return f"K={K}: a multiple of 32, at most 256"
    if V % cfg.BV:
        return f"V={V}: a multiple of BV={cfg.BV}"
    why = tile_split_problem(cfg, 16 if max_nodes <= 16 else 32, K, vk)
    if why is not None:
        return why
    if any(t.stride(-1) != 1 for t in (q, k, v, o)):
        return "q, k, v and the output need unit stride in the last dimension"
    oe = 8 if o.dtype == torch.bfloat16 else 4
    rows = [(q, 8, q.stride(0), q.stride(1)), (k, 8, k.stride(0), k.stride(1)), (v, 8, v.stride(0), v.stride(1)),
            (o, oe, o.stride(0), o.stride(1))]
    if not all(_aligned(t, e, *s) for t, e, *s in rows):
        return "q, k, v and the output rows must be 16-byte aligned"
    if pool.stride(-1) != 1 or not _aligned(pool, 4, *pool.stride()[:-1]):
        return "the state pool must be contiguous in its last dimension with 16-byte aligned rows"
    if q.shape[0] > 2**31 - 1 or pool.shape[0] > 2**31 - 1:
        return "too many nodes or pool rows for int32 indexing"
    return None


def tile_split_problem(cfg: CudaConfig, nt: int, K: int, vk: bool) -> str | None:
    """The kernel's static load splits (gdn_tree.cu's static_asserts) for node tile `nt`: the mma warps
    (32 * BV / 8 threads) load the q/k tile, the state rows and the v tile in whole passes."""
    mma_thr = 32 * (cfg.BV // 8)
    ch = K // 8  # 16-byte chunks per q/k row
    if mma_thr % ch or nt % (mma_thr // ch):
        return (f"K={K} with BV={cfg.BV}: {mma_thr} loader threads cannot split a {nt}-row q/k tile of {ch} "
                "16-byte chunks per row")
    sch = (K if vk else cfg.BV) // 4
    if mma_thr % sch or (cfg.BV if vk else K) % (mma_thr // sch):
        return f"K={K} with BV={cfg.BV}: the state tile does not split over {mma_thr} loader threads"
    if mma_thr % (cfg.BV // 8):
        return f"BV={cfg.BV}: the v tile does not split over {mma_thr} loader threads"
    return None


def spec(cfg: CudaConfig, nt: int, K: int, *, l2: bool = True, vk: bool = False, gdt: int = 0, bdt: int = 1,
         odt: int = 1, idx64: bool = False, pdl: bool = False, arch: tuple[int, int] = (9, 0),
         defines: Mapping[str, object] | None = None) -> jit.Spec:
    """The build of one specialisation; `defines` add to (or override) its GDN_* defines."""
    base = dict(NT=nt, K=K, BV=cfg.BV, PIECES=cfg.pieces, L2=int(l2), VK=int(vk), GDT=gdt, BDT=bdt, ODT=odt,
                IDX64=int(idx64), PDL=int(pdl), MINB=cfg.min_blocks, SKIP=cfg.skip, UNROLL_OUT=cfg.unroll_out,
                UNROLL_KS=cfg.unroll_ks, SPLITW=int(cfg.split_warps), TRACE=int(cfg.trace))
    target = jit.arch_name(arch)
    name = (f"gdn_tree-{cfg.tag()}-nt{nt}-k{K}-l{int(l2)}-vk{int(vk)}-g{gdt}b{bdt}o{odt}-i{int(idx64)}-p{int(pdl)}-"
            f"{target}")
    return jit.Spec(SOURCE, KERNEL, target, {f"GDN_{k}": v for k, v in base.items()} | dict(defines or {}), name=name)


def build(cfg: CudaConfig, nt: int, K: int, *, l2: bool = True, vk: bool = False, gdt: int = 0, bdt: int = 1,
          odt: int = 1, idx64: bool = False, pdl: bool = False, arch: tuple[int, int] = (9, 0), out: str = "cubin",
          defines: Mapping[str, object] | None = None) -> Path:
    """Compile one specialisation (cached on disk) and return its file `out` (`autotune.jit.Spec.file`: "cubin",
    "ptx" or "log"). Raises autotune.BuildError."""
    s = spec(cfg, nt, K, l2=l2, vk=vk, gdt=gdt, bdt=bdt, odt=odt, idx64=idx64, pdl=pdl, arch=arch, defines=defines)
    return s.file(out)


def _kernel(key: tuple) -> tuple[jit.Kernel, int]:
    return _KERNELS.get_or_make(key, lambda: _load(*key))


def _load(cfg, nt, K, l2, vk, gdt, bdt, odt, idx64, pdl, idx) -> tuple[jit.Kernel, int]:
    arch = torch.cuda.get_device_capability(idx)
    return spec(cfg, nt, K, l2=l2, vk=vk, gdt=gdt, bdt=bdt, odt=odt, idx64=idx64, pdl=pdl, arch=arch).load_sized(
        idx, "gdn_tree_smem_bytes", lambda smem, limit: f"gdn.cuda: {cfg} needs {smem} bytes of shared memory per CTA "
        f"(node tile {nt}, K={K}); this GPU allows {limit}: use a smaller BV")


class _Trace:
    """Diagnostic stamps (10 int64 per CTA): `pool` is an int64 [rows, 10] tensor the caller allocates; each traced
    launch takes the next rows from `pos` on (no allocation, so a traced CUDA graph holds only the kernels)."""

    pool: torch.Tensor | None = None
    pos: int = 0


TRACE = _Trace()


def _trace_ptr(cfg: CudaConfig, ctas: int, dev) -> int:
    if not cfg.trace:
        return 0
    if TRACE.pool is None or TRACE.pos + ctas > TRACE.pool.shape[0]:
        raise ValueError("a traced CudaConfig needs gdn.cuda.TRACE.pool: an int64 [rows, 10] tensor with room for every CTA")
    ptr = TRACE.pool[TRACE.pos].data_ptr()
    TRACE.pos += ctas
    return ptr


def run(cfg: CudaConfig, q, k, v, g, beta, o, pool, state_idx, cu, anc, scale: float, use_l2: bool, vk: bool,
        max_nodes: int, strides: tuple[int, int, int, int], pdl: bool, err: torch.Tensor) -> None:
    """o = tree_verify(...) on torch's current stream; inputs already checked by `unsupported`.
    `strides`: the pool's (slot, head, k, v) element strides. A config with `trace` writes 10 stamps per CTA
    into `TRACE.pool`. `err`: the plan's int32 error word (gdn/guard.py): a request whose
    state index is outside the pool is skipped and flagged there."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu.numel() - 1
    nt = 16 if max_nodes <= 16 else 32
    dev = q.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (cfg, nt, K, bool(use_l2), bool(vk), _DT[g.dtype], _DT[beta.dtype], _DT[o.dtype], state_idx.dtype == torch.int64,
           pdl, idx)
    kernel, smem = _kernel(key)
    values = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), o.data_ptr(), pool.data_ptr(),
              state_idx.data_ptr(), cu.data_ptr(), anc.data_ptr(), scale, HV // H, T, pool.shape[0],
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
              beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *strides,
              err.data_ptr(), _trace_ptr(cfg, (V // cfg.BV) * HV * B, dev))
    stream = torch.cuda.current_stream(dev).cuda_stream
    kernel.launch((V // cfg.BV, HV, B), 32 * (cfg.BV // 8 + 1), smem, stream, values, _TYPES, pdl=pdl)


_P, _L, _I, _F = jit.PTR, jit.I64, jit.I32, jit.F32
# q k v g beta o pool state_idx cu anc, scale, HV / H, T, pool rows, 12 strides, 4 pool strides, err, trace
_TYPES = (_P,) * 10 + (_F, _I, _I, _I) + (_L,) * 16 + (_P, _P)
