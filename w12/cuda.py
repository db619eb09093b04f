"""The CUDA C++ W12 kernels: built with NVRTC and launched through the driver API (autotune.jit).

`csrc/w12_mma.cu` (`MmaConfig`, sm_80+): register-pipelined, weights read straight from the planes.
`csrc/w12_tma.cu` (`TmaConfig`, sm_90): warp-specialised, TMA streams the planes into an mbarrier
ring; its 2-D tensor maps are encoded on the host and cached per (address, shape, box).
Both include `csrc/w12_common.cuh` (the decode, the mma.sync step, PDL and bias helpers).

One CUBIN per specialisation (`spec()`: the config's fields and the token tiles become -D defines),
compiled on first use and cached on disk by autotune.jit (keyed by the sources, defines, options and
NVRTC version, so an edited kernel never reuses a stale binary). `defines=` adds or overrides
defines (diagnostic builds, e.g. {"W12_TRACE": 1}). Launches go to torch's current stream, so
CUDA-graph capture works; `torch.compile` sees the launch as the opaque custom op
`specpilot_w12::matmul_mma` (w12/ops.py).

Requirements: an NVIDIA GPU of compute capability >= 8.0 (mma.sync with bf16), its driver, and
cuda-python's NVRTC with the CUDA headers (pip wheels; no CUDA toolkit). `available()` says whether
they hold; w12.ops falls back to the Triton kernels otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from autotune import jit
from autotune.jit import BuildError, available, unavailable

from .configs import FlowConfig, MmaConfig, TmaConfig

__all__ = ["available", "unavailable", "tma_available", "spec", "build", "launch", "n_tiles", "unsupported",
           "smem_bytes", "pdl_enabled", "BuildError", "SOURCE", "KERNEL", "TMA_SOURCE", "TMA_KERNEL", "COMMON",
           "MAX_M", "MAX_KP"]

SOURCE = Path(__file__).with_name("csrc") / "w12_mma.cu"
KERNEL = "w12_matmul_mma_kernel"
TMA_SOURCE = Path(__file__).with_name("csrc") / "w12_tma.cu"  # sm_90: TMA ring + warp specialisation
TMA_KERNEL = "w12_matmul_tma_kernel"
COMMON = Path(__file__).with_name("csrc") / "w12_common.cuh"  # device code included by these two and the flow kernel
MAX_KP = 1 << 18  # unsupported()'s K limit: the flow kernel's fixed-base scale identity needs Kp <= 2^18 (flow.py)
MAX_M = 32  # 4 n-tiles of 8 tokens
_SMEM_DEFAULT_MAX = 48 << 10
_STATIC_SMEM = 64  # the kernel's own __shared__ variables (16 bytes), with room to spare
_BIAS_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def n_tiles(M: int) -> int:
    """Token tiles of 8 compiled for M (1, 2 or 4)."""
    if not 0 < M <= MAX_M:
        raise ValueError(f"w12.cuda.n_tiles: the CUDA W12 kernel takes 1 <= M <= {MAX_M}, got M={M}")
    return 1 if M <= 8 else 2 if M <= 16 else 4


def spec(cfg: MmaConfig | TmaConfig, nt: int, q8: bool, arch: tuple[int, int], *,
         defines: Mapping[str, object] | None = None) -> jit.Spec:
    """The build of `cfg` for `nt` token tiles, the exact or 8-bit view (`q8`) and compute capability
    `arch`; `defines` add to (or override) the config's W12_* defines."""
    if isinstance(cfg, TmaConfig):
        if arch[0] != 9:
            raise ValueError(f"w12.cuda.spec: {cfg} is the TMA kernel, which needs an sm_90 GPU, "
                             f"got sm_{arch[0]}{arch[1]}")
        base = dict(MT=cfg.mt, NT=nt, CW=cfg.cw, STAGES=cfg.stages, Q8=int(q8), AHEAD=int(cfg.ahead), WG=int(cfg.wg),
                    XCP=int(cfg.xcp), SK=int(cfg.sk > 0), XBOX=int(cfg.xbox))
        source, kernel = TMA_SOURCE, TMA_KERNEL
    else:
        base = dict(MT=cfg.mt, NT=nt, WK=cfg.wk, WR=cfg.wr, PIPE=cfg.pipe, Q8=int(q8), ASYNC=int(cfg.async_copy))
        source, kernel = SOURCE, KERNEL
    merged = {f"W12_{k}": v for k, v in base.items()} | dict(defines or {})
    target = jit.arch_name(arch, wgmma=isinstance(cfg, TmaConfig) and cfg.wg)
    return jit.Spec(source, kernel, target, merged,
                    name=f"{source.stem}-{cfg.tag()}-nt{nt}-q{int(q8)}-{target}")


def build(cfg: MmaConfig | TmaConfig, nt: int, q8: bool, arch: tuple[int, int], *, out: str = "cubin",
          defines: Mapping[str, object] | None = None) -> Path:
    """Compile `spec(cfg, nt, q8, arch, defines=defines)` (cached on disk) and return its file `out`
    (`autotune.jit.Spec.file`: "cubin", "ptx" or "log"). Raises autotune.BuildError."""
    return spec(cfg, nt, q8, arch, defines=defines).file(out)


# --------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------


def pdl_enabled(device: torch.device, default: bool = False) -> bool:
    """Programmatic dependent launch for a W12 kernel, sm_90+ only: SPECPILOT_PDL=1 turns it on for every W12
    kernel, SPECPILOT_PDL=0 off for every one, and unset leaves each launcher's `default`. A kernel so launched
    overlaps its start (the flow kernel: its first ring stages; the TMA kernel: its first weight stages) with the
    previous kernel's tail, and reads x / writes out / touches the split-K workspace only after
    `griddepcontrol.wait`. The flow kernel's launcher defaults to on (the 64-layer decode step on the H200: 9,890 to
    9,667 µs, docs/w12-kernels.md); the others to off (the `mma` kernel's decode step: 11,358 to 11,754 µs).
    Precondition when on: the kernel launched immediately before does not write the weight planes."""
    env = os.environ.get("SPECPILOT_PDL")
    if not (default if env is None else env == "1"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 9


_KERNELS = jit.FunctionCache()  # (kernel, dynamic smem) by (config, n-tiles, q8, device, defines, smem)


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


def _kernel(cfg, nt: int, q8: bool, device: torch.device, defines: tuple, smem: int | None) -> tuple[jit.Kernel, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _KERNELS.get_or_make((cfg, nt, q8, idx, defines, smem), lambda: _load(cfg, nt, q8, idx, defines, smem))


def _load(cfg, nt: int, q8: bool, idx: int, defines: tuple, smem: int | None) -> tuple[jit.Kernel, int]:
    return load_with_smem("w12.cuda", cfg, nt, idx, smem_bytes(cfg, nt, q8), smem, _STATIC_SMEM,
                          lambda arch: spec(cfg, nt, q8, arch, defines=dict(defines)), "pipe stages or warps")


def load_with_smem(op: str, cfg, nt: int, idx: int, need: int, smem: int | None, static: int, make_spec,
                   fewer: str) -> tuple[jit.Kernel, int]:
    """Load `make_spec(arch)` into device `idx` with `smem` (at least `need`) bytes of dynamic shared memory per CTA,
    raising the kernel's limit where dynamic + `static` passes the default 48 KB; refused with `op`'s message where
    the GPU allows less. Returns the kernel and its dynamic shared memory."""
    smem = need if smem is None else max(smem, need)
    limit = torch.cuda.get_device_properties(idx).shared_memory_per_block_optin
    if smem + static > limit:
        raise ValueError(f"{op}: {cfg} needs {smem} bytes of shared memory per CTA at nt={nt}; this GPU allows "
                         f"{limit}: use fewer {fewer}")
    kernel = make_spec(torch.cuda.get_device_capability(idx)).load(idx)
    if smem + static > _SMEM_DEFAULT_MAX:  # dynamic + static must fit the raised limit
        kernel.set_max_dynamic_smem(smem)
    return kernel, smem


def tma_available(device: torch.device | None = None) -> bool:
    """`available()` on an sm_90 GPU: the TMA kernel (TmaConfig) can run."""
    if not available(device):
        return False
    idx = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.cuda.get_device_capability(idx)[0] == 9


def unsupported(x2d: torch.Tensor, hi: torch.Tensor) -> str | None:
    """Why the CUDA kernels cannot take these inputs as they are (None: they can): bf16 x with
    1 <= M <= 32 and contiguous planes. The machine is `unavailable()`'s question."""
    if x2d.dtype != torch.bfloat16:
        return f"x must be bfloat16, got {x2d.dtype}"
    if not 0 < x2d.shape[0] <= MAX_M:
        return f"1 <= M <= {MAX_M} tokens, got M={x2d.shape[0]}"
    if not hi.is_contiguous():
        return "the weight planes must be contiguous"
    if hi.shape[1] > MAX_KP:
        return f"K <= {MAX_KP} columns, got Kp={hi.shape[1]}"
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


_TMAPS: dict[tuple, object] = {}


def _tensor_map(t: torch.Tensor, box_cols: int, box_rows: int, *, swizzle: bool = False):
    """2-D tensor map of `t` [rows, cols] (a uint8 plane, or 16-bit x; columns contiguous, rows may be
    strided), box `box_cols` x `box_rows` (autotune.jit.tensor_map_2d). It depends only on (address,
    shape, row stride, element size, box, swizzle), so it is cached under that key."""
    rows, cols = t.shape
    elem = t.element_size()
    key = (t.data_ptr(), rows, cols, t.stride(0), elem, box_cols, box_rows, swizzle)
    m = _TMAPS.get(key)
    if m is None:
        m = jit.tensor_map_2d(t.data_ptr(), elem, rows, cols, t.stride(0) * elem, box_cols, box_rows, swizzle=swizzle)
        if len(_TMAPS) >= 4096:
            _TMAPS.clear()
        _TMAPS[key] = m
    return m


_P, _I, _L, _T = jit.PTR, jit.I32, jit.I64, jit.BY_ADDRESS
_TAIL = (_P, _I, _P, _I, _I, _I, _P, _P)  # bias, kind, out, M, N, Kp, ws, counters
_ESC = (_P, _P, _P, _P)                    # e0, rowptr, col, val
_MMA_TYPES = (_P, _L, _P, _P) + _ESC + _TAIL
_TMA_TYPES = {xbox: (_T, _T) + (_T,) * xbox + (_P, _L) + _ESC + _TAIL for xbox in (0, 1)}


def launch(cfg: MmaConfig | TmaConfig, x2d, hi, lo, e0, rowptr, col, val, bias, out, *, q8: bool = False,
           trace: torch.Tensor | None = None, defines: Mapping[str, object] | None = None,
           smem: int | None = None) -> None:
    """out[M, N] = x2d @ W^T (+ bias), W exact or its 8-bit view (`q8`), on torch's current stream.
    `defines`: extra build defines (see `spec`). `smem`: dynamic shared memory per CTA, at least what
    the config needs (more leaves fewer CTAs per SM). `trace` (diagnostic): an int64 tensor of 8 per CTA
    that a build with defines={"W12_TRACE": 1} fills with %globaltimer stamps: plain TmaConfig with
    split = 1. A FlowConfig runs the flow kernel on the planes' runtime layout (w12/flow.py)."""
    if isinstance(cfg, FlowConfig):
        from . import flow

        return flow.launch(cfg, x2d, hi, lo, e0, rowptr, col, val, bias, out, q8=q8, defines=defines, smem=smem)
    M = x2d.shape[0]
    N, Kp = hi.shape
    nt = n_tiles(M)
    kernel, smem = _kernel(cfg, nt, q8, x2d.device, () if not defines else tuple(sorted(defines.items())), smem)
    tma = isinstance(cfg, TmaConfig)
    stream = torch.cuda.current_stream(x2d.device).cuda_stream
    ws, cnt = None, None
    rows = cfg.rows if tma else 16 * cfg.mt * cfg.wr
    grid = -(-N // rows)
    if cfg.split > 1:
        ws, cnt = _workspace(x2d.device, stream, grid * cfg.split * rows * 8 * nt, grid)
    elif tma and cfg.sk:
        # stream-K: sk CTAs per SM share the grid * Kp / 64 units; two partial slots per CTA, a counter per row block
        ctas = min(grid * (Kp // 64), cfg.sk * sk_sm_count(x2d.device))
        ws, cnt = _workspace(x2d.device, stream, ctas * 2 * rows * 8 * nt, grid)
        grid = ctas
    if trace is not None:
        if not tma or cfg.split > 1 or cfg.sk or cfg.wg or cfg.ahead:
            raise ValueError(f"w12.cuda.launch: trace takes a plain TmaConfig with split=1, got {cfg}")
        if trace.dtype != torch.int64 or trace.numel() < 8 * grid:
            raise ValueError(f"w12.cuda.launch: trace needs an int64 tensor of >= {8 * grid} elements")
        ws = trace
    xk, ldx = _x_operand(x2d, Kp)
    tail = (0 if bias is None else bias.data_ptr(), 0 if bias is None else _BIAS_KIND[bias.dtype], out.data_ptr(), M, N,
            Kp, 0 if ws is None else ws.data_ptr(), 0 if cnt is None else cnt.data_ptr())
    esc = (e0.data_ptr(), rowptr.data_ptr(), col.data_ptr(), val.data_ptr())
    if tma:
        tm_hi = _tensor_map(hi, 64, rows)
        tm_lo = tm_hi if q8 else _tensor_map(lo, 32, rows)
        tm_x = (_tensor_map(xk, 64, 8 * nt, swizzle=True),) if cfg.xbox else ()
        values = (tm_hi, tm_lo, *tm_x, xk.data_ptr(), ldx, *esc, *tail)
        types = _TMA_TYPES[int(cfg.xbox)]
        threads = 32 * (cfg.cw + 1)
    else:
        values = (xk.data_ptr(), ldx, hi.data_ptr(), lo.data_ptr(), *esc, *tail)
        types = _MMA_TYPES
        threads = 32 * cfg.wk * cfg.wr
    kernel.launch((grid, cfg.split, 1), threads, smem, stream, values, types, pdl=pdl_enabled(x2d.device))
