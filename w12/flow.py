"""Launch layer of the flow kernel (`w12_matmul_flow_kernel`, csrc/w12_flow.cu, `FlowConfig`): its builds, the
runtime layout it reads (w12/layout.py) and its launch.

The kernel is opt-in: `autotune.force("w12.matmul", config=FlowConfig(...))` runs it inside `w12.matmul` (through
`w12.cuda.launch`), which builds the runtime layout of a weight on its first call and keeps it beside the weight's
planes (12 bits per weight more device memory) until those planes are freed or changed in place. A caller that holds
the layout itself (`w12.layout.tile(packed)`) launches with `launch_tiled`.

Ladder builds. `STEPS` names the feature defines of the five steps of docs/w12-kernels.md ("The flow kernel"):
"a" stream and decode (mma.sync against a constant B, as the probe), "b" + x, "c" + the epilogue, "d" + escapes,
"e" + the K-split reduction (the full kernel, the only step `launch` runs unless told otherwise). Steps "a" and "b"
write no output; "c" and "d" give the product only with kw = 1 ("c" without the escapes' correction).
`ABLATIONS` are builds for timing only, each a step with one part taken out (perf/w12_ladder.py --ablate): "-xfixed"
with every unit reading the first unit's x (wrong results; it prices the x traffic). The warpgroup build (`wg`) has
steps of its own (perf/w12_ladder.py --wg-probe): `WG_VARIANTS` "e-depth1", each unit's wgmma waited for before the
next, and "e-stm", x staged through stmatrix (both the same result bit for bit), and `WG_ABLATIONS`, for timing only: "e-nosync" without the proxy fence and the
barrier per unit, "e-noxcopy" with x staged for the first unit only.

Everything here is host code: `spec`, `build`, `smem_bytes` and `grid` run without a GPU (NVRTC).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch

from autotune import jit

from .configs import FlowConfig
from .cuda import load_with_smem
from .layout import TiledW12, tile
from .format import W12Weight, _codes, _to_int16, padded_k, unpack

__all__ = ["SOURCE", "KERNEL", "STEPS", "ABLATIONS", "WG_VARIANTS", "WG_ABLATIONS", "MAX_M", "WG_MAX_M", "MAX_KP", "n_tiles",
           "spec", "build", "smem_bytes", "grid", "tiled", "launch", "full_rows", "launch_tiled",
           "ladder_weight", "PDL_MAX_M"]

SOURCE = Path(__file__).with_name("csrc") / "w12_flow.cu"
KERNEL = "w12_matmul_flow_kernel"
MAX_M = 32
# the warpgroup build's 5-8 token tiles: 33-64 rows in one launch (opt-in: `launch_tiled` with a `wg` config;
# w12.matmul_tiled keeps its 32-row pieces until they are measured on a GPU)
WG_MAX_M = 64
MAX_KP = 1 << 18  # the scale identity assumes Kp <= 2^18
# programmatic dependent launch by default up to this many tokens: at M = 16 it cost the 5120-row layers 12% on the
# H200 (o_proj, out_proj: 23.8-23.9 µs with it, 20.8-21.4 without), within 2% elsewhere (docs/w12-kernels.md)
PDL_MAX_M = 8
TILE = 1536
STEPS: dict[str, dict[str, int]] = {
    "a": dict(W12F_X=0, W12F_EPI=0, W12F_ESC=0, W12F_RED=0),
    "b": dict(W12F_X=1, W12F_EPI=0, W12F_ESC=0, W12F_RED=0),
    "c": dict(W12F_X=1, W12F_EPI=1, W12F_ESC=0, W12F_RED=0),
    "d": dict(W12F_X=1, W12F_EPI=1, W12F_ESC=1, W12F_RED=0),
    "e": dict(W12F_X=1, W12F_EPI=1, W12F_ESC=1, W12F_RED=1),
}
ABLATIONS: dict[str, dict[str, int]] = {
    "b-xfixed": STEPS["b"] | dict(W12F_XSTEP=0),
    "e-xfixed": STEPS["e"] | dict(W12F_XSTEP=0),
}
WG_VARIANTS: dict[str, dict[str, int]] = {"e-depth1": STEPS["e"] | dict(W12F_WG_DEPTH=1),
                                          "e-stm": STEPS["e"] | dict(W12F_WG_STM=1)}
WG_ABLATIONS: dict[str, dict[str, int]] = {
    "e-nosync": STEPS["e"] | dict(W12F_WG_FENCE=0, W12F_WG_BAR=0),
    "e-noxcopy": STEPS["e"] | dict(W12F_WG_XCOPY=0),
}
_ALL_STEPS = STEPS | ABLATIONS | WG_VARIANTS | WG_ABLATIONS
_BIAS_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_STATIC_SMEM = 256  # the kernel's own __shared__ x-range slots (8 bytes per warp), with room to spare


def n_tiles(M: int, wg: bool = False) -> int:
    """Token tiles of 8 compiled for M: ceil(M / 8), 1..4 (`wg`, the warpgroup build: 1..8)."""
    top = WG_MAX_M if wg else MAX_M
    if not 0 < M <= top:
        raise ValueError(f"w12.flow.n_tiles: the flow kernel takes 1 <= M <= {MAX_M} (the warpgroup build "
                         f"{WG_MAX_M}), got M={M}{' with a mma.sync config' if M <= WG_MAX_M else ''}")
    return -(-M // 8)


def _check_step(step: str) -> dict[str, int]:
    if step not in _ALL_STEPS:
        raise ValueError(f"w12.flow: step must be one of {sorted(_ALL_STEPS)}, got {step!r}")
    return _ALL_STEPS[step]


def spec(cfg: FlowConfig, nt: int, arch: tuple[int, int], *, step: str = "e",
         defines: Mapping[str, object] | None = None, q8: bool = False) -> jit.Spec:
    """The build of `cfg` for `nt` token tiles and compute capability `arch`, at ladder `step`; `defines` add to
    (or override) the config's W12F_* defines; `q8`: the 8-bit view's build (hi bytes only, exact base)."""
    if not isinstance(cfg, FlowConfig):
        raise TypeError(f"w12.flow.spec: expected a FlowConfig, got {type(cfg).__name__}")
    if not 1 <= nt <= (8 if cfg.wg else 4):
        raise ValueError(f"w12.flow.spec: nt must be 1..4 token tiles (1..8 in the warpgroup build), got {nt} for "
                         f"{cfg.tag()}")
    if nt > 4 and (step in WG_VARIANTS or step in WG_ABLATIONS):
        raise ValueError(f"w12.flow.spec: 5..8 token tiles build the shipped warpgroup steps only, got step {step!r}")
    if q8 and cfg.fixed:
        raise ValueError(f"w12.flow.spec: the 8-bit view builds on the exact base only; {cfg.tag()} asks for the "
                         "fixed base (use fixed=False)")
    if cfg.wg and tuple(arch) != (9, 0):
        raise ValueError(f"w12.flow.spec: {cfg.tag()} is the warpgroup build (wgmma), which needs sm_90; this GPU is "
                         f"sm_{arch[0]}{arch[1]} (use wg=False)")
    if not cfg.wg and (step in WG_VARIANTS or step in WG_ABLATIONS):
        raise ValueError(f"w12.flow.spec: step {step!r} is a step of the warpgroup build; {cfg.tag()} is not one "
                         "(use wg=True)")
    if cfg.wg and _check_step(step)["W12F_X"] == 0:
        raise ValueError(f"w12.flow.spec: {cfg.tag()} (the warpgroup build) multiplies x from shared memory; ladder "
                         f"step {step!r} reads no x (use a step from 'b' on)")
    if cfg.kc > 1 and not cfg.kg and tuple(arch) < (9, 0):
        raise ValueError(f"w12.flow.spec: {cfg.tag()} splits K across the CTAs of a thread-block cluster, which needs "
                         f"sm_90; this GPU is sm_{arch[0]}{arch[1]} (use kc=1)")
    merged = _defines(cfg, nt, step, defines, q8)
    if cfg.kc > 1 and not merged["W12F_RED"]:
        raise ValueError(f"w12.flow.spec: {cfg.tag()} (a K split across CTAs) builds only with the reduction, step "
                         f"'e'; got step {step!r}")
    target = jit.arch_name(arch, wgmma=cfg.wg)
    # the kernel checks its shared-memory layout against the bytes the launch gives it (a static_assert)
    merged["W12F_SMEM"] = _smem(merged)
    return jit.Spec(SOURCE, KERNEL, target, merged,
                    name=f"{SOURCE.stem}-{cfg.tag()}{'-q8' if q8 else ''}-nt{nt}-{step}-{target}")


def _defines(cfg: FlowConfig, nt: int, step: str, defines: Mapping[str, object] | None, q8: bool = False
             ) -> dict[str, int]:
    """The W12F_* defines of a build: the config's, the step's, then SPECPILOT_W12F_DEFINES, then `defines`."""
    base = dict(W12F_WARPS=cfg.warps, W12F_KW=cfg.kw, W12F_STAGES=cfg.stages, W12F_CPS=cfg.cps, W12F_NT=nt,
                W12F_FIXED=int(cfg.fixed), W12F_EVICT=int(cfg.evict), W12F_RB=cfg.rb, W12F_KC=cfg.kc,
                W12F_Q8=int(q8), W12F_WG=int(cfg.wg), W12F_XD=cfg.xd, W12F_KG=int(cfg.kg), W12F_LATE=int(cfg.late),
                W12F_ESCX=int(cfg.escx), W12F_XH=int(cfg.xh), **_check_step(step))
    if cfg.xs:  # (a define only where on: the other builds' sources stay as they were)
        base |= dict(W12F_XRING=1)
    return base | _env_defines() | dict(defines or {})


def _env_defines() -> dict:
    """SPECPILOT_W12F_DEFINES="W12F_NAME=value,...": defines added to every flow build of the process, for an A/B of
    a kernel feature inside a whole program (the engine's step); a call's `defines` still win."""
    env = os.environ.get("SPECPILOT_W12F_DEFINES", "").strip()
    out = {}
    for item in filter(None, (p.strip() for p in env.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("W12F_") or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"SPECPILOT_W12F_DEFINES: expected W12F_NAME=integer items separated by commas, got "
                             f"{item!r}")
        out[name.strip()] = int(value)
    return out


def build(cfg: FlowConfig, nt: int, arch: tuple[int, int], *, step: str = "e",
          defines: Mapping[str, object] | None = None, q8: bool = False) -> jit.Build:
    """Compile `spec(...)` (cached on disk): the CUBIN, PTX and NVRTC log (`Build.resources()`). Raises
    autotune.BuildError."""
    return spec(cfg, nt, arch, step=step, defines=defines, q8=q8).compile()


def smem_bytes(cfg: FlowConfig, nt: int, step: str = "e", defines: Mapping[str, object] | None = None) -> int:
    """Dynamic shared memory of one CTA: a ring of `stages` slots of `rb` tiles per warp, the K-split partials (step
    "e", kw > 1: 512 bytes per warp, row block of the warp and token tile), with a K split across CTAs (kc > 1) the
    sums rank 0 receives from the other kc - 1 CTAs (512 bytes per row block and token tile each), and for 3-4 token
    tiles with the escapes the stash of their metadata (1 KB per row block), for the warpgroup build (`wg`) an x
    ring per warpgroup (3 slots of 1 KB per token tile), with `escx` (or W12F_ESCX in `defines` or
    SPECPILOT_W12F_DEFINES) x at each row's first escape column (512 bytes per row block and token tile), and with
    `xs` an x ring per K piece (`stages` slots of 1 KB per token tile); with `xs` in a cluster, rank 0 receives the
    other CTAs' sums in its rings (free after the main loop) where they fit. Read off the build's own defines (the
    step's, SPECPILOT_W12F_DEFINES, `defines`); the kernel asserts at compile time that its layout ends there."""
    return _smem(_defines(cfg, nt, step, defines))


def _smem(d: Mapping[str, int]) -> int:
    """`smem_bytes` of a build's defines, in the kernel's order: weight rings, x rings (xs), KW shares, the other
    CTAs' sums (unless in the rings), the escape stash, the warpgroup's x rings, x at the first escapes."""
    def v(name: str) -> int:  # (a call's `defines` may give strings; W12F_XRING is set only where on)
        return int(d.get("W12F_XRING", 0) if name == "XRING" else d[f"W12F_{name}"])

    warps, kw, nt, rb, kc, stages = v("WARPS"), v("KW"), v("NT"), v("RB"), v("KC"), v("STAGES")
    wg, esc = v("WG") != 0, v("ESC") != 0
    row_blocks = warps // kw * rb
    xs = kw * stages * nt * 1024 if not wg and v("X") and v("XRING") else 0
    rings = warps * stages * rb * TILE + xs
    red = warps * rb * nt * 512 if v("RED") and kw > 1 else 0
    cred = (kc - 1) * row_blocks * nt * 512 if kc > 1 and not v("KG") else 0
    if xs and cred <= rings:
        cred = 0  # rank 0's rings hold the other CTAs' sums once its main loop is done
    stash = row_blocks * 1024 if esc and nt > 2 else 0
    xring = warps // 4 * 3 * nt * 1024 if wg else 0
    escx = row_blocks * nt * 512 if esc and v("ESCX") else 0
    return rings + red + cred + stash + xring + escx


def grid(cfg: FlowConfig, N: int) -> int:
    """CTAs of a launch: `cfg.kc` (one cluster, or with `kg` a group meeting in global memory) per `cfg.row_blocks`
    row blocks of 16 rows."""
    return -(-(-(-N // 16)) // cfg.row_blocks) * cfg.kc


# --------------------------------------------------------------------------------------
# The runtime layout of the planes w12.matmul passes
# --------------------------------------------------------------------------------------

_LAYOUTS: dict[int, tuple] = {}


def tiled(hi: torch.Tensor, lo: torch.Tensor, e0, rowptr, col, val, K: int) -> TiledW12:
    """The runtime layout of these version-1 planes, built on first use and kept while `hi` lives and neither `hi`
    nor `lo` changes (their data pointers and torch version counters are part of the check)."""
    return _tiled(hi, lo, e0, rowptr, col, val, K)[0]


def _tiled(hi, lo, e0, rowptr, col, val, K: int) -> tuple[TiledW12, bool]:
    """`tiled`, and whether this call built the layout (its kernels are then the last ones in the stream)."""
    built = False
    key = id(hi)
    stamp = (hi.data_ptr(), hi._version, lo.data_ptr(), lo._version, tuple(hi.shape), int(K))
    hit = _LAYOUTS.get(key)
    if hit is None or hit[0]() is not hi or hit[1] != stamp:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        t = tile(W12Weight(hi, lo, e0, rowptr, col, val, K))
        _LAYOUTS[key] = hit = (weakref.ref(hi, lambda _r, k=key: _LAYOUTS.pop(k, None)), stamp, t.tiles)
        built = True
    return TiledW12(hit[2], e0, rowptr, col, val, hi.shape[0], K), built


# --------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------

_KERNELS = jit.FunctionCache()
_SINKS: dict[int, torch.Tensor] = {}
_TYPES = (jit.PTR, jit.I64, jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.I32, jit.PTR, jit.I32, jit.I32,
          jit.I32, jit.PTR, jit.PTR, jit.PTR)
# the K split through global memory (FlowConfig.kg): per device and stream, a float workspace and the row groups'
# counters (zero between launches: the kernel sets them back), grown when a launch needs more; a grown-out pair stays
# allocated, as a captured CUDA graph may still hold its addresses
_SPLIT: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_SPLIT_OLD: list[tuple[torch.Tensor, torch.Tensor]] = []


def _split_buffers(cfg: FlowConfig, nt: int, ctas: int, device: torch.device, idx: int, stream: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace and counters of a launch of `ctas` CTAs (kg): one slot per CTA and a counter per kc CTAs."""
    slots, need_cnt = ctas, ctas // cfg.kc
    need_ws = slots * cfg.row_blocks * nt * 128
    have = _SPLIT.get((idx, stream))
    if have is None or have[0].numel() < need_ws or have[1].numel() < need_cnt:
        if have is not None:
            _SPLIT_OLD.append(have)
        size_ws = max(need_ws, 0 if have is None else have[0].numel())
        size_cnt = max(need_cnt, 0 if have is None else have[1].numel())
        have = _SPLIT[idx, stream] = (torch.empty(size_ws, device=device, dtype=torch.float32),
                                      torch.zeros(size_cnt, device=device, dtype=torch.int32))
    return have


def _kernel(cfg: FlowConfig, nt: int, step: str, idx: int, defines: tuple, smem: int | None,
            q8: bool = False) -> tuple[jit.Kernel, int]:
    def make():
        return load_with_smem("w12.flow", cfg, nt, idx, smem_bytes(cfg, nt, step, dict(defines)), smem, _STATIC_SMEM,
                              lambda arch: spec(cfg, nt, arch, step=step, defines=dict(defines), q8=q8),
                              "stages or warps")

    return _KERNELS.get_or_make((cfg, nt, step, idx, defines, smem, q8), make)


def _x_operand(x2d: torch.Tensor, Kp: int) -> tuple[torch.Tensor, int]:
    """x as the kernel reads it: 16-byte aligned rows with Kp = 64 ceil(K / 64) readable columns, zero past K."""
    M, K = x2d.shape
    if K == Kp and x2d.stride(1) == 1 and x2d.stride(0) % 8 == 0 and x2d.data_ptr() % 16 == 0:
        return x2d, x2d.stride(0)
    xp = torch.zeros((M, Kp), device=x2d.device, dtype=x2d.dtype)
    xp[:, :K] = x2d
    return xp, Kp


def full_rows(N: int, nt: int) -> bool:
    """Whether `launch_tiled` builds with every row block full (W12F_FULL: a lane's copies at fixed offsets from one
    pointer; docs/w12-kernels.md, "Full row blocks"): N a multiple of 16 and 2-4 token tiles. At one token tile that
    build's fewer registers let more CTAs share an SM, which measured slower on the H200 (gate_up's 8-bit view at
    M = 1 and 8 by 7 and 14%)."""
    return N % 16 == 0 and nt >= 2


def launch_tiled(cfg: FlowConfig, x2d: torch.Tensor, t: TiledW12, bias: torch.Tensor | None, out: torch.Tensor, *,
                 step: str = "e", defines: Mapping[str, object] | None = None, smem: int | None = None,
                 q8: bool = False, pdl: bool | None = None, pdl_rows: int = PDL_MAX_M,
                 trace: torch.Tensor | None = None, swiglu: bool = False) -> None:
    """out[M, N] = x2d @ W^T (+ bias) from the runtime layout `t`, on torch's current stream (CUDA-graph capturable
    once the kernel is loaded). `step`: a ladder build (module doc; "a" and "b" leave `out` unwritten).
    `defines` add to the build's defines; `smem`: dynamic shared memory per CTA, at least what the config needs;
    `q8`: the product with the 8-bit view (`w12.decode_q8`'s weight), reading each tile's hi bytes only. An fp32
    `out` takes the fp32 sums unrounded (the W12F_OUT32 build; a bf16 `out` holds them rounded once). Where N is
    a multiple of 16 and M > 8 the build takes every row block as full (W12F_FULL: the lane's copies at fixed
    offsets from one pointer); `defines` may turn that off ({"W12F_FULL": 0}), or on at M <= 8, not on elsewhere.
    `pdl`: programmatic dependent launch. The kernel then requests its first tiles, and reads e0 and the escapes,
    before the previous kernel in the stream has ended, so that kernel must not write `t`. Default: on where
    `w12.cuda.pdl_enabled` allows it (sm_90; the flow kernel's default is on), M <= `pdl_rows` (default PDL_MAX_M),
    and `t`'s tensors
    are unchanged since its last launch (their version counters): a layout's first launch, and the first after an
    in-place write to it, wait for the previous kernel to end.
    `trace`: a diagnostic build (W12F_TRACE, csrc/w12_flow.cu) that writes 8 int64 per CTA into this zeroed
    int64 tensor of at least 8 `grid(cfg, N)` elements: %globaltimer stamps (ns) at entry, after the PDL wait, when
    warp 0's first tile landed, the last main loop's end and the last exit (0, 2, 3, 4, 5), and the SM id (1).
    `swiglu`: `t` holds gate and up rows paired (`w12.pair_rows`) and `out` is bf16 [M, N / 2]: SwiGLU of the two
    (the W12F_SWIGLU build, csrc/w12_flow.cu; `w12.matmul_swiglu`)."""
    M, K = x2d.shape
    top = WG_MAX_M if cfg.wg else MAX_M
    if x2d.dtype != torch.bfloat16 or not 0 < M <= top or K != t.K or t.device != x2d.device:
        raise ValueError(f"w12.flow.launch_tiled: needs bf16 x [1..{top}, K={t.K}] on {t.device} for {cfg.tag()} "
                         f"(33..{WG_MAX_M} rows: the warpgroup build only), got {x2d.dtype} {tuple(x2d.shape)} on "
                         f"{x2d.device}")
    if padded_k(K) > MAX_KP:
        raise ValueError(f"w12.flow.launch_tiled: K <= {MAX_KP} columns, got K={K}")
    if swiglu:
        if t.N % 16:
            raise ValueError(f"w12.flow.launch_tiled: swiglu needs gate and up rows paired in 16-row blocks "
                             f"(w12.pair_rows), so N a multiple of 16, got N={t.N}")
        if tuple(out.shape) != (M, t.N // 2) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"w12.flow.launch_tiled: with swiglu, out must be a contiguous bf16 [{M}, {t.N // 2}] "
                             f"tensor, got {out.dtype} {tuple(out.shape)}")
        defines = dict(defines or {}) | {"W12F_SWIGLU": 1}
    elif tuple(out.shape) != (M, t.N) or out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous():
        raise ValueError(f"w12.flow.launch_tiled: out must be a contiguous bf16 or fp32 [{M}, {t.N}] tensor, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.dtype == torch.float32:
        defines = dict(defines or {}) | {"W12F_OUT32": 1}
    nt = n_tiles(M, cfg.wg)
    ctas = grid(cfg, t.N)
    if trace is not None:
        if trace.dtype != torch.int64 or trace.device != x2d.device or not trace.is_contiguous() or \
                trace.numel() < 8 * ctas:
            raise ValueError(f"w12.flow.launch_tiled: trace must be a contiguous int64 tensor of at least "
                             f"{8 * ctas} elements on {x2d.device}, got {trace.dtype} {tuple(trace.shape)} "
                             f"on {trace.device}")
        defines = dict(defines or {}) | {"W12F_TRACE": 1}
    full = full_rows(t.N, nt)
    if t.N % 16 and int((defines or {}).get("W12F_FULL", 0)):
        raise ValueError(f"w12.flow.launch_tiled: W12F_FULL needs N % 16 == 0, got N={t.N}")
    if full:
        defines = {"W12F_FULL": 1} | dict(defines or {})
    idx = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
    kernel, smem = _kernel(cfg, nt, step, idx, () if not defines else tuple(sorted(defines.items())), smem, q8)
    xk, ldx = _x_operand(x2d, padded_k(K))
    sink = trace if trace is not None else _SINKS.get(idx)
    if sink is None:
        sink = _SINKS[idx] = torch.zeros(32 * 16, device=x2d.device, dtype=torch.float32)
    stream = torch.cuda.current_stream(x2d.device).cuda_stream
    ws = cnt = None
    if cfg.kg and _check_step(step)["W12F_RED"]:  # the builds that meet in the workspace
        ws, cnt = _split_buffers(cfg, nt, ctas, x2d.device, idx, stream)
    values = (xk.data_ptr(), ldx, t.tiles.data_ptr(), t.e0.data_ptr(), t.esc_rowptr.data_ptr(), t.esc_col.data_ptr(),
              t.esc_val.data_ptr(), 0 if bias is None else bias.data_ptr(), 0 if bias is None else _BIAS_KIND[bias.dtype],
              out.data_ptr(), M, t.N, K, sink.data_ptr(), 0 if ws is None else ws.data_ptr(),
              0 if cnt is None else cnt.data_ptr())
    if pdl is None:
        from .cuda import pdl_enabled

        pdl = M <= pdl_rows and t._launched == t.versions() and pdl_enabled(x2d.device, default=True)
    t._launched = t.versions()
    kernel.launch((ctas, 1, 1), 32 * cfg.warps, smem, stream, values, _TYPES, pdl=pdl)


def launch(cfg: FlowConfig, x2d, hi, lo, e0, rowptr, col, val, bias, out, *, q8: bool = False,
           defines: Mapping[str, object] | None = None, smem: int | None = None) -> None:
    """`w12.cuda.launch` for a FlowConfig: the product from the version-1 planes, through their cached runtime
    layout (`tiled`); `q8`: with the 8-bit view (hi bytes only; the exact base: a fixed-base config is refused)."""
    if q8 and cfg.fixed:
        raise ValueError(f"w12.flow: the 8-bit view builds on the exact base only; {cfg.tag()} asks for the fixed "
                         "base (force FlowConfig(fixed=False) for w12.matmul_q8)")
    t, built = _tiled(hi, lo, e0, rowptr, col, val, x2d.shape[1])
    if not built:  # a cached layout, its planes unchanged since it was built (the cache's stamp): launched before
        t._launched = t.versions()
    launch_tiled(cfg, x2d, t, bias, out, defines=defines, smem=smem, q8=q8)


def ladder_weight(packed: W12Weight, step: str = "e") -> torch.Tensor | None:
    """The BF16 weight [N, K] whose product a ladder build computes, for checking it: steps "d" and "e" the weight
    itself (`w12.unpack`); step "c" the dense decode alone, every code 0 read as 2^(e0 - 127) (+0.0 where e0 = 0)
    and no escape applied; steps "a" and "b" compute none (None). "c" and "d" give it only with kw = 1."""
    if step not in STEPS:
        raise ValueError(f"w12.flow.ladder_weight: step must be one of {sorted(STEPS)} (an ablation computes no "
                         f"product to check), got {step!r}")
    if step in ("a", "b"):
        return None
    if step != "c":
        return unpack(packed)
    code = _codes(packed.hi, packed.lo)[:, : packed.K]
    bits = ((code & 0x7FF) + (packed.e0.int().unsqueeze(1) << 7)) | ((code & 0x800) << 4)
    return _to_int16(bits).view(torch.bfloat16)
