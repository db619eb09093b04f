"""The warp-specialised CUDA C++ split kernel (`csrc/tree_attn_ws.cu`, variant "ws"): built with NVRTC for sm_90a,
loaded and launched through the driver API (autotune.jit), on torch's current stream (CUDA graphs capture it).

One CUBIN per (config, head dim, GQA group, dtype, k_new or not) (`spec()`), compiled on first use and cached on
disk by autotune.jit. What it takes (`unsupported()` names the first thing that fails): an sm_90 GPU (wgmma and
setmaxnreg exist there only) with its driver and cuda-python's NVRTC, head dims 64 / 128 / 256, bf16 or fp16;
`misaligned()` checks the tensors of a call: unit stride in the last dimension and 16-byte aligned rows (the
producer copies 16 bytes at a time). The partials go to the plan's workspace and tree_attn's Triton merge kernel
combines them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from autotune import jit
from autotune.hardware import compute_capability
from autotune.jit import BuildError, unavailable

from .configs import WSConfig

__all__ = ["unsupported", "misaligned", "spec", "build", "run", "BuildError", "SOURCE", "KERNEL", "HEAD_DIMS"]

SOURCE = Path(__file__).with_name("csrc") / "tree_attn_ws.cu"
KERNEL = "tree_attn_ws_kernel"
HEAD_DIMS = (64, 128, 256)
_KERNELS = jit.FunctionCache()  # (kernel, dynamic smem) by specialisation and device


def unsupported(device, head_dim: int, dtype: torch.dtype, cfg: WSConfig) -> str | None:
    """Why the "ws" kernel cannot take calls of this kind on `device` (None: it can)."""
    why = unavailable(device)
    if why is not None:
        return why
    cc = compute_capability(torch.device(device).index)
    if cc != (9, 0):
        return f"the ws kernel needs sm_90 (wgmma, setmaxnreg); this GPU is sm_{cc[0]}{cc[1]}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: the ws kernel takes {HEAD_DIMS}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the ws kernel takes bfloat16 or float16"
    return config_problem(cfg, head_dim)


def config_problem(cfg: WSConfig, head_dim: int) -> str | None:
    """The kernel's static checks of a config (tree_attn_ws.cu's static_asserts), and shared memory."""
    if cfg.consumers not in (1, 2):
        return f"consumers={cfg.consumers}: 1 or 2 (three do not fit the registers at D = 256)"
    if cfg.pingpong and cfg.consumers != 2:
        return f"config: pingpong with {cfg.consumers} consumer (the turns are between two consumers)"
    if cfg.q_in_regs and cfg.consumers == 2 and (cfg.block_n != 32 or cfg.consumer_regs < 240):
        return ("registers: q in registers with two consumers needs 32 keys a block and 240 registers a consumer "
                "(its fragments are D / 4 registers a thread)")
    # from an NVRTC sweep of the space at D = 256: these serialise the wgmma (not enough registers)
    if cfg.overlap and cfg.q_in_regs and (cfg.consumers != 1 or cfg.block_n != 32):
        return "registers: the overlap with q in registers fits one consumer at 32 keys a block only"
    if cfg.overlap and cfg.consumers == 2 and cfg.block_n == 64 and cfg.consumer_regs < 216:
        return "registers: the overlap with two consumers at 64 keys a block needs 216 registers a consumer"
    if cfg.overlap and cfg.pingpong:
        return "config: overlap and pingpong are two ways to run the softmax beside the wgmma; take one"
    if cfg.block_n not in (32, 64):
        return f"block_n={cfg.block_n}: 32 or 64"
    if not 2 <= cfg.num_stages <= 8:
        return f"num_stages={cfg.num_stages}: 2 to 8"
    if cfg.producers not in (1, 2):
        return f"producers={cfg.producers}: 1 or 2 producer warpgroups"
    if cfg.cluster:
        if cfg.consumers != 2 or cfg.pair_halves or cfg.num_stages % 2:
            return ("config: cluster pairs need two consumers, pair_halves=False (a halves item of one split, as its "
                    "partner's) and an even number of stages (both CTAs keep a block in the same stage)")
        rows_a_pass = 128 * cfg.producers // (head_dim // 8)
        if rows_a_pass > cfg.block_n // 2:
            return (f"config: cluster pairs copy half a block ({cfg.block_n // 2} rows); {cfg.producers} producer "
                    f"warpgroups copy {rows_a_pass} rows a pass at D = {head_dim}")
    regs = 128 * (cfg.producers * cfg.producer_regs + cfg.consumers * cfg.consumer_regs)
    if cfg.consumers + cfg.producers > 2 and regs > 65536:
        return (f"registers: 128 x ({cfg.producers} x {cfg.producer_regs} + {cfg.consumers} x {cfg.consumer_regs}) "
                "exceed the register file (65536)")
    smem = cfg.smem_bytes(head_dim)
    if smem > 227 << 10:
        return f"shared memory: {smem} bytes (q rows and {cfg.num_stages} K/V stages) > 227 KB"
    return None


def misaligned(*tensors: torch.Tensor) -> str | None:
    """Why these tensors' rows cannot be copied 16 bytes at a time (None: they can)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return (f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} does not have 16-byte aligned rows "
                    "with unit stride in the last dimension")
    return None


def spec(cfg: WSConfig, head_dim: int, group: int, *, f16: bool = False, new: bool = False,
         arch: tuple[int, int] = (9, 0), defines: Mapping[str, object] | None = None) -> jit.Spec:
    """The build of one specialisation; `defines` add to (or override) its TA_* defines."""
    base = dict(C=cfg.consumers, BN=cfg.block_n, STAGES=cfg.num_stages, D=head_dim, G=group, F16=int(f16),
                NEW=int(new), PREGS=cfg.producer_regs, CREGS=cfg.consumer_regs, PINGPONG=int(cfg.pingpong),
                KV_AHEAD=int(cfg.kv_ahead), QREG=int(cfg.q_in_regs), OVERLAP=int(cfg.overlap),
                PWG=cfg.producers, CLUSTER=2 if cfg.cluster else 1)
    target = jit.arch_name(arch, wgmma=True)
    name = (f"tree_attn_ws-c{cfg.consumers}-n{cfg.block_n}-s{cfg.num_stages}-r{cfg.producer_regs}x{cfg.consumer_regs}"
            f"{'-pp' if cfg.pingpong else ''}{'-ka' if cfg.kv_ahead else ''}{'-qr' if cfg.q_in_regs else ''}"
            f"{'-ov' if cfg.overlap else ''}{'-p2' if cfg.producers == 2 else ''}{'-cl' if cfg.cluster else ''}"
            f"-d{head_dim}-g{group}-{'f16' if f16 else 'bf16'}-new{int(new)}-{target}")
    return jit.Spec(SOURCE, KERNEL, target, {f"TA_{k}": v for k, v in base.items()} | dict(defines or {}), name=name)


def build(cfg: WSConfig, head_dim: int, group: int, *, f16: bool = False, new: bool = False, out: str = "cubin",
          defines: Mapping[str, object] | None = None) -> Path:
    """Compile one specialisation for sm_90a (cached on disk) and return its file `out` (`autotune.jit.Spec.file`:
    "cubin", "ptx" or "log"). Raises autotune.BuildError."""
    return spec(cfg, head_dim, group, f16=f16, new=new, defines=defines).file(out)


def _kernel(key: tuple) -> tuple[jit.Kernel, int]:
    return _KERNELS.get_or_make(key, lambda: _load(*key))


def _load(cfg, head_dim, group, f16, new, defines, idx) -> tuple[jit.Kernel, int]:
    return spec(cfg, head_dim, group, f16=f16, new=new, defines=dict(defines)).load_sized(
        idx, "tree_attn_ws_smem_bytes", lambda smem, limit: f"tree_attn.cuda: {cfg} needs {smem} bytes of shared "
        f"memory per CTA (D={head_dim}); this GPU allows {limit}: use fewer stages")


_P, _L, _I, _F = jit.PTR, jit.I64, jit.I32, jit.F32
# q k_cache v_cache k_new v_new qo_indptr kv_indptr kv_indices tree_mask items po plse, scale, 12 strides, page
_TYPES = (_P,) * 12 + (_F,) + (_L,) * 12 + (_I,)


def run(cfg: WSConfig, q, k_cache, v_cache, kn, vn, strides: tuple, page: int, new: bool, qo_indptr, kv_indptr,
        kv_indices, tree_mask, items, po, plse, sm_scale_log2: float, defines: Mapping[str, object] | None = None
        ) -> None:
    """The split kernel over the plan's items on torch's current stream: partial outputs and base-2 LSEs into
    po / plse (`cfg.block_m` rows per item and KV head). `kn`, `vn`, `strides`, `page`: the caches' and k_new /
    v_new's arguments as tree_attn.ops.cache_args gives them; `new`: k_new / v_new hold the nodes. Inputs already
    checked (`unsupported`, `misaligned`). `defines`: extra TA_* defines of the build (the GPU tests' layout probes,
    TA_PROBE)."""
    _, H, D = q.shape
    Hkv = k_cache.shape[-2]
    dev = q.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    extra = tuple(sorted((defines or {}).items()))
    kernel, smem = _kernel((cfg, D, H // Hkv, q.dtype == torch.float16, new, extra, idx))
    values = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kn.data_ptr(), vn.data_ptr(), qo_indptr.data_ptr(),
              kv_indptr.data_ptr(), kv_indices.data_ptr(), tree_mask.data_ptr(), items.data_ptr(), po.data_ptr(),
              plse.data_ptr(), sm_scale_log2, q.stride(0), q.stride(1), *strides, page)
    stream = torch.cuda.current_stream(dev).cuda_stream
    kernel.launch((items.shape[0], Hkv, 1), 128 * (cfg.consumers + cfg.producers), smem, stream, values, _TYPES)
