"""The CUDA C++ W12 kernels: build with nvcc, load and launch through the driver API.

`csrc/w12_mma.cu` (`MmaConfig`, sm_80+): register-pipelined, weights read straight from the planes.
`csrc/w12_tma.cu` (`TmaConfig`, sm_90): warp-specialised, TMA streams the planes into an mbarrier
ring; its 2-D tensor maps (`cuTensorMapEncodeTiled`) are built on the host and cached per
(address, shape, box).

One cubin per config (its fields become -D defines), compiled on first use into
`$SPECPILOT_CACHE/w12_cuda` (default `~/.cache/specpilot/w12_cuda`) under a key made of the
source, the flags and the nvcc version, so an edited kernel or another compiler never reuses a
stale binary. Loading and launching go through `libcuda` with ctypes: no C++ extension build,
no extra Python package. Launches go to torch's current stream, so CUDA-graph capture works;
`torch.compile` sees the launch as the opaque custom op `specpilot_w12::matmul_mma` (w12/ops.py).

Requirements: an NVIDIA GPU of compute capability >= 8.0 (mma.sync with bf16) and nvcc on the
machine (`SPECPILOT_NVCC`, `PATH`, `$CUDA_HOME/bin` or `/usr/local/cuda/bin`). `available()`
says whether both hold; w12.ops falls back to the Triton kernels otherwise.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from autotune.cudadrv import check as _check
from autotune.cudadrv import launch as _launch_kernel
from autotune.cudadrv import libcuda as _libcuda
from autotune.cudadrv import FunctionCache, allow_dynamic_smem, available, compile_cached, load_kernel, nvcc_path
from autotune.cudadrv import nvcc_version as _nvcc_version  # noqa: F401 (perf/w12_mma_explore.py records it)

from .configs import MmaConfig, TmaConfig

__all__ = ["available", "tma_available", "nvcc_path", "build", "launch", "n_tiles", "unsupported", "SOURCE", "KERNEL",
           "TMA_SOURCE", "TMA_KERNEL", "MAX_M"]

SOURCE = Path(__file__).with_name("csrc") / "w12_mma.cu"
KERNEL = b"w12_matmul_mma_kernel"
TMA_SOURCE = Path(__file__).with_name("csrc") / "w12_tma.cu"  # sm_90: TMA ring + warp specialisation
COMMON = Path(__file__).with_name("csrc") / "w12_common.cuh"  # device helpers included by both
TMA_KERNEL = b"w12_matmul_tma_kernel"
MAX_M = 32  # 4 n-tiles of 8 tokens
_SMEM_DEFAULT_MAX = 48 << 10
_STATIC_SMEM = 64  # the kernel's own __shared__ variables (16 bytes today), with room to spare
_BIAS_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


class CudaBuildError(RuntimeError):
    """nvcc failed on csrc/w12_mma.cu (the message holds its output)."""


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def n_tiles(M: int) -> int:
    """Token tiles of 8 compiled for M (1, 2 or 4)."""
    if not 0 < M <= MAX_M:
        raise ValueError(f"the CUDA W12 kernel takes 1 <= M <= {MAX_M}, got M={M}")
    return 1 if M <= 8 else 2 if M <= 16 else 4


def _source(cfg) -> tuple[Path, bytes]:
    return (TMA_SOURCE, TMA_KERNEL) if isinstance(cfg, TmaConfig) else (SOURCE, KERNEL)


def _flags(cfg, nt: int, q8: bool, arch: tuple[int, int]) -> list[str]:
    sm = f"{arch[0]}{arch[1]}"
    if isinstance(cfg, TmaConfig):
        if arch[0] != 9:
            raise ValueError(f"{cfg}: the TMA kernel needs an sm_90 GPU, got sm_{sm}")
        defines = dict(MT=cfg.mt, NT=nt, CW=cfg.cw, STAGES=cfg.stages, Q8=int(q8), AHEAD=int(cfg.ahead), WG=int(cfg.wg),
                       XCP=int(cfg.xcp), SK=int(cfg.sk > 0), XBOX=int(cfg.xbox))
        if cfg.wg:
            sm = "90a"  # wgmma is an sm_90a feature
    else:
        defines = dict(MT=cfg.mt, NT=nt, WK=cfg.wk, WR=cfg.wr, PIPE=cfg.pipe, Q8=int(q8), ASYNC=int(cfg.async_copy))
    return [f"-gencode=arch=compute_{sm},code=sm_{sm}", "-O3", "-std=c++17", f"-I{COMMON.parent}",
            *(f"-DW12_{k}={v}" for k, v in defines.items())]


def build(cfg: MmaConfig | TmaConfig, nt: int, q8: bool, arch: tuple[int, int], *, out: str = "cubin") -> Path:
    """Compile `cfg` for `nt` token tiles, the exact or 8-bit view (`q8`) and compute capability
    `arch` (`out` "cubin" or "ptx"); cached on disk."""
    flags = _flags(cfg, nt, q8, arch)
    source, _ = _source(cfg)
    # the shared header is part of every kernel's cache key
    return compile_cached(source, flags, subdir="w12_cuda", name=f"{source.stem}-{cfg.tag()}-nt{nt}-q{int(q8)}-sm{arch[0]}{arch[1]}",
                          extra=COMMON.read_bytes(), out=out, error=CudaBuildError)


# --------------------------------------------------------------------------------------
# Driver API
# --------------------------------------------------------------------------------------


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch for the W12 kernels: opt-in with SPECPILOT_PDL=1, sm_90+ only.
    The kernels then overlap their start (the TMA kernel: its first weight stages) with the previous
    kernel's tail, and read x / write out / touch the split-K workspace only after
    `griddepcontrol.wait`. Off by default: on the H200 it made the 64-layer decode step slower
    (12.70 vs 11.55 ms, perf/results/h200/20261130T191401-linear-w12-pdl.*). Precondition when on:
    the kernel launched immediately before does not write the weight planes."""
    if os.environ.get("SPECPILOT_PDL", "0") != "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 9


_FUNCS = FunctionCache()  # loaded kernels by (config, n-tiles, q8, device)


def _tma_stage_bytes(cfg: TmaConfig, nt: int, q8: bool) -> int:
    raw = cfg.rows * 64 + (0 if q8 else cfg.rows * 32) + 8 * nt * (128 if cfg.xbox else 144)
    return -(-raw // 1024) * 1024


def smem_bytes(cfg: MmaConfig | TmaConfig, nt: int, q8: bool) -> int:
    """Dynamic shared memory of one CTA. MmaConfig: the partial sums (and escape ranges), or the
    cp.async ring when that is larger (they share the memory). TmaConfig: the ring (1024-byte
    aligned stages, plus 1024 bytes of alignment slack) and two mbarriers per stage."""
    if isinstance(cfg, TmaConfig):
        ring = cfg.stages * _tma_stage_bytes(cfg, nt, q8) + 1024
        if cfg.wg:  # barriers in a 1 KiB slot, then two permuted-x buffers per warpgroup
            return ring + 1024 + (cfg.cw // 4) * 2 * 8 * nt * 128
        return ring + 16 * cfg.stages
    threads = 32 * cfg.wk * cfg.wr
    red = threads * cfg.mt * nt * 4 * 4 + 16 * cfg.mt * cfg.wr * 4 * 4
    if not cfg.async_copy:
        return red
    pieces = 2 * cfg.mt * (1 if q8 else 2) + 2 * nt
    return max(red, cfg.pipe * pieces * 16 * threads)


def sk_sm_count(device: torch.device) -> int:
    """Multiprocessors a stream-K grid is sized for (TmaConfig.sk CTAs per SM)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _function(cfg: MmaConfig, nt: int, q8: bool, device: torch.device) -> tuple[ctypes.c_void_p, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _FUNCS.get_or_make((cfg, nt, q8, idx), lambda: _load(cfg, nt, q8, idx))


def _load(cfg: MmaConfig, nt: int, q8: bool, idx: int) -> tuple[ctypes.c_void_p, int]:
    arch = torch.cuda.get_device_capability(idx)
    image = build(cfg, nt, q8, arch).read_bytes()
    smem = smem_bytes(cfg, nt, q8)
    limit = torch.cuda.get_device_properties(idx).shared_memory_per_block_optin
    if smem + _STATIC_SMEM > limit:
        raise ValueError(f"{cfg} needs {smem} bytes of shared memory per CTA at nt={nt}; this GPU allows "
                         f"{limit}: use fewer pipe stages or warps")
    _, fn = load_kernel(image, _source(cfg)[1], idx)
    if smem + _STATIC_SMEM > _SMEM_DEFAULT_MAX:  # dynamic + static must fit the raised limit
        allow_dynamic_smem(fn, smem)
    return fn, smem


def tma_available(device: torch.device | None = None) -> bool:
    """`available()` on an sm_90 GPU: the TMA kernel (TmaConfig) can run."""
    if not available(device):
        return False
    idx = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.cuda.get_device_capability(idx)[0] == 9


def unsupported(x2d: torch.Tensor, hi: torch.Tensor) -> str | None:
    """Why these inputs cannot run on the CUDA kernels as they are (None: they can). Device and
    toolchain are `available()`'s question."""
    if x2d.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x2d.dtype}"
    if not 0 < x2d.shape[0] <= MAX_M:
        return f"1 <= M <= {MAX_M} rows of x, got M={x2d.shape[0]}"
    if not hi.is_contiguous():
        return "the hi plane must be contiguous"
    return None


def _x_operand(x2d: torch.Tensor, Kp: int) -> tuple[torch.Tensor, int]:
    """x as the kernel reads it: 16-byte aligned rows with Kp readable columns, zero past K."""
    M, K = x2d.shape
    ok = (K == Kp and x2d.stride(1) == 1 and x2d.stride(0) % 8 == 0 and x2d.data_ptr() % 16 == 0)
    if ok:
        return x2d, x2d.stride(0)
    xp = torch.zeros((M, Kp), device=x2d.device, dtype=x2d.dtype)
    xp[:, :K] = x2d
    return xp, Kp


_WS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, stream: int, floats: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials and arrival counters, one pair per (device, stream) so that launches on
    different streams never share them; grown on demand. The counters start at zero and every
    launch leaves them at zero, so CUDA-graph replays need no memset."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
    hit = _WS.get(key)
    if hit is None or hit[0].numel() < floats or hit[1].numel() < blocks:
        old = (0, 0) if hit is None else (hit[0].numel(), hit[1].numel())
        hit = (torch.empty(max(floats, old[0]), device=device, dtype=torch.float32),
               torch.zeros(max(blocks, old[1]), device=device, dtype=torch.int32))
        _WS[key] = hit
    return hit


_TMAPS: dict[tuple, ctypes.Array] = {}


def _tensor_map(t: torch.Tensor, box_cols: int, box_rows: int, *, swizzle: bool = False) -> ctypes.Array:
    """2-D tensor map (TMA descriptor, 128 bytes) of `t` [rows, cols] (a uint8 plane, or 16-bit x;
    columns contiguous, rows may be strided), box `box_cols` x `box_rows`, out-of-bounds rows read
    as zeros; `swizzle`: TMA's 128-byte swizzle (box rows of 128 bytes). It depends only on
    (address, shape, row stride, element size, box, swizzle), so it is cached under that key."""
    rows, cols = t.shape
    elem = t.element_size()
    key = (t.data_ptr(), rows, cols, t.stride(0), elem, box_cols, box_rows, swizzle)
    m = _TMAPS.get(key)
    if m is None:
        m = (ctypes.c_uint64 * 16)()
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(t.stride(0) * elem)
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        unit = (ctypes.c_uint32 * 2)(1, 1)
        # dtype UINT8 (0) / UINT16 (1), interleave none (0), swizzle none (0) / 128 B (3), L2 promotion
        # 256 B (3), no NaN fill (0)
        _check(_libcuda().cuTensorMapEncodeTiled(ctypes.byref(m), {1: 0, 2: 1}[elem], 2, ctypes.c_void_p(t.data_ptr()),
                                                 dims, strides, box, unit, 0, 3 if swizzle else 0, 3, 0),
               "cuTensorMapEncodeTiled")
        if len(_TMAPS) >= 4096:
            _TMAPS.clear()
        _TMAPS[key] = m
    return m


def launch(cfg: MmaConfig | TmaConfig, x2d, hi, lo, e0, rowptr, col, val, bias, out, *, q8: bool = False,
           trace: torch.Tensor | None = None) -> None:
    """out[M, N] = x2d @ W^T (+ bias), W exact or its 8-bit view (`q8`), on torch's current stream.
    `trace` (diagnostic, perf/w12_trace_probe.py): an int64 tensor of 8 per CTA that a TMA cubin
    built with -DW12_TRACE=1 fills with %globaltimer stamps; plain TmaConfig with split = 1 only."""
    M = x2d.shape[0]
    N, Kp = hi.shape
    nt = n_tiles(M)
    fn, smem = _function(cfg, nt, q8, x2d.device)
    tma = isinstance(cfg, TmaConfig)
    rows = cfg.rows if tma else 16 * cfg.mt * cfg.wr
    grid = -(-N // rows)
    stream = torch.cuda.current_stream(x2d.device).cuda_stream
    ws, cnt = (None, None)
    if cfg.split > 1:
        ws, cnt = _workspace(x2d.device, stream, grid * cfg.split * rows * 8 * nt, grid)
    elif tma and cfg.sk:
        # stream-K: sk CTAs per SM share the grid * Kp / 64 units; two partial slots per CTA, a counter per row block
        ctas = min(grid * (Kp // 64), cfg.sk * sk_sm_count(x2d.device))
        ws, cnt = _workspace(x2d.device, stream, ctas * 2 * rows * 8 * nt, grid)
        grid = ctas
    if trace is not None:
        if not tma or cfg.split > 1 or cfg.sk or cfg.wg or cfg.ahead:
            raise ValueError(f"trace takes a plain TmaConfig with split=1, got {cfg}")
        if trace.dtype != torch.int64 or trace.numel() < 8 * grid:
            raise ValueError(f"trace needs an int64 tensor of >= {8 * grid} elements")
        ws = trace
    xk, ldx = _x_operand(x2d, Kp)
    kind = 0 if bias is None else _BIAS_KIND[bias.dtype]
    tail = [
        ctypes.c_void_p(0 if bias is None else bias.data_ptr()), ctypes.c_int(kind),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int(M), ctypes.c_int(N), ctypes.c_int(Kp),
        ctypes.c_void_p(0 if ws is None else ws.data_ptr()), ctypes.c_void_p(0 if cnt is None else cnt.data_ptr()),
    ]
    esc = [ctypes.c_void_p(e0.data_ptr()), ctypes.c_void_p(rowptr.data_ptr()), ctypes.c_void_p(col.data_ptr()),
           ctypes.c_void_p(val.data_ptr())]
    if tma:
        tm_hi = _tensor_map(hi, 64, rows)
        tm_lo = tm_hi if q8 else _tensor_map(lo, 32, rows)
        tm_x = [_tensor_map(xk[:, :Kp], 64, 8 * nt, swizzle=True)] if cfg.xbox else []
        vals = [tm_hi, tm_lo, *tm_x, ctypes.c_void_p(xk.data_ptr()), ctypes.c_longlong(ldx), *esc, *tail]
        threads = 32 * (cfg.cw + 1)
    else:
        vals = [ctypes.c_void_p(xk.data_ptr()), ctypes.c_longlong(ldx), ctypes.c_void_p(hi.data_ptr()),
                ctypes.c_void_p(lo.data_ptr()), *esc, *tail]
        threads = 32 * cfg.wk * cfg.wr
    _launch_kernel(fn, (grid, cfg.split, 1), threads, smem, stream, vals, pdl=pdl_enabled(x2d.device),
                   what=f"cuLaunchKernel({_source(cfg)[1].decode()})")
