#!/usr/bin/env python3
"""The flow kernel's ladder (docs/w12-kernels.md, "The flow kernel") measured in one process on one GPU.

    python3 perf/w12_ladder.py                        # on the GPU machine, from the repository root (est. 1-3 min)
    python3 perf/w12_ladder.py --build-only --arch 90 # no GPU needed: NVRTC builds every specialisation a run launches

For gdn.in_proj (16480 x 5120), mlp.gate_up_proj (34816 x 5120) and attn.o_proj (5120 x 6144) of hybrid-27b at
M = 1 and 32, side by side in the same process:

  cublas    F.linear on the BF16 weight
  w12       w12.matmul as dispatched (the shipped default kernel)
  a .. e    the flow kernel's ladder at the heuristic's config (w12.configs.flow_heuristic), each build adding one
            feature: a stream + decode (mma.sync against a constant B: the probe), b + x, c + the epilogue (scale
            and its guard, bias, rounding, store), d + escapes, e + the K-split reduction (the whole kernel)
  e-fixed   step e with the fixed base (FlowConfig(fixed=True): 2 fewer integer ops a pair, plus the x-range fold,
            its barrier and the guard's scale)
  e@...     step e at other K splits, ring depths and CTA sizes, and with two row blocks per warp (rb = 2: one x
            fragment feeds 32 weight rows; 8 warps per SM, the registers of 4 token tiles) (--sweep, on by default)
  b-xfixed, e-xfixed   with --ablate: the heuristic's config reading the first unit's x for every unit (x
            always in L1), for timing only (w12.flow.ABLATIONS): it prices the x traffic

Checks before any timing (a figure is printed only when its check passed): step e of every timed config against
fp64 (specpilot.testing.assert_close, the tolerance derived from cuBLAS on the same inputs), and bit for bit against
its exact-base build (FlowConfig(fixed=False); for an exact-base config, a second run of itself); steps c and d
through their kw = 1 builds against the weight each computes (w12.flow.ladder_weight). Steps a and b compute no
product.

Timing: specpilot.bench.timing.time_cuda (CUDA graphs of many calls over rotated weight copies, so that L2 never
holds the weight; CUDA events around each replay; the median of --reps replays). Bytes: everything a call reads
and writes (weight bytes as stored, x, out); the copy rate is docs/w12-kernels.md's 4.28 TB/s.

`--q8` times the 8-bit view (`w12.matmul_q8`, the flow kernel's W12F_Q8 builds) instead of the full format: step e
of the heuristic's config for the view (`w12.configs.flow_config(q8=True)`) and of every other config (the ladder's
steps a-d and the fixed base are the full format's), each checked against fp64 on `w12.decode_q8`'s weight and bit
for bit against a second run; the default row is `w12.matmul_q8`.

`--wg-probe` times the warpgroup build (docs/w12-kernels.md, "The warpgroup build") instead of the ladder: for
in_proj, gate_up, o_proj and down_proj at M = 8, 16 and 32 (unless --layers and --m say otherwise), cuBLAS, the
default, step e at the heuristic's mma.sync config, and each warpgroup shape as shipped (two wgmma groups in flight)
and with `-depth1` and `-stm` (w12.flow.WG_VARIANTS: each unit's wgmma waited for before the next; x staged through
stmatrix; each checked against fp64 and bit for bit against the shipped build); with --ablate also `-nosync` (no proxy fence and no barrier per unit) and
`-noxcopy` (x staged for the first unit only), for timing only (w12.flow.WG_ABLATIONS, wrong results).

`--trace` times where a flow kernel's time goes instead of the ladder (docs/w12-kernels.md, "Where a launch's time
goes"): the W12F_TRACE build of each layer's config (`w12.configs.flow_config`, step e) stamps every CTA's entry, the
end of its programmatic-dependent-launch wait, warp 0's first tile, the last main loop's end and the last exit
(%globaltimer). Each layer runs alone (cold L2, after a sync) and in a chain of the layers in the order of a decoder
layer, twice over distinct weight copies, with programmatic dependent launch, as one CUDA graph (the engine's
order: in_proj, o_proj standing for out_proj, gate_up, down_proj). Per launch: the span from the first entry to the
last exit, the copy-rate time of its bytes, the overlap with the launch before, the median entry-to-first-tile,
loop and epilogue, and the tail (last exit less the median exit). Files: $OUT/w12-trace.json and $OUT/w12-trace.md.

`--ab CELLS` runs an interleaved A/B instead of the ladder. CELLS (JSON, or a file holding it) is a list of
[layer, M, candidates], a candidate [label, config tag, defines]: a `FlowConfig` tag ("" for the shipped config,
`w12.configs.flow_config` of the cell) and the W12F_* defines its build adds; layers are AB_LAYERS (hybrid-27b's
seven linears, the LM head among them), e.g.

    python3 perf/w12_ladder.py --ab '[["gate_up", 32, [["s4", "w4-k1-s4-c4-q2-g", {}], ["nosync", "", {"W12F_WG_BAR": 0, "W12F_WG_FENCE": 0}]]]]'

`--ab xh` and `--ab xs` are presets (`ab_preset`; `--ab xh,xs` runs both): x reloaded by halves and x through a
shared ring, on the layers and row counts given there.

M runs to 64: above 32 rows the shipped path is `w12.matmul_tiled`'s, one launch per 32-row piece, and every
candidate is a warpgroup config, built at 5-8 token tiles (`w12.flow.WG_MAX_M`) so that it takes the rows in one
launch.

Per cell: the weight `randn * 0.02` in bf16, packed and tiled (`weight_copies` of it, rotated), x
`randn`; the shipped config against cuBLAS, then each candidate against the shipped config, each pair interleaved
(`specpilot.bench.timing.time_ab`: CUDA graphs of the same calls, one replay a sample, A first in even rounds;
`--rounds`, default 20), medians. Each candidate's output is first checked against the fp32 product (its largest error
within twice cuBLAS's: `ok`; builds with a timing-only define of w12.flow's ablations are wrong by design) and compared with the
shipped output bit for bit (`same_bits_as_ship`); `ratio` is its median over the shipped config's in their pair. A
candidate that fails to build or launch is a row of the report. With `--build-only` it compiles every build of the
cells (the shipped configs as an sm_90 GPU with clusters and --sms SMs would pick them). File: $OUT/w12-ab.json.
With `--promote`, each cell of at most 32 rows then puts its fastest plain candidate (a config without defines,
within the fp32 check) through `autotune.promote` on the pair's rounds (`--rounds` 8 or more), and a promoted one
becomes this GPU's tuned entry for the cell's shape key (`autotune.store_tuned`: autotune/configs/<gpu>.json, which
`w12.configs.flow_config` reads before its heuristic), so that a benchmark run after it takes it.

`--forms` compares the two in-memory forms of a W12 weight instead of the ladder: `w12.matmul` on the version-1
planes (`w12.pack(w, layout="planes")`: the CUDA C++ `mma` kernel at bf16 x and M <= 32, the generation's Triton
variant otherwise) against `w12.matmul` on the runtime layout (the default, a `TiledW12`: the flow kernel at bf16 x
up to 32 rows, its 32-row pieces up to `w12.ops.CHUNK_MAX_M`, fp16 x through the fp32-output build on x's two bf16
halves up to 48 rows, the weight decoded above), cuBLAS on the BF16 weight beside them, for every linear of hybrid-27b
and the LM head at `--forms-m` bf16 and `--forms-fp16-m` fp16 rows. Each form's product is checked against fp64
first (`specpilot.testing.assert_close`, against F.linear's error in the same dtype); then the three are timed over
rotated weight copies (`weight_copies`; `time_fns`, medians of CUDA-graph replays). File: $OUT/w12-forms.json.

`--batch` times the batch kernel (w12/kernels/batch.py: the runtime layout's tensor-core GEMM that reads the weight
once for up to 256 rows of x) instead of the ladder: for each of --batch-layers (AB_LAYERS names) at each of
--batch-m rows (16 to 280 by default: at 32 rows and fewer the flow kernel is the path it would replace), cuBLAS on
the BF16 weight and the kernel's candidates (`w12.configs.batch_heuristic`'s config, its neighbours in split-K, rows
of x a program and stages, each of 64 rows of x or more in both k orders (`kt`), and any --batch-configs tags), each
beside `w12.matmul_tiled` as dispatched (the flow kernel, its 32-row pieces up to 96 rows, the weight decoded and
F.linear above), pairs interleaved as in --ab (weights and x as there). Each candidate's output is first checked
against the fp32 product (within twice cuBLAS's largest error: `ok`). With `--promote`, for each layer and shape key
(rows bucketed to a power of two: 9-16, 17-32, 33-64, 65-128, 129-256, 257-512: the 280 rows of a 24-request step at
budget 256) the candidate with the best worst ratio over the key's timed row counts goes through `autotune.promote` at
each of them, and where it is promoted at all of them it becomes this GPU's tuned entry `w12.matmul/batch/<key>`,
which `w12.matmul_tiled` then runs in place of the flow kernel, its pieces or the decode. Files: $OUT/w12-batch.json
and its table $OUT/w12-batch.md.

`--even-split` times the even-split probe (w12/csrc/w12_probe.cu) instead of the ladder: at 32 rows of each of
--probe-layers (default o_proj and down_proj, the 5120-row layers short of cuBLAS at 32 rows on the H200), cuBLAS,
`w12.matmul_tiled` at the shipped config, and the probe's variants (PROBE_VARIANTS): the same tiles, decode and
mma.sync work as the flow kernel at 4 n-tiles, no escapes, scale or output, under three assignments of tiles to warps
(round robin; equal runs a warp, partial sums stored at row block boundaries; equal runs of group-units a CTA, all
its warps on one unit) and three forms of x (held in registers; each warp's own loads; one shared ring a CTA), and
four builds of the whole product on those splits (`full-*`: window bases, escapes, the pieces met through a global
workspace by the warp that counts last), each checked against fp64 on every 7th output column in two launches before
it is timed (a failed check is a row of the report, not timed). Each row is timed once a round (`--rounds`) over
rotated weight copies, the rows' order rotating. `--only REGEX` keeps the variants whose name it matches in full
(cuBLAS and the shipped config always run): the whole-product builds in a process of their own (`--only 'full-.*'`)
keep an error of theirs that loses the CUDA context from costing the probe rows. What it answers: how near the copy
rate an even split streams at 32 rows, and what x costs in each form, before a kernel is built on it
(docs/w12-kernels.md, "M = 32 on the H200"). With --build-only it compiles the variants only. Files:
$OUT/w12-even-split.json and its table $OUT/w12-even-split.md.

Every launch error and every asynchronous CUDA error is caught per row and reported; an error that leaves the
context unusable (an illegal address) stops the GPU work and the table so far is printed. --budget-s (default 200)
skips the rows left once the run has taken that long. Files: $OUT/w12-ladder.json and $OUT/w12-ladder.md when $OUT
is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

COPY_TBS = 4.28  # the H200's copy rate on these sizes (docs/w12-kernels.md)
LAYERS = {"in_proj": "gdn.in_proj", "gate_up": "mlp.gate_up_proj", "o_proj": "attn.o_proj", "down_proj": "mlp.down_proj"}
# --ab also takes hybrid-27b's other linears, the LM head among them
AB_LAYERS = LAYERS | {"out_proj": "gdn.out_proj", "qkv_proj": "attn.qkv_proj", "lm_head": "lm_head"}
STEPS = "abcde"
_CHECK_COLS = 1024
_SEED = 1234


@dataclass
class Row:
    layer: str
    M: int
    row: str  # cublas, w12, a..e, e@<tag>
    config: str = ""
    regs: str = ""
    check: str = ""
    us: float | None = None
    p10: float | None = None
    p90: float | None = None
    nbytes: float = 0.0
    status: str = "ok"
    extra: dict = field(default_factory=dict)

    def tbs(self) -> float | None:
        return None if not self.us else self.nbytes / (self.us * 1e-6) / 1e12


# --------------------------------------------------------------------------------------
# the plan: which builds each cell runs (host only)
# --------------------------------------------------------------------------------------


def layer_shapes(names: list[str]) -> dict[str, tuple[int, int]]:
    """(N, K) of each named layer of AB_LAYERS (LAYERS among them)."""
    from specpilot.bench.shapes import get_shape_set

    shapes = get_shape_set("hybrid-27b")
    return {name: shapes.lm_head if name == "lm_head" else shapes.linears[AB_LAYERS[name]] for name in names}


def flow_configs(m: int, n: int, k: int, sms: int, sweep: bool, arch: tuple[int, int] = (9, 0), extra=(),
                 q8: bool = False):
    """(label, FlowConfig) of the flow rows of one cell: the heuristic's config for the ladder, then step e (the
    mma.sync rows with the heuristic's x sets ahead, `xd`) at other K splits (1..8, up to the CTA's warps) and ring depths (the heuristic's, 8), the other CTA sizes of 16 warps per
    SM (4, 8 or 16 warps), and two row blocks per warp in CTAs of 8 warps at 1 per SM and 4 warps at 2 per SM (the
    heuristic's K split and half of it), when `sweep`; on sm_90 also K split across the CTAs of a cluster (kc 2 and 4,
    CTAs of one row block) and the warpgroup build (`wg`, rows tagged `-g`) in 10 shapes; then the configs in `extra`
    (--configs), where not listed already."""
    from unittest import mock

    import w12.configs as wc

    with mock.patch.object(wc, "sm_count", lambda device: sms):
        base = wc.flow_heuristic(m, n, k, torch.device("cpu"), q8=q8)
    out = [("ladder", base)]
    if sweep:
        for kw in (k for k in (1, 2, 4, 8) if k <= base.warps):
            for stages in (base.stages, 8):
                cfg = wc.FlowConfig(warps=base.warps, kw=kw, stages=stages, cps=base.cps, xd=base.xd)
                if cfg != base:
                    out.append((f"e@{cfg.tag()}", cfg))
        for warps, cps in ((4, 4), (8, 2), (16, 1)):  # 16 warps per SM in other CTA sizes
            if warps == base.warps:
                continue
            for kw in sorted({min(base.kw, warps), min(2 * base.kw, warps)}):
                cfg = wc.FlowConfig(warps=warps, kw=kw, stages=base.stages, cps=cps, xd=base.xd)
                out.append((f"e@{cfg.tag()}", cfg))
        for warps, cps in ((8, 1), (4, 2)):
            for kw in sorted({min(base.kw, warps), max(1, min(base.kw, warps) // 2)}):
                cfg = wc.FlowConfig(warps=warps, kw=kw, stages=base.stages, cps=cps, rb=2, xd=base.xd)
                out.append((f"e@{cfg.tag()}", cfg))
        if tuple(arch) >= (9, 0):
            for warps, kw, cps, kc in ((4, 4, 4, 2), (4, 4, 4, 4), (8, 8, 2, 2), (4, 2, 4, 2), (2, 2, 4, 2),
                                       (2, 2, 8, 2), (2, 2, 8, 1), (4, 4, 5, 2), (2, 2, 5, 2), (4, 4, 6, 2)):
                cfg = wc.FlowConfig(warps=warps, kw=kw, stages=base.stages, cps=cps, kc=kc, xd=base.xd)
                out.append((f"e@{cfg.tag()}", cfg))
            # the warpgroup build (wgmma over 64 rows, x once per warpgroup in shared memory)
            for warps, kw, cps, kc in ((8, 1, 2, 1), (8, 2, 2, 1), (16, 1, 1, 1), (16, 2, 1, 1), (16, 4, 1, 1),
                                       (4, 1, 4, 2), (8, 2, 2, 2), (16, 4, 1, 2), (4, 1, 4, 4), (8, 2, 2, 4)):
                cfg = wc.FlowConfig(warps=warps, kw=kw, stages=base.stages, cps=cps, kc=kc, wg=True)
                out.append((f"e@{cfg.tag()}", cfg))
    for cfg in extra:
        if cfg != base and all(cfg != c for _, c in out):
            out.append((f"e@{cfg.tag()}", cfg))
    return out


def plan(layers: dict[str, tuple[int, int]], ms: list[int], sms: int, sweep: bool, ablate: bool = False,
         only: str | None = None, arch: tuple[int, int] = (9, 0), wg_probe: bool = False, extra=(), q8: bool = False):
    """Every (layer, M) cell's rows: [(row name, FlowConfig, step)], and the builds they need: {(cfg, nt, step)}
    including the check-only builds (steps c and d at kw = 1, the exact-base build of every step-e config). `only`:
    a regular expression that keeps the flow rows whose name it matches in full (cuBLAS and the default always run).
    `wg_probe`: the warpgroup rows also at w12.flow.WG_VARIANTS' steps (and WG_ABLATIONS' with `ablate`), named
    `<row>-depth1`, `<row>-nosync`, `<row>-noxcopy`. `q8`: the 8-bit view's rows, step e alone (no fixed base)."""
    import re

    from w12 import flow
    from w12.configs import FlowConfig

    cells, builds = [], set()
    for name, (n, k) in layers.items():
        for m in ms:
            nt = flow.n_tiles(m)
            rows = []
            for label, cfg in flow_configs(m, n, k, sms, sweep, arch, extra, q8):
                if q8:
                    if cfg.fixed:
                        continue
                    cand = [("e" if label == "ladder" else label, cfg, "e")]
                else:
                    cand = [(s, cfg, s) for s in STEPS] if label == "ladder" else [(label, cfg, "e")]
                if label == "ladder" and not q8:
                    cand.append(("e-fixed", replace(cfg, fixed=True), "e"))
                    cand += [(abl, cfg, abl) for abl in (flow.ABLATIONS if ablate else ())]
                elif cfg.wg and wg_probe:
                    steps = list(flow.WG_VARIANTS) + (list(flow.WG_ABLATIONS) if ablate else [])
                    cand += [(f"{label}{st[1:]}", cfg, st) for st in steps]
                for rname, c, step in cand:
                    if only is not None and not re.fullmatch(only, rname):
                        continue
                    rows.append((rname, c, step))
                    builds.add((c, nt, step))
                    if step == "e" or step in flow.WG_VARIANTS:
                        builds.add((replace(c, fixed=False), nt, "e"))  # the bitwise check's twin
                    if step in ("c", "d"):
                        builds.add((replace(c, kw=1), nt, step))  # checked at kw = 1
            cells.append((name, n, k, m, rows))
    return cells, builds


def _build_one(b, arch: tuple[int, int], q8: bool = False):
    from w12 import flow

    cfg, nt, step, *defines = b  # an optional 4th item: extra defines as sorted (name, value) pairs
    try:
        res = flow.build(cfg, nt, arch, step=step, q8=q8, defines=dict(defines[0]) if defines else None).resources()
        spill = res["spill_stores"] + res["spill_loads"]
        return b, f"{res['registers']}r" + (f" SPILL {spill}B" if spill else "")
    except Exception as e:  # reported per row; the run goes on
        return b, f"BUILD FAILED: {str(e).splitlines()[0][:200]}"


def precompile(builds, arch: tuple[int, int], workers: int = 8, q8: bool = False) -> dict:
    """NVRTC builds of every (cfg, nt, step) or (cfg, nt, step, defines) for `arch` (autotune.jit caches them on disk
    and locks per key), in `workers` spawned processes (NVRTC holds the GIL); returns {build: "<registers>r" or the
    error}. `q8`: the 8-bit view's builds."""
    todo = sorted(builds, key=lambda b: (b[0].tag(), *b[1:]))
    if workers <= 1:
        return dict(_build_one(b, arch, q8) for b in todo)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        return dict(ex.map(_build_one, todo, [arch] * len(todo), [q8] * len(todo)))


# --------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    base = {(r.layer, r.M): r.us for r in rows if r.row == "cublas" and r.us}
    head = "| layer | M | row | config | regs | check | µs (median) | p10–p90 | TB/s | % of 4.28 TB/s | × cuBLAS |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        t = r.tbs()
        b = base.get((r.layer, r.M))
        num = (f"{r.us:.1f}", f"{r.p10:.1f}–{r.p90:.1f}", f"{t:.2f}", f"{100 * t / COPY_TBS:.0f}%",
               f"{b / r.us:.2f}" if b else "–") if r.us else (r.status, "", "", "", "")
        lines.append(f"| {r.layer} | {r.M} | {r.row} | {r.config} | {r.regs} | {r.check} | " + " | ".join(num) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# the GPU run
# --------------------------------------------------------------------------------------


class ContextLost(RuntimeError):
    pass


def _sync(what: str, device: torch.device | None = None) -> None:
    """Surface asynchronous CUDA errors here; raise ContextLost when the context cannot be used any more (nothing to
    do off CUDA)."""
    if device is not None and device.type != "cuda":
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:
        try:
            torch.cuda.synchronize()
            torch.empty(1, device="cuda").add_(1)
            torch.cuda.synchronize()
        except Exception:
            raise ContextLost(f"{what}: {e}") from e
        raise


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, what: str) -> None:
    from specpilot.testing import assert_close

    wc = w[cols]
    ref64 = (x.double() @ wc.double().T).cpu()
    assert_close(out[:, cols], ref64, F.linear(x, wc), msg=what)


def run(args, dev: torch.device | None = None, layers: dict[str, tuple[int, int]] | None = None) -> list[Row]:
    """The GPU run (module doc). `dev` and `layers` other than CUDA and hybrid-27b's are for the CPU test of this
    script, which stands the kernels in with torch."""
    import w12
    from autotune import jit
    from specpilot.bench.registry import rotations
    from specpilot.bench.timing import time_cuda
    from w12 import flow, layout
    from w12.configs import FlowConfig

    dev = torch.device("cuda") if dev is None else dev
    if dev.type == "cuda":
        sms, arch = torch.cuda.get_device_properties(dev).multi_processor_count, torch.cuda.get_device_capability(dev)
    else:
        sms, arch = args.sms, (args.arch // 10, args.arch % 10)
    layers = layer_shapes(args.layers) if layers is None else layers
    q8 = args.q8
    cells, builds = plan(layers, args.m, sms, args.sweep, args.ablate, args.only, tuple(arch), args.wg_probe,
                         args.configs, q8)
    t0 = time.perf_counter()
    regs = precompile(builds, arch, workers=args.workers, q8=q8)
    print(f"built {len(builds)} specialisations for sm_{arch[0]}{arch[1]} in {time.perf_counter() - t0:.1f} s "
          f"(NVRTC {'.'.join(map(str, jit.nvrtc_version()))})", flush=True)
    rows: list[Row] = []
    start = time.perf_counter()

    def timed(fns, row: Row) -> None:
        if time.perf_counter() - start > args.budget_s:
            row.status = "skipped (time budget)"
            return
        tm = time_cuda(fns, reps=args.reps)
        _sync(row.row, dev)
        row.us, row.p10, row.p90 = tm.median * 1e6, tm.p10 * 1e6, tm.p90 * 1e6
        print(f"  {row.layer} M={row.M} {row.row:28s} {row.us:8.1f} µs  {row.tbs():.2f} TB/s  {row.check}", flush=True)

    try:
        for name, (n, k) in layers.items():
            g = torch.Generator(device=dev).manual_seed(_SEED + n + k)
            sets = rotations(1.5 * n * k, dev)
            ws = [(torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16) for _ in range(sets)]
            packs = [w12.pack(w, layout="planes") for w in ws]  # the "w12" rows: w12.matmul on the planes
            tiles = [layout.tile(p) for p in packs]
            cols = torch.arange(0, n, max(1, n // _CHECK_COLS), device=dev)[:_CHECK_COLS]
            _sync(f"{name} setup", dev)
            print(f"{name} {n} x {k}: {sets} rotated copies, {tiles[0].bits_per_weight:.3f} bits per weight in the "
                  f"runtime layout", flush=True)
            for cname, cn, ck, m, frows in cells:
                if cname != name:
                    continue
                xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(sets)]
                io = 2.0 * (m * k + m * n)
                x0, w0, p0, t0_ = xs[0], ws[0], packs[0], tiles[0]
                # the weight each product is checked against, and the bytes a call reads (the view: the hi bytes)
                wv = w12.decode_q8(p0) if q8 else w0
                wbytes = float(n * k) if q8 else float(t0_.nbytes)
                mm = w12.matmul_q8 if q8 else w12.matmul
                r = Row(name, m, "cublas", "F.linear", nbytes=2.0 * n * k + io)
                rows.append(r)
                timed([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)], r)
                r = Row(name, m, "w12", "default" + (" (matmul_q8)" if q8 else ""),
                        nbytes=(wbytes if q8 else float(p0.nbytes)) + io)
                rows.append(r)
                try:
                    _check(mm(x0, p0), x0, wv, cols, f"w12 {name} M={m}")
                    r.check = "fp64 ok"
                    timed([lambda x=x, p=p: mm(x, p) for x, p in zip(xs, packs)], r)
                except ContextLost:
                    raise
                except Exception as e:
                    r.status = f"FAILED: {str(e).splitlines()[0][:160]}"
                    print(f"  {name} M={m} w12: {r.status}", flush=True)
                outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
                for rname, cfg, step in frows:
                    r = Row(name, m, rname, cfg.tag(), regs=regs.get((cfg, flow.n_tiles(m), step), "?"),
                            nbytes=wbytes + io)
                    rows.append(r)
                    if r.regs.startswith("BUILD FAILED"):
                        r.status = r.regs
                        continue
                    try:
                        r.check = _flow_check(cfg, step, x0, p0, t0_, wv, cols, f"{name} M={m} {rname}", q8)
                        _sync(rname, dev)
                        timed([lambda x=x, t=t, o=o, cfg=cfg, step=step: flow.launch_tiled(cfg, x, t, None, o, step=step,
                                                                                           q8=q8)
                               for x, t, o in zip(xs, tiles, outs)], r)
                    except ContextLost:
                        raise
                    except Exception as e:
                        r.status = f"FAILED: {str(e).splitlines()[0][:160]}"
                        print(f"  {name} M={m} {rname}: {r.status}", flush=True)
                        _sync(rname, dev)
                del xs, outs
            del ws, packs, tiles
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    except ContextLost as e:
        print(f"CUDA context lost, GPU work stopped: {e}", flush=True)
        rows.append(Row("-", 0, "CONTEXT LOST", status=str(e)[:200]))
    return rows


def _flow_check(cfg, step: str, x, p, t, w, cols, what: str, q8: bool = False) -> str:
    """The check of one flow row (module doc); returns what was checked. `q8`: a step-e row of the 8-bit view, `w`
    its weight (w12.decode_q8)."""
    from w12 import flow
    from w12.configs import FlowConfig

    m, n = x.shape[0], p.N
    out = torch.full((m, n), float("nan"), device=x.device, dtype=torch.bfloat16)
    if step in flow.ABLATIONS or step in flow.WG_ABLATIONS:
        flow.launch_tiled(cfg, x, t, None, out, step=step)
        _sync(what, x.device)
        return "runs (ablation, unchecked)"
    if step in ("a", "b"):
        flow.launch_tiled(cfg, x, t, None, out, step=step)  # runs; writes nothing
        _sync(what, x.device)
        return "runs (no product)"
    if step in ("c", "d"):
        one = replace(cfg, kw=1)
        flow.launch_tiled(one, x, t, None, out, step=step)
        _sync(what, x.device)
        _check(out, x, flow.ladder_weight(p, step), cols, what + " (kw=1)")
        return "fp64 ok (kw=1)"
    flow.launch_tiled(cfg, x, t, None, out, step=step, q8=q8)
    _sync(what, x.device)
    _check(out, x, w, cols, what)
    # the exact-base build at step e: for an exact-base cfg a second run, or the shipped build of a WG variant
    again = torch.full_like(out, float("nan"))
    flow.launch_tiled(replace(cfg, fixed=False), x, t, None, again, q8=q8)
    _sync(what, x.device)
    if not torch.equal(out.view(torch.int16), again.view(torch.int16)):
        bad = int((out.view(torch.int16) != again.view(torch.int16)).sum())
        raise AssertionError(f"{what}: {bad} outputs differ from the exact-base build's")
    if step in flow.WG_VARIANTS:
        return "fp64 ok, = shipped build"
    return "fp64 ok, = exact base" if cfg.fixed else "fp64 ok, repeats"


TRACE_ORDER = ("in_proj", "o_proj", "gate_up", "down_proj")  # a decoder layer's order (o_proj for out_proj's shape)


def trace_summary(st, nbytes: float, prev_end: float | None = None) -> dict:
    """One launch's phases from its W12F_TRACE stamps `st` (int64 [CTAs, 8], ns; w12.flow.launch_tiled(trace=)),
    in µs: `span` first entry to last exit, `stream` the bytes at the copy rate, `overlap` with the launch before
    (`prev_end`: its last exit, ns; positive when this one started first), the CTAs' median `first_tile` (entry to
    warp 0's first tile), `loop` (first tile to the last main loop's end), `epilogue` (that to the last exit), the
    median of the PDL `wait` (entry to its end), `entry_skew` (the latest entry among the first wave, less the
    first entry) and `tail` (last exit less the median exit)."""
    import statistics

    st = [list(map(int, r)) for r in st]
    rows = [r for r in st if r[0] > 0 and r[5] > 0]
    if not rows:
        raise ValueError("trace_summary: no CTA stamped its entry and exit")
    t0 = min(r[0] for r in rows)
    end = max(r[5] for r in rows)
    us = 1e-3
    med = lambda xs: statistics.median(xs) * us if xs else None  # noqa: E731
    waves = sorted(r[0] for r in rows)
    first_exit = min(r[5] for r in rows)
    first_wave = [e for e in waves if e < first_exit]
    out = {
        "ctas": len(rows),
        "span": (end - t0) * us,
        "stream": nbytes / (COPY_TBS * 1e12) * 1e6,
        "entry_skew": ((first_wave[-1] if first_wave else t0) - t0) * us,
        "wait": med([r[2] - r[0] for r in rows if r[2] > 0]),
        "first_tile": med([r[3] - r[0] for r in rows if r[3] > 0]),
        "loop": med([r[4] - r[3] for r in rows if r[3] > 0 and r[4] > 0]),
        "epilogue": med([r[5] - r[4] for r in rows if r[4] > 0]),
        "tail": (end - statistics.median(r[5] for r in rows)) * us,
        "sms": len({r[1] for r in rows}),
        "start_ns": t0,
        "end_ns": end,
    }
    out["overlap"] = None if prev_end is None else (prev_end - t0) * us
    out["rate_tbs"] = nbytes / (out["span"] * 1e-6) / 1e12
    return out


def format_trace(rows: list[dict]) -> str:
    cols = ("span", "stream", "overlap", "entry_skew", "wait", "first_tile", "loop", "epilogue", "tail")
    lines = ["| variant | run | layer | M | config | CTAs | " + " | ".join(f"{c} µs" for c in cols) +
             " | TB/s over the span | graph replay µs |", "|" + "---|" * (8 + len(cols))]
    for r in rows:
        vals = [("–" if r.get(c) is None else f"{r[c]:.2f}") for c in cols]
        lines.append(f"| {r.get('variant', 'base')} | {r['run']} | {r['layer']} | {r['M']} | {r['config']} | "
                     f"{r['ctas']:.0f} | " + " | ".join(vals) + f" | {r['rate_tbs']:.2f} | " +
                     (f"{r['graph_us']:.1f}" if r.get("graph_us") else "–") + " |")
    return "\n".join(lines)


def parse_variant(text: str) -> tuple[str, dict, object, dict]:
    """--variant LABEL=ITEM,ITEM: ITEM is W12F_NAME:integer (a define added to every trace build), cap:N (dynamic
    shared memory sized so that at most N CTAs fit an SM), cap:auto (per launch, ceil(CTAs / SMs) where that is one
    wave), or LAYER:TAG (that layer at FlowConfig TAG, e.g. gate_up:w4-k1-s3-c4); LABEL alone is the shipped build.
    Returns (label, defines, cap, {layer: FlowConfig})."""
    from w12.configs import FlowConfig

    label, _, spec = text.partition("=")
    defines, cap, force = {}, None, {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = item.partition(":")
        value = value.strip()
        if sep and name.startswith("W12F_") and value.isdigit():
            defines[name] = int(value)
        elif sep and name == "cap" and (value.isdigit() or value == "auto"):
            cap = value if value == "auto" else int(value)
        elif sep and name in LAYERS:
            force[name] = FlowConfig.from_tag(value)
        else:
            raise ValueError(f"--variant {text!r}: items are W12F_NAME:integer, cap:N, cap:auto or LAYER:TAG, got "
                             f"{item!r}")
    return label.strip() or "base", defines, cap, force


def trace_run(args):
    """The --trace run (module doc; a CUDA device): one dict per launch, alone and in the chain, at each M of args.m
    and for each --variant; and the raw stamps of the chain's last replay per variant and M
    ({"<variant>/M<m>/<i>": int64 [CTAs, 8] relative to the chain's first entry})."""
    import numpy as np

    import w12
    from specpilot.bench.timing import time_cuda
    from w12 import flow
    from w12.configs import flow_config

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    layers = layer_shapes([n for n in TRACE_ORDER if n in args.layers])
    variants = [parse_variant(v) for v in (args.variant or ["base"])]
    g = torch.Generator(device=dev).manual_seed(_SEED)
    copies = 2
    dense = {name: [(torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
             for name, (n, k) in layers.items()}
    tiles = {name: [w12.pack(w) for w in ws] for name, ws in dense.items()}  # the runtime layout
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    out_rows: list[dict] = []
    raw: dict[str, np.ndarray] = {}
    # every build of the run first, in parallel processes (a failure surfaces again at its launch)
    todo = {(cfg, flow.n_tiles(m), "e", tuple(sorted((vd | ({"W12F_TRACE": 1} if tr else {})).items())))
            for _, vd, _, fc in variants for m in args.m for name, (n, k) in layers.items()
            for cfg in [fc.get(name, flow_config(m, n, k, dev))] for tr in (False, True)}
    t0 = time.perf_counter()
    precompile(todo, torch.cuda.get_device_capability(dev), workers=args.workers)
    print(f"built {len(todo)} trace specialisations in {time.perf_counter() - t0:.1f} s", flush=True)
    sms, smem_sm = props.multi_processor_count, props.shared_memory_per_multiprocessor
    for vlabel, vdefs, cap, force in variants:
        for m in args.m:
            cfgs = {name: force.get(name, flow_config(m, n, k, dev)) for name, (n, k) in layers.items()}
            xs = {name: torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for name, (n, k) in layers.items()}
            outs = {name: torch.empty(m, n, device=dev, dtype=torch.bfloat16) for name, (n, k) in layers.items()}
            chain = [(name, c) for c in range(copies) for name in layers]
            bufs = [torch.zeros(8 * flow.grid(cfgs[name], *layers[name], sms), dtype=torch.int64, device=dev)
                    for name, _ in chain]
            # cap: shared memory per CTA such that cap + 1 CTAs (with the per-CTA reserve) do not fit an SM
            def smem_for(name: str) -> int | None:
                n_ctas = flow.grid(cfgs[name], *layers[name], sms)
                per = cap if cap != "auto" else -(-n_ctas // sms)
                if per is None or (cap == "auto" and per > cfgs[name].cps + 1):
                    return None
                return smem_sm // per - 2048

            smems = {name: smem_for(name) for name in layers}

            def launch(i: int, pdl: bool, traced: bool = True) -> None:
                name, c = chain[i]
                flow.launch_tiled(cfgs[name], xs[name], tiles[name][c], None, outs[name], pdl=pdl, smem=smems[name],
                                  defines=vdefs or None, trace=bufs[i] if traced else None)

            # build and load; check each build's product against fp64 and the traced build's against the plain one
            for i, (name, c) in enumerate(chain):
                launch(i, False, traced=False)
                plain = outs[name].clone()
                launch(i, False)
                _sync("trace warm-up", dev)
                if not torch.equal(plain.view(torch.int16), outs[name].view(torch.int16)):
                    raise AssertionError(f"{vlabel}: {name} M={m}: the traced build's product differs from the plain "
                                         "build's")
                n, k = layers[name]
                cols = torch.arange(0, n, max(1, n // _CHECK_COLS), device=dev)[:_CHECK_COLS]
                _check(plain, xs[name], dense[name][c], cols,
                       f"{vlabel}: {name} M={m} {cfgs[name].tag()}")
            tag = (f"{vlabel} ({', '.join(f'{k}={v}' for k, v in vdefs.items())}{'' if cap is None else f' cap {cap}'}"
                   f"{''.join(f' {k}:{c.tag()}' for k, c in force.items())})")
            for i, (name, c) in enumerate(chain[: len(layers)]):  # each launch alone: cold L2, nothing in flight
                flush.fill_(1)
                bufs[i].zero_()
                _sync("trace flush", dev)
                launch(i, False)
                _sync(f"trace {name}", dev)
                out_rows.append({"variant": vlabel, "run": "alone", "layer": name, "M": m, "config": cfgs[name].tag(),
                                 **trace_summary(bufs[i].view(-1, 8).tolist(), float(tiles[name][c].nbytes))})
            # the chain as one CUDA graph with programmatic dependent launch; the traced build, and the plain one
            # timed (CUDA events over replays)
            graphs = {}
            stream = torch.cuda.Stream(dev)
            for traced in (True, False):
                with torch.cuda.stream(stream):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        for i in range(len(chain)):
                            launch(i, True, traced)
                graphs[traced] = graph
            per = []
            for _ in range(args.trace_reps):
                for b in bufs:
                    b.zero_()
                flush.fill_(2)
                _sync("trace chain zero", dev)
                graphs[True].replay()
                _sync("trace chain", dev)
                prev, reps = None, []
                for i, (name, c) in enumerate(chain):
                    summ = trace_summary(bufs[i].view(-1, 8).tolist(), float(tiles[name][c].nbytes), prev)
                    prev = summ["end_ns"]
                    reps.append(summ)
                per.append(reps)
            t0 = min(int(b.view(-1, 8)[:, 0][b.view(-1, 8)[:, 0] > 0].min()) for b in bufs)
            for i, b in enumerate(bufs):
                a = b.view(-1, 8).cpu().numpy().copy()
                a[:, [0, 2, 3, 4, 5]] = np.where(a[:, [0, 2, 3, 4, 5]] > 0, a[:, [0, 2, 3, 4, 5]] - t0, -1)
                raw[f"{vlabel}/M{m}/{i}-{chain[i][0]}"] = a[:, :6]
            keys = [k for k in per[0][-1] if isinstance(per[0][-1][k], (int, float)) and not k.endswith("_ns")]
            for i, (name, c) in enumerate(chain):
                med = {k: (None if per[0][i][k] is None else
                           float(np.median([r[i][k] for r in per if r[i][k] is not None]))) for k in keys}
                out_rows.append({"variant": vlabel, "run": "chain", "layer": name, "M": m, "config": cfgs[name].tag(),
                                 **med})
            chain_us = float(np.median([(r[-1]["end_ns"] - r[0]["start_ns"]) * 1e-3 for r in per]))
            tm = time_cuda([graphs[False].replay], reps=args.reps, graph=False)
            stream_us = sum(r["stream"] for r in out_rows[-len(chain):])
            out_rows.append({"variant": vlabel, "run": "chain total", "layer": "+".join(layers), "M": m,
                             "config": tag, "ctas": 0, "span": chain_us, "stream": stream_us,
                             "graph_us": tm.median * 1e6, "rate_tbs": 0.0})
            print(f"  {tag} M={m}: chain {chain_us:.1f} µs traced, {tm.median * 1e6:.1f} µs a replay of the plain "
                  f"build, for {len(chain)} launches with {stream_us:.1f} µs of bytes at {COPY_TBS} TB/s", flush=True)
            del graphs
    return out_rows, raw


def write_outputs(rows: list[Row], meta: dict) -> None:
    table = format_table(rows)
    print("\n" + table, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "w12-ladder.md").write_text(table + "\n")
        Path(out, "w12-ladder.json").write_text(json.dumps({"meta": meta, "rows": [r.__dict__ for r in rows]}, indent=1))


def build_only(args) -> int:
    """NVRTC builds of every specialisation a run launches (132 SMs assumed for the heuristic), on the CPU."""
    arch = (args.arch // 10, args.arch % 10)
    cells, builds = plan(layer_shapes(args.layers), args.m, args.sms, args.sweep, args.ablate, args.only, arch,
                         args.wg_probe, args.configs, args.q8)
    t0 = time.perf_counter()
    regs = precompile(builds, arch, workers=args.workers, q8=args.q8)
    bad = {b: v for b, v in regs.items() if "FAILED" in v or "SPILL" in v}
    for (cfg, nt, step), v in sorted(regs.items(), key=lambda kv: (kv[0][0].tag(), kv[0][1], kv[0][2])):
        print(f"{cfg.tag():32s} nt={nt} step={step}: {v}")
    print(f"{len(cells)} cells, {len(builds)} builds for sm_{args.arch} in {time.perf_counter() - t0:.1f} s; "
          f"{len(bad)} failed or spilled")
    return 1 if bad else 0


def weight_copies(n: int, k: int) -> int:
    """How many copies of an n x k weight --forms and --ab rotate through when they time a layer: 3, or 2 above 10^9
    weights. Between two calls on one copy the other copies are read: for hybrid-27b's smallest linears (5120 x 6144)
    63M weights, 120 MiB in BF16 and 90 MiB in the runtime layout (12 bits a weight), well above L2, so no call finds
    its weight there; above 10^9 weights (the LM head, 2.4 GiB in BF16) one other copy is far beyond L2 already, and a
    third would only take memory."""
    return 2 if n * k > 10**9 else 3


# --------------------------------------------------------------------------------------
# --ab: candidates beside the shipped config, pairs interleaved (module doc)
# --------------------------------------------------------------------------------------

def ab_timing_only() -> set[str]:
    """The defines whose builds compute wrong results on purpose (w12.flow's timing-only ablations, beyond the
    step's own defines): no error check."""
    from w12.flow import ABLATIONS, STEPS as FLOW_STEPS, WG_ABLATIONS

    return {name for d in (*ABLATIONS.values(), *WG_ABLATIONS.values()) for name in d} - set(FLOW_STEPS["e"])


def ab_layer_shape(name: str) -> tuple[int, int]:
    """(N, K) of a layer of AB_LAYERS."""
    if name not in AB_LAYERS:
        raise ValueError(f"w12_ladder --ab: unknown layer {name!r}; use one of {sorted(AB_LAYERS)}")
    return layer_shapes([name])[name]


def ab_parse_cells(text: str) -> list[tuple[str, int, list[tuple[str, str, dict[str, int]]]]]:
    """The --ab JSON as [(layer, M, [(label, tag, defines), ...]), ...], checked."""
    from w12.configs import FlowConfig
    from w12.flow import MAX_M, WG_MAX_M

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"w12_ladder --ab: the cells are not JSON: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError("w12_ladder --ab: the cells must be a non-empty list of [layer, M, candidates]")
    cells = []
    for cell in raw:
        if not (isinstance(cell, list) and len(cell) == 3 and isinstance(cell[2], list)):
            raise ValueError(f"w12_ladder --ab: a cell is [layer, M, [[label, tag, defines], ...]], got {cell!r}")
        layer, m, cands = cell
        ab_layer_shape(layer)
        if not isinstance(m, int) or not 0 < m <= WG_MAX_M:
            raise ValueError(f"w12_ladder --ab: M must be an int in 1..{WG_MAX_M}, got {m!r}")
        parsed = []
        for c in cands:
            if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], str)
                    and isinstance(c[2], dict)):
                raise ValueError(f"w12_ladder --ab: a candidate is [label, tag, defines], got {c!r}")
            label, tag, defines = c
            if tag:
                FlowConfig.from_tag(tag)  # raises on a bad tag
            if m > MAX_M and not (tag and FlowConfig.from_tag(tag).wg):
                raise ValueError(f"w12_ladder --ab: above {MAX_M} rows the shipped path is 32-row pieces and a "
                                 f"candidate is a warpgroup config (a tag ending in -g), got {c!r} at M = {m}")
            if not all(isinstance(k, str) and k.startswith("W12F_") and isinstance(v, int) for k, v in defines.items()):
                raise ValueError(f"w12_ladder --ab: defines are W12F_* names with int values, got {defines!r}")
            parsed.append((label, tag, dict(defines)))
        cells.append((layer, m, parsed))
    return cells


def ab_shipped(layer: str, m: int, device):
    """The config the library runs for this cell (w12.configs.flow_config); on a CPU device, the heuristic's pick for
    an sm_90 GPU with clusters (what --build-only builds)."""
    from w12.configs import flow_config, flow_heuristic

    n, k = ab_layer_shape(layer)
    if device.type != "cuda":
        return flow_heuristic(m, n, k, device, wgmma=True, clusters=True)
    return flow_config(m, n, k, device)


def ab_pieces(m: int) -> list[tuple[int, int]]:
    """The row ranges the shipped path launches for M rows: one, or above 32 the 32-row pieces of
    `w12.matmul_tiled`."""
    from w12.flow import MAX_M

    return [(i, min(m, i + MAX_M)) for i in range(0, m, MAX_M)]


def ab_builds(cells, device) -> dict[tuple[str, int, tuple], int]:
    """Every (config tag, token tiles, defines) a run builds, each cell's shipped config and its candidates, with
    the N of a layer that takes it (whether N % 16 == 0 picks the full-row-block build)."""
    from w12.configs import FlowConfig
    from w12.flow import n_tiles

    out = {}
    for layer, m, cands in cells:
        n = ab_layer_shape(layer)[0]
        ships = [ab_shipped(layer, hi - lo, device).tag() for lo, hi in ab_pieces(m)]
        for (lo, hi), ship in zip(ab_pieces(m), ships):
            out.setdefault((ship, n_tiles(hi - lo), ()), n)
        for _, tag, defines in cands:  # an empty tag (the shipped config) only where there is one piece
            cfg = FlowConfig.from_tag(tag or ships[0])
            out.setdefault((cfg.tag(), n_tiles(m, cfg.wg), tuple(sorted(defines.items()))), n)
    return out


def _ab_build(tag: str, nt: int, defines: tuple, n: int) -> tuple:
    """One --ab build as precompile / _build_one take it: step e, with the W12F_FULL that `w12.flow.launch_tiled`
    adds (`w12.flow.full_rows`)."""
    from w12.configs import FlowConfig
    from w12.flow import full_rows

    full = (("W12F_FULL", 1),) if full_rows(n, nt) else ()
    return FlowConfig.from_tag(tag), nt, "e", tuple(sorted(dict(full + defines).items()))


def ab_resources(tag: str, nt: int, defines: tuple, n: int, arch=(9, 0)) -> str:
    """_build_one's report of one --ab build: '<registers>r', with ' SPILL ...' or 'BUILD FAILED: ...'."""
    return _build_one(_ab_build(tag, nt, defines, n), arch)[1]


def ab_build_only(cells, arch, sms: int, workers: int) -> int:
    """NVRTC builds of every candidate (the shipped configs as a CPU device with `sms` SMs would pick them)."""
    from unittest import mock

    import w12.configs as wc

    with mock.patch.object(wc, "sm_count", lambda device: sms):
        plan = ab_builds(cells, torch.device("cpu"))
    regs = precompile([_ab_build(*b, n) for b, n in plan.items()], arch, workers=workers)
    bad = {b: v for b, v in regs.items() if "FAILED" in v or "SPILL" in v}
    for (cfg, nt, _, defines), v in sorted(regs.items(), key=lambda kv: (kv[0][0].tag(), *kv[0][1:])):
        print(f"{cfg.tag():30s} nt={nt} {dict(defines)}: {v}")
    print(f"{len(plan)} builds for sm_{arch[0]}{arch[1]}; {len(bad)} failed or spilled")
    return 1 if bad else 0


def ab_weights(n: int, k: int, dev) -> tuple[list, torch.Tensor]:
    """The A/B's weights of an n x k layer: `weight_copies` of them, `randn * 0.02` in bf16 (seeds 0, 1, ...),
    packed in the runtime layout, and the first one's BF16 weight."""
    import w12

    ts, w0 = [], None
    for i in range(weight_copies(n, k)):  # one BF16 copy held at a time (the LM head's is 2.5 GB)
        w = (torch.randn(n, k, device=dev, generator=torch.Generator(dev).manual_seed(i)) * 0.02).to(torch.bfloat16)
        ts.append(w12.pack(w))
        w0 = w if i == 0 else w0
    return ts, w0


def ab_inputs(m: int, w0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A cell's x (m rows, `randn` in bf16, seed m), the fp32 product with w0, and cuBLAS's largest error against
    it: the bound each candidate's output is checked with (within twice that)."""
    x = torch.randn(m, w0.shape[1], device=w0.device, generator=torch.Generator(w0.device).manual_seed(m))
    x = x.to(torch.bfloat16)
    ref = x.float() @ w0.float().T
    return x, ref, (F.linear(x, w0).float() - ref).abs().max().item()


def ab_run(cells, rounds: int, device=None) -> dict:
    """Time every cell on the GPU (module doc; `device`: default cuda); the report as a dict."""
    import torch.nn.functional as F

    from specpilot.bench.timing import time_ab
    from w12 import flow
    from w12.configs import FlowConfig

    dev = torch.device("cuda" if device is None else device)
    timing_defines = ab_timing_only()
    report = []
    held: dict[str, tuple] = {}
    for layer, m, cands in cells:
        n, k = ab_layer_shape(layer)
        if layer not in held:
            held.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            held[layer] = ab_weights(n, k, dev)
        ts, w0 = held[layer]
        x, ref, cub_err = ab_inputs(m, w0)
        pieces = [(lo, hi, ab_shipped(layer, hi - lo, dev)) for lo, hi in ab_pieces(m)]
        ship = pieces[0][2] if len(pieces) == 1 else None  # above 32 rows the shipped path is its pieces
        ship_tag = "+".join(p[2].tag() for p in pieces)
        outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ts]

        def calls(cfg, defines):
            return [lambda i=i: flow.launch_tiled(cfg, x, ts[i], None, outs[i], defines=defines or None, pdl=False)
                    for i in range(len(ts))]

        def ship_calls():
            def one(i):
                for lo, hi, c in pieces:
                    flow.launch_tiled(c, x[lo:hi], ts[i], None, outs[i][lo:hi], pdl=False)
            return [lambda i=i: one(i) for i in range(len(ts))]

        ship_calls()[0]()
        ship_out = outs[0].clone()
        row = {"layer": layer, "M": m, "ship": ship_tag, "ship_err": (ship_out.float() - ref).abs().max().item(),
               "cublas_err": cub_err, "cands": {}}
        ta, tb = time_ab(ship_calls(), [lambda: F.linear(x, w0)] * len(ts), dev, rounds=rounds)
        row["ship_us"], row["cublas_us"] = ta.median * 1e6, tb.median * 1e6
        print(f"{layer} M={m} shipped {ship_tag} {row['ship_us']:.1f} us, cuBLAS {row['cublas_us']:.1f} "
              f"({row['cublas_us'] / row['ship_us']:.3f}x)", flush=True)
        for label, tag, defines in cands:
            cfg = FlowConfig.from_tag(tag) if tag else ship
            regs = ab_resources(cfg.tag(), flow.n_tiles(m, cfg.wg), tuple(sorted(defines.items())), n)
            if "FAILED" in regs:
                row["cands"][label] = {"tag": cfg.tag(), "defines": defines, "error": regs}
                print(f"  {label}: {regs}", flush=True)
                continue
            try:
                flow.launch_tiled(cfg, x, ts[0], None, outs[0], defines=defines or None, pdl=False)
                got = outs[0].clone()
                err = (got.float() - ref).abs().max().item()
                timing_only = bool(timing_defines & defines.keys())
                ta, tb = time_ab(ship_calls(), calls(cfg, defines), dev, rounds=rounds)
            except Exception as e:  # a failed candidate is a row of the report
                row["cands"][label] = {"tag": cfg.tag(), "defines": defines, "error": repr(e)[:300]}
                print(f"  {label}: ERROR {e!r}"[:400], flush=True)
                continue
            r = {"tag": cfg.tag(), "defines": defines, "ship_us": ta.median * 1e6, "cand_us": tb.median * 1e6,
                 "err": err, "ok": timing_only or err <= 2 * cub_err + 1e-6, "timing_only": timing_only,
                 "same_bits_as_ship": bool(torch.equal(got.view(torch.int16), ship_out.view(torch.int16))),
                 "regs": regs, "ship_samples_us": [t * 1e6 for t in ta.samples],
                 "cand_samples_us": [t * 1e6 for t in tb.samples]}
            r["ratio"] = r["cand_us"] / r["ship_us"]
            row["cands"][label] = r
            print(f"  {label:24s} {cfg.tag():28s} {r['cand_us']:8.1f} vs {r['ship_us']:8.1f} us  ratio "
                  f"{r['ratio']:.3f}  err {err:.4f} (cuBLAS {cub_err:.4f})  same bits {r['same_bits_as_ship']}  "
                  f"{regs}", flush=True)
        report.append(row)
    return {"cells": report}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--m", nargs="+", type=int, default=None, help="token counts (default 1 32; 8 16 32 with "
                    "--wg-probe)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="also step e at other K splits and ring depths")
    ap.add_argument("--ablate", action="store_true", help="add the ablation rows (module doc)")
    ap.add_argument("--configs", nargs="+", default=[], metavar="TAG",
                    help="step e also at these FlowConfig tags in every cell, e.g. w4-k1-s6-c3-q4-g")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="only the flow rows whose name matches in full, e.g. 'e|e@.*-r2' (cuBLAS and w12 always run)")
    ap.add_argument("--reps", type=int, default=60, help="timed graph replays per row")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip the rows left after this many seconds")
    ap.add_argument("--build-only", action="store_true", help="only NVRTC builds (no GPU needed)")
    ap.add_argument("--arch", type=int, default=90, help="--build-only: compute capability, e.g. 90 or 80")
    ap.add_argument("--sms", type=int, default=132, help="--build-only: SMs the heuristic assumes")
    ap.add_argument("--workers", type=int, default=8, help="parallel NVRTC builds")
    ap.add_argument("--q8", action="store_true",
                    help="the 8-bit view (w12.matmul_q8) instead of the full format: step e of every config")
    ap.add_argument("--trace", action="store_true",
                    help="instead of the ladder: where each launch's time goes, alone and in a chain (module doc)")
    ap.add_argument("--variant", action="append", metavar="LABEL=ITEMS",
                    help="--trace: a build to trace, e.g. g41=gate_up:w4-k1-s3-c4 or cap4=cap:4 (repeatable; "
                         "default the shipped build)")
    ap.add_argument("--trace-reps", type=int, default=5, help="--trace: traced chain replays (medians)")
    ap.add_argument("--ab", metavar="CELLS", default=None,
                    help="instead of the ladder: candidates beside the shipped config, pairs interleaved (module doc); "
                         "CELLS is the JSON, a file holding it, or presets' names, e.g. xh,xs (module doc)")
    ap.add_argument("--rounds", type=int, default=20, help="--ab / --batch: interleaved rounds a pair")
    ap.add_argument("--promote", action="store_true",
                    help="--ab / --batch: store the winning candidates as this GPU's tuned entries where "
                         "autotune.promote accepts them (module doc)")
    ap.add_argument("--wg-probe", action="store_true",
                    help="instead of the ladder: the warpgroup build's shapes with one and two wgmma groups in flight "
                         "(with --ablate also without the fence and barrier, and without the x stores)")
    ap.add_argument("--forms", action="store_true",
                    help="instead of the ladder: w12.matmul on the planes against the runtime layout (module doc)")
    ap.add_argument("--forms-m", nargs="+", type=int, default=[1, 32, 48, 96, 128, 256],
                    help="--forms: bf16 row counts")
    ap.add_argument("--forms-fp16-m", nargs="*", type=int, default=[1, 8, 16, 32, 48],
                    help="--forms: fp16 row counts")
    ap.add_argument("--batch", action="store_true",
                    help="instead of the ladder: the batch kernel beside matmul_tiled's paths above 32 rows (module "
                         "doc); with --promote its winners become tuned entries")
    ap.add_argument("--batch-layers", nargs="+", default=list(LAYERS), metavar="LAYER",
                    help="--batch: layers (AB_LAYERS names)")
    ap.add_argument("--batch-m", nargs="+", type=int, default=[16, 24, 32, 40, 64, 72, 96, 128, 136, 200, 256, 280],
                    help="--batch: row counts")
    ap.add_argument("--batch-configs", nargs="*", default=[], metavar="TAG",
                    help="--batch: more BatchConfig tags to time in every cell, e.g. n64-t128-g1-k2-w4-s4")
    ap.add_argument("--even-split", action="store_true",
                    help="instead of the ladder: the even-split probe at 32 tokens (w12/csrc/w12_probe.cu) beside cuBLAS "
                         "and the shipped flow kernel (module doc)")
    ap.add_argument("--probe-layers", nargs="+", default=["o_proj", "down_proj"], metavar="LAYER",
                    help="--even-split: layers (AB_LAYERS names whose rows fill their row blocks)")
    args = ap.parse_args(argv)
    from w12.configs import FlowConfig

    args.configs = [FlowConfig.from_tag(t) for t in args.configs]
    if args.m is None:
        args.m = [8, 16, 32] if args.wg_probe else [1, 32]
    if args.wg_probe and args.only is None:  # the warpgroup rows and the heuristic's step e beside them
        args.only = r"e|e@.*-g(-.*)?"
    return args


def _forms_cell(layer, M, dtype, copies, reps):
    """One --forms cell: the planes, the runtime layout and cuBLAS at M rows of `dtype` x, checked, then timed."""
    from specpilot.bench.timing import time_fns
    from specpilot.testing import assert_close

    import w12

    N, K = copies[0][0].shape
    x = (torch.randn(M, K, device="cuda") * 0.5).to(dtype)
    ref = x.double() @ copies[0][0].double().T
    row = {"layer": layer, "M": M, "dtype": str(dtype).removeprefix("torch."), "N": N, "K": K}
    wd = [w if dtype == torch.bfloat16 else w.to(dtype) for w, _, _ in copies]
    fns = {"cublas": [lambda w=w: F.linear(x, w) for w in wd],
           "planes": [lambda p=p: w12.matmul(x, p) for _, p, _ in copies],
           "runtime": [lambda t=t: w12.matmul(x, t) for _, _, t in copies]}
    for name in ("planes", "runtime"):
        assert_close(fns[name][0](), ref, F.linear(x, wd[0]), msg=f"{layer} M={M} {dtype} {name}")
    for name, f in fns.items():
        row[name + "_us"] = time_fns(f, reps=reps).median * 1e6
    row["runtime_over_planes"] = row["runtime_us"] / row["planes_us"]
    row["cublas_over_runtime"] = row["cublas_us"] / row["runtime_us"]
    print(f"{layer:18s} M={M:4d} {row['dtype']:9s} cuBLAS {row['cublas_us']:8.1f}  planes {row['planes_us']:8.1f}  "
          f"runtime {row['runtime_us']:8.1f}  runtime/planes {row['runtime_over_planes']:.3f}", flush=True)
    return row


def forms_main(args) -> int:
    """--forms: the planes against the runtime layout through w12.matmul (module doc), into $OUT/w12-forms.json."""
    if not torch.cuda.is_available():
        print("w12_ladder: --forms times on a CUDA GPU", file=sys.stderr)
        return 2
    import w12
    from autotune.config import versions
    from specpilot.bench.shapes import get_shape_set

    shapes = get_shape_set("hybrid-27b")
    layers = {**shapes.linears, "lm_head.linear": shapes.lm_head}
    rows, t0 = [], time.perf_counter()
    torch.manual_seed(0)
    for layer, (N, K) in layers.items():
        w0 = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
        copies = []
        for i in range(weight_copies(N, K)):
            w = w0 if i == 0 else w0.clone()
            p = w12.pack(w, layout="planes")
            copies.append((w, p, w12.layout.tile(p)))
        for dtype, ms in ((torch.bfloat16, args.forms_m), (torch.float16, args.forms_fp16_m)):
            rows += [_forms_cell(layer, M, dtype, copies, args.reps) for M in ms]
        del copies, w0
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), **versions(), "wall_s": round(time.perf_counter() - t0, 1),
            "method": "medians of CUDA-graph replays over rotated weight copies (specpilot.bench.timing.time_fns)"}
    out = Path(os.environ.get("OUT", ".")) / "w12-forms.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def ab_promote(report: dict, device=None) -> list[dict]:
    """--promote: per cell of at most 32 rows, the fastest candidate that is a plain config (no defines, not timing
    only) and within the fp32 check, against the shipped config by `autotune.promote` on their paired rounds; a
    promoted one is stored as this GPU's tuned entry `w12.matmul/flow/<shape key>` (`autotune.store_tuned`, read
    by `w12.configs.flow_config`), with the decision. Returns one record per cell; the same go into the report."""
    import autotune
    from autotune.promotion import promote
    from w12.configs import FlowConfig

    out = []
    for row in report["cells"]:
        n, k = ab_layer_shape(row["layer"])
        key = autotune.shape_key(M=row["M"], N=n, K=k)
        rec = {"layer": row["layer"], "M": row["M"], "key": key, "ship": row["ship"], "stored": False}
        cands = [(label, r) for label, r in row["cands"].items()
                 if "error" not in r and r["ok"] and not r["timing_only"] and not r["defines"]]
        if row["M"] > 32:
            rec["note"] = "above 32 rows the shipped path is 32-row pieces: nothing to store"
        elif not cands:
            rec["note"] = "no plain candidate passed its check"
        else:
            label, best = min(cands, key=lambda c: c[1]["ratio"])
            d = promote(best["ship_samples_us"], best["cand_samples_us"])
            rec.update(label=label, tag=best["tag"], ratio=best["ratio"], decision=d.to_dict())
            if d.promoted:
                autotune.store_tuned("w12.matmul", "flow", key, FlowConfig.from_tag(best["tag"]), device=device,
                                     extra={"source": "perf/w12_ladder.py --ab --promote", "ship": row["ship"],
                                            "ship_us": best["ship_us"], "cand_us": best["cand_us"],
                                            "promotion": d.to_dict()})
                rec["stored"] = True
        row["promotion"] = rec
        print(f"promote {row['layer']} M={row['M']}: " + (f"{rec['tag']} ratio {rec['ratio']:.3f}, "
              f"{'stored' if rec['stored'] else 'kept ' + row['ship']} ({rec['decision']['reason']})"
              if "decision" in rec else rec["note"]), flush=True)
        out.append(rec)
    return out


def ab_write(report: dict, args, t0: float, name: str) -> Path:
    """The report of --ab or --batch with its meta (GPU, versions, rounds, wall time since t0, --promote) as
    $OUT/<name>; returns the path."""
    from autotune.config import versions

    report["meta"] = {"gpu": torch.cuda.get_device_name(), **versions(), "rounds": args.rounds,
                      "wall_s": round(time.perf_counter() - t0, 1), "promote": args.promote}
    out = Path(os.environ.get("OUT", ".")) / name
    out.write_text(json.dumps(report, indent=1))
    return out


AB_PRESETS = ("xh", "xs")


def ab_preset(name: str) -> str | None:
    """The cells of named --ab presets as JSON (several joined by commas: "xh,xs"), or None where `name` is not a list
    of them. "xh": x reloaded by halves (docs/w12-kernels.md, "x reloaded by halves"),
    `w4-k2-s3-c4-q3-h` and `w4-k2-s3-c5-q4-h`, at 16 and 32 rows on o_proj and down_proj. "xs": x through a shared
    ring per K piece (docs/w12-kernels.md, "x through a shared ring"): one-K-piece CTAs of 4 warps in clusters of 4 or
    3 (one or two row blocks a warp; and split 4 ways through memory), of 2 warps in clusters of 4 (twice the CTAs,
    4-5 an SM on o_proj instead of 2-3) and the shipped 5120-row shape with it, at 16, 24 and 32 rows on o_proj and 16
    and 32 on down_proj; one-K-piece CTAs unsplit and in clusters of 2 at 32 rows on in_proj and qkv_proj, at 16, 24
    and 32 on gate_up and at 32 on the LM head."""
    names = name.split(",")
    if not all(n in AB_PRESETS for n in names):
        return None
    cells = []
    if "xs" in names:
        small = ("w4-k1-s3-c5-q4-xs", "w4-k1-s4-c5-q4-xs", "w4-k1-s3-c5-q3-xs", "w4-k1-s3-c4-r2-q4-xs",
                 "w4-k1-s3-c5-p4-xs", "w4-k2-s3-c4-q3-xs", "w2-k1-s3-c8-q4-xs")
        cells += [[layer, m, [[tag, tag, {}] for tag in small]]
                  for layer, ms in (("o_proj", (16, 24, 32)), ("down_proj", (16, 32))) for m in ms]
        large = ("w4-k1-s3-c5-xs", "w4-k1-s4-c5-xs", "w4-k1-s3-c5-q2-xs")
        cells += [[layer, m, [[tag, tag, {}] for tag in large]]
                  for layer, ms in (("in_proj", (32,)), ("qkv_proj", (32,)), ("gate_up", (16, 24, 32)),
                                    ("lm_head", (32,))) for m in ms]
    if "xh" in names:
        cells += [[layer, m, [[tag, tag, {}] for tag in ("w4-k2-s3-c4-q3-h", "w4-k2-s3-c5-q4-h")]]
                  for layer in ("o_proj", "down_proj") for m in (16, 32)]
    return json.dumps(cells)


def ab_main(args) -> int:
    """--ab: the cells' builds (with --build-only) or their A/B on the GPU, into $OUT/w12-ab.json; on the GPU every
    build is compiled first, in `--workers` processes."""
    text = ab_preset(args.ab) or (Path(args.ab).read_text() if Path(args.ab).is_file() else args.ab)
    try:
        cells = ab_parse_cells(text)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.build_only:
        return ab_build_only(cells, (args.arch // 10, args.arch % 10), args.sms, args.workers)
    if not torch.cuda.is_available():
        print("w12_ladder: no CUDA device; use --build-only on a CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    precompile([_ab_build(*b, n) for b, n in ab_builds(cells, dev).items()], torch.cuda.get_device_capability(dev),
               workers=args.workers)
    print(f"built the A/B's specialisations in {time.perf_counter() - t0:.1f} s", flush=True)
    report = ab_run(cells, args.rounds)
    if args.promote:
        ab_promote(report)
    out = ab_write(report, args, t0, "w12-ab.json")
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------------------
# --batch: the batch kernel beside matmul_tiled's paths above 32 rows (module doc)
# --------------------------------------------------------------------------------------


def batch_candidates(m: int, n: int, k: int, device, extra=()) -> list:
    """The batch kernel's configs timed at (m, n, k): the heuristic's, its neighbours (no split, half and twice its
    split, four stages; above 64 rows of x: 64 rows of x a program, and two or four warpgroups a program over 128 or
    256 weight rows; up to 64: two warpgroups over 128 weight rows at half the split, one x tile for both, and one
    64-column group a step at twice the split), the heuristic's and the half split's with the last K share adding the
    partials (`fixup`, one launch), then `extra` (tags); without repeats, in that order."""
    from w12.configs import BatchConfig, batch_heuristic

    h = batch_heuristic(m, n, k, device)
    cands = [h, replace(h, split_k=1), replace(h, split_k=max(1, h.split_k // 2)), replace(h, split_k=2 * h.split_k),
             replace(h, num_stages=4)]
    if m > 64:
        cands.append(replace(h, block_t=64, split_k=max(1, h.split_k // 2)))
        # more weight rows a program, so that fewer programs read the same x (L2 traffic: x is read once a program
        # across N): two warpgroups over 128 rows, four over 256 at 64 rows of x (sm_90 builds on a CPU: 251 and 128
        # registers, no spills; 256 x 128 spills)
        cands.append(replace(h, block_n=128, num_warps=8))
        cands.append(replace(h, block_n=256, block_t=64, groups=1, num_warps=16))
        if m > 128:
            # all of x's rows a program (two warpgroups over 256 of them, 64 weight rows: sm_90 build with kt on a
            # CPU, 402-417 instructions a step, no spills), so that the weight is read once, not once a 128-row tile
            cands.append(replace(h, block_t=256, num_warps=8, kt=True))
    else:  # 128 x 64 and 128 x 32 tiles at 8 warps
        cands.append(replace(h, block_n=128, num_warps=8, split_k=max(1, h.split_k // 2)))
        if h.groups > 1:  # one group a step, its split doubled
            cands.append(replace(h, groups=1, split_k=2 * h.split_k))
    cands += [replace(c, fixup=True) for c in (h, cands[2]) if c.split_k > 1]
    # both k orders (`kt`: 16-byte tile copies) at every candidate of 64 and more rows of x a program
    cands += [replace(c, kt=not c.kt) for c in list(cands) if c.block_t >= 64]
    cands += [BatchConfig.from_tag(t) for t in extra]
    return list(dict.fromkeys(cands))  # BatchConfig is frozen: equal configs, equal tags


def batch_run(layers: list[str], ms: list[int], rounds: int, extra=(), device=None) -> dict:
    """Time every (layer, M) of --batch on the GPU (module doc; `device`: default cuda); the report as a dict."""
    import w12
    from specpilot.bench.timing import time_ab
    from w12.ops import launch_batch

    dev = torch.device("cuda" if device is None else device)
    report = []
    for layer in layers:
        n, k = ab_layer_shape(layer)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ts, w0 = ab_weights(n, k, dev)
        for m in ms:
            x, ref, cub_err = ab_inputs(m, w0)
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ts]
            default = [lambda i=i: w12.matmul_tiled(x, ts[i], out=outs[i]) for i in range(len(ts))]
            default[0]()
            row = {"layer": layer, "M": m, "N": n, "K": k, "cublas_err": cub_err,
                   "default_err": (outs[0].float() - ref).abs().max().item(), "cands": {}}
            ta, tb = time_ab(default, [lambda: F.linear(x, w0)] * len(ts), dev, rounds=rounds)
            row["default_us"], row["cublas_us"] = ta.median * 1e6, tb.median * 1e6
            print(f"{layer} M={m} default {row['default_us']:.1f} us, cuBLAS {row['cublas_us']:.1f}", flush=True)
            for cfg in batch_candidates(m, n, k, dev, extra):
                try:
                    launch_batch(cfg, x, ts[0], None, outs[0])
                    err = (outs[0].float() - ref).abs().max().item()
                    ta, tb = time_ab(default, [lambda i=i: launch_batch(cfg, x, ts[i], None, outs[i])
                                               for i in range(len(ts))], dev, rounds=rounds)
                except Exception as e:  # a failed candidate is a row of the report
                    row["cands"][cfg.tag()] = {"error": repr(e)[:300]}
                    print(f"  {cfg.tag()}: ERROR {e!r}"[:400], flush=True)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()  # an asynchronous fault surfaces here and stops the run
                    continue
                r = {"default_us": ta.median * 1e6, "cand_us": tb.median * 1e6, "err": err,
                     "ok": err <= 2 * cub_err + 1e-6, "default_samples_us": [t * 1e6 for t in ta.samples],
                     "cand_samples_us": [t * 1e6 for t in tb.samples]}
                r["ratio"] = r["cand_us"] / r["default_us"]
                r["cublas_over_cand"] = row["cublas_us"] / r["cand_us"]
                row["cands"][cfg.tag()] = r
                print(f"  {cfg.tag():32s} {r['cand_us']:8.1f} vs {r['default_us']:8.1f} us  ratio {r['ratio']:.3f}  "
                      f"cuBLAS/batch {r['cublas_over_cand']:.3f}  err {err:.4f} (cuBLAS {cub_err:.4f})", flush=True)
            report.append(row)
        del ts, w0
    return {"cells": report}


def batch_promote(report: dict, device=None) -> list[dict]:
    """--batch --promote (module doc): per layer and shape key, the candidate with the best worst ratio over the
    key's row counts, stored as `w12.matmul/batch/<key>` where `autotune.promote` accepts it at every one of them."""
    import autotune
    from autotune.promotion import promote
    from w12.configs import BatchConfig

    groups: dict[tuple[str, str], list[dict]] = {}
    for row in report["cells"]:
        key = autotune.shape_key(M=row["M"], N=row["N"], K=row["K"])
        groups.setdefault((row["layer"], key), []).append(row)
    out = []
    for (layer, key), rows in groups.items():
        rec = {"layer": layer, "key": key, "M": [r["M"] for r in rows], "stored": False}
        tags = [t for t in rows[0]["cands"]
                if all(t in r["cands"] and "error" not in r["cands"][t] and r["cands"][t]["ok"] for r in rows)]
        if not tags:
            rec["note"] = "no candidate passed its check at every row count of the key"
        else:
            tag = min(tags, key=lambda t: max(r["cands"][t]["ratio"] for r in rows))
            ds = [promote(r["cands"][tag]["default_samples_us"], r["cands"][tag]["cand_samples_us"]) for r in rows]
            rec.update(tag=tag, ratios=[r["cands"][tag]["ratio"] for r in rows], decisions=[d.to_dict() for d in ds])
            if all(d.promoted for d in ds):
                autotune.store_tuned("w12.matmul", "batch", key, BatchConfig.from_tag(tag), device=device,
                                     extra={"source": "perf/w12_ladder.py --batch --promote",
                                            "M": rec["M"], "ratios": rec["ratios"],
                                            "cand_us": [r["cands"][tag]["cand_us"] for r in rows],
                                            "default_us": [r["cands"][tag]["default_us"] for r in rows]})
                rec["stored"] = True
        print(f"promote {layer} {key}: " + (f"{rec['tag']} ratios {[round(x, 3) for x in rec['ratios']]}, "
              f"{'stored' if rec['stored'] else 'not stored'}" if "tag" in rec else rec["note"]), flush=True)
        out.append(rec)
    report["promotion"] = out
    return out


def batch_table(report: dict) -> str:
    """--batch's report as a Markdown table: per layer and row count, cuBLAS and the default path (from their pair),
    the fastest candidate that passed its check (from its pair with the default), its ratio to the default and
    cuBLAS's time over it, and the key's promotion where --promote ran."""
    import autotune

    stored = {(p["layer"], p["key"]): p for p in report.get("promotion", [])}
    lines = ["| layer | M | cuBLAS, µs | default, µs | best batch config | its µs | ÷ default | cuBLAS ÷ it "
             "| key stored |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["cells"]:
        ok = [(t, r) for t, r in row["cands"].items() if "error" not in r and r["ok"]]
        key = autotune.shape_key(M=row["M"], N=row["N"], K=row["K"])
        promo = stored.get((row["layer"], key))
        mark = "" if promo is None else ("yes: " + promo["tag"] if promo["stored"] else "no")
        if not ok:
            lines.append(f"| {row['layer']} | {row['M']} | {row['cublas_us']:.1f} | {row['default_us']:.1f} | "
                         f"(none passed) | | | | {mark} |")
            continue
        tag, r = min(ok, key=lambda c: c[1]["ratio"])
        lines.append(f"| {row['layer']} | {row['M']} | {row['cublas_us']:.1f} | {row['default_us']:.1f} | `{tag}` | "
                     f"{r['cand_us']:.1f} | {r['ratio']:.3f} | {row['cublas_us'] / r['cand_us']:.3f} | {mark} |")
    return "\n".join(lines) + "\n"


def batch_main(args) -> int:
    """--batch: the batch kernel's A/B on the GPU, into $OUT/w12-batch.json and its table $OUT/w12-batch.md."""
    if not torch.cuda.is_available():
        print("w12_ladder: --batch times on a CUDA GPU", file=sys.stderr)
        return 2
    for name in args.batch_layers:
        ab_layer_shape(name)  # an unknown layer stops here, before any GPU work
    t0 = time.perf_counter()
    report = batch_run(args.batch_layers, args.batch_m, args.rounds, args.batch_configs)
    if args.promote:
        batch_promote(report)
    out = ab_write(report, args, t0, "w12-batch.json")
    table = batch_table(report)
    out.with_suffix(".md").write_text(table)
    print(table + f"wrote {out} and {out.with_suffix('.md')}")
    return 0


# --------------------------------------------------------------------------------------
# --even-split: the even-split probe at 32 tokens (w12/csrc/w12_probe.cu)
# --------------------------------------------------------------------------------------

PROBE_KERNEL = "w12_probe_kernel"
PROBE_STAGES = 4
PROBE_XSLOT = 8 * 4 * 144  # one unit of x for 32 tokens in the probe's shared ring (rows padded to 144 bytes)
# (name, warps, CTAs per SM, assignment, x, full): assignment 0 round robin, 1 equal runs a warp, 2 equal runs of
# group-units a CTA; x 0 held in registers, 1 each warp's own loads from global memory, 2 one shared ring a CTA;
# full: the whole product (W12P_FULL: window bases, escapes, the pieces met through the workspace, bf16 out)
PROBE_VARIANTS = [
    ("rr-x0-w8c2", 8, 2, 0, 0, 0), ("rr-x1-w8c2", 8, 2, 0, 1, 0),
    ("runs-x0-w16c1", 16, 1, 1, 0, 0), ("runs-x1-w16c1", 16, 1, 1, 1, 0),
    ("runs-x0-w8c2", 8, 2, 1, 0, 0), ("runs-x1-w8c2", 8, 2, 1, 1, 0),
    ("groups-x0-w16c1", 16, 1, 2, 0, 0), ("groups-x1-w16c1", 16, 1, 2, 1, 0), ("groups-x2-w16c1", 16, 1, 2, 2, 0),
    ("groups-x1-w8c2", 8, 2, 2, 1, 0), ("groups-x2-w8c2", 8, 2, 2, 2, 0),
    ("full-runs-x1-w16c1", 16, 1, 1, 1, 1), ("full-groups-x1-w16c1", 16, 1, 2, 1, 1),
    ("full-groups-x2-w16c1", 16, 1, 2, 2, 1), ("full-groups-x2-w8c2", 8, 2, 2, 2, 1),
]


def probe_smem(warps: int, x: int) -> int:
    """Dynamic shared memory of one probe CTA: each warp's ring of weight tiles, and with x = 2 the CTA's x ring."""
    return warps * PROBE_STAGES * 1536 + (PROBE_STAGES * PROBE_XSLOT if x == 2 else 0)


def probe_build(warps: int, cps: int, assign: int, x: int, full: int = 0, arch: str = "sm_90"):
    """The NVRTC build of one probe variant (autotune.jit, cached; w12_common.cuh is part of its key)."""
    from autotune import jit
    from w12.flow import SOURCE

    defines = dict(W12P_WARPS=warps, W12P_CPS=cps, W12P_ASSIGN=assign, W12P_X=x, W12P_STAGES=PROBE_STAGES,
                   W12P_FULL=full)
    return jit.compile(SOURCE.with_name("w12_probe.cu"), arch=arch, defines=defines,
                       name=f"w12_probe-w{warps}c{cps}-a{assign}-x{x}-f{full}-s{PROBE_STAGES}")


def _probe_workers(assign: int, R: int, U: int, ctas: int, warps: int) -> tuple[int, int]:
    """(P workers, T items) of an assignment: the grid's warps and R U tiles (1), or its CTAs and the groups' units
    (2)."""
    return (ctas, -(-R // warps) * U) if assign == 2 else (ctas * warps, R * U)


def probe_items(assign: int, R: int, U: int, ctas: int, warps: int) -> list[list[tuple[int, int]]]:
    """The (row block, unit) pairs each warp of a probe grid multiplies, in order, as w12_probe.cu's cursors step
    through them (row blocks past R included: the kernel skips their tiles); warp w of CTA b at index b warps + w."""
    nw, total = ctas * warps, R * U
    P, T = _probe_workers(assign, R, U, ctas, warps)
    out = []
    for b in range(ctas):
        for w in range(warps):
            gw = b * warps + w
            if assign == 0:
                first, n, rstep, cstep = gw, ((total - 1 - gw) // nw + 1 if gw < total else 0), nw // U, nw % U
            else:
                me = b if assign == 2 else gw
                first, rstep, cstep = T * me // P, 0, 1
                n = T * (me + 1) // P - first
            wrap = warps if assign == 2 else 1
            rb, c = ((first // U) * warps + w, first % U) if assign == 2 else (first // U, first % U)
            seq = []
            for _ in range(n):
                seq.append((rb, c))
                rb, c = rb + rstep, c + cstep
                if c >= U:
                    c, rb = c - U, rb + wrap
            out.append(seq)
    return out


def probe_pieces(assign: int, R: int, U: int, ctas: int, warps: int) -> dict[int, list[tuple[int, int]]]:
    """The whole product's fix-up as w12_probe.cu computes it: for each row block, its pieces in the order the last
    warp adds them, as (worker, workspace slot): workers p0..p1 from `worker_of` on the key's first and last items,
    slot ((worker 2 + side) WPW + warp in worker), side 0 where the key is the worker's first."""
    P, T = _probe_workers(assign, R, U, ctas, warps)
    wpw = warps if assign == 2 else 1

    def worker_of(t: int) -> int:
        return (P * (t + 1) - 1) // T

    out = {}
    for rb in range(R):
        key, wi = (rb // warps, rb % warps) if assign == 2 else (rb, 0)
        p0, p1 = worker_of(key * U), worker_of(key * U + U - 1)
        out[rb] = [(q, (q * 2 + (0 if key == T * q // P // U else 1)) * wpw + wi) for q in range(p0, p1 + 1)]
    return out


def probe_fits(assign: int, R: int, U: int, ctas: int, warps: int) -> str | None:
    """Why the whole product cannot run a shape on this grid (None where it can): every worker needs an item, and a
    run of at most U items (at most two keys, the workspace's two slots)."""
    P, T = _probe_workers(assign, R, U, ctas, warps)
    if T < P:
        return f"{T} items for {P} workers: some would have none"
    if -(-T // P) > U:
        return f"runs of up to {-(-T // P)} items for {U} units a key: more than two keys a run"
    return None


def probe_run(layers: list[str], rounds: int, variants=None) -> dict:
    """Every probe variant, cuBLAS and `w12.matmul_tiled` (the shipped flow config) at 32 rows of each layer, every row
    timed once a round over rotated weight copies (time_cuda), the order of the rows rotating between rounds. The
    whole-product builds are first checked against fp64 (every 7th output column) and run only where they pass."""
    import statistics

    import w12
    from autotune import jit
    from specpilot.bench.timing import time_cuda

    M, dev = 32, torch.device("cuda")
    sms, cc = torch.cuda.get_device_properties(dev).multi_processor_count, torch.cuda.get_device_capability(dev)
    kernels = {}
    for name, warps, cps, assign, x, full in PROBE_VARIANTS if variants is None else variants:
        k = jit.load(probe_build(warps, cps, assign, x, full, f"sm_{cc[0]}{cc[1]}").cubin.read_bytes(), PROBE_KERNEL,
                     torch.cuda.current_device())
        k.set_max_dynamic_smem(probe_smem(warps, x))
        kernels[name] = (k, warps, cps, assign, x, full)
    report = {"M": M, "sms": sms, "cells": []}
    types = (jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.I32, jit.I32, jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.PTR, jit.PTR)
    for layer in layers:
        N, K = ab_layer_shape(layer)
        if N % 16 or K % 64:
            raise ValueError(f"w12_ladder --even-split: {layer} ({N} x {K}) has a partial row block or unit")
        R, U = N // 16, K // 64
        tiled, wb = ab_weights(N, K, dev)
        dense = [wb] + [wb.clone() for _ in tiled[1:]]
        torch.manual_seed(_SEED)
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        ws = torch.empty(sms * 16 * 3 * 512, dtype=torch.float32, device=dev)  # up to 3 slots of sums a warp
        sink = torch.empty(sms * 512, dtype=torch.float32, device=dev)
        cols = torch.arange(0, N, 7, device=dev)
        fns = {"cublas": [lambda d=d: torch.mm(x, d.T, out=out) for d in dense],
               "flow": [lambda t=t: w12.matmul_tiled(x, t, out=out) for t in tiled]}
        errors = {}
        for name, (k, warps, cps, assign, xf, full) in kernels.items():
            why = probe_fits(assign, R, U, sms * cps, warps) if full else None
            if why is not None:
                errors[name] = f"not run: {why}"
                continue
            o = torch.empty(M, N, dtype=torch.bfloat16, device=dev) if full else out
            counters = torch.zeros(R, dtype=torch.int32, device=dev)

            def launch(t, k=k, warps=warps, cps=cps, xf=xf, o=o, counters=counters):
                k.launch((sms * cps, 1, 1), 32 * warps, probe_smem(warps, xf), torch.cuda.current_stream().cuda_stream,
                         (t.tiles.data_ptr(), x.data_ptr(), ws.data_ptr(), sink.data_ptr(), R, U, t.e0.data_ptr(),
                          t.esc_rowptr.data_ptr(), t.esc_col.data_ptr(), t.esc_val.data_ptr(), o.data_ptr(),
                          counters.data_ptr()), types)

            if full:
                try:
                    launch(tiled[0])
                    _sync(f"--even-split {layer} {name}", dev)
                    _check(o, x, wb, cols, f"{layer} {name}")
                    o.fill_(float("nan"))
                    launch(tiled[0])  # again: the first launch set the counters back to zero
                    _sync(f"--even-split {layer} {name}", dev)
                    _check(o, x, wb, cols, f"{layer} {name}, second launch")
                except AssertionError as e:
                    errors[name] = f"check failed: {str(e).splitlines()[0][:300]}"
                    continue
            fns[name] = [lambda t=t, launch=launch: launch(t) for t in tiled]
        samples = {r: [] for r in fns}
        names = list(fns)
        for i in range(rounds):
            for r in names[i % len(names):] + names[:i % len(names)]:
                samples[r].append(time_cuda(fns[r], reps=20, warmup=2).median * 1e6)
            _sync(f"--even-split {layer}", dev)
        w12_bytes, bf16_bytes = tiled[0].tiles.numel(), wb.numel() * 2
        base = statistics.median(samples["cublas"])
        rows = {}
        for r, s in samples.items():
            us, srt = statistics.median(s), sorted(s)
            nbytes = bf16_bytes if r == "cublas" else w12_bytes
            rows[r] = dict(us=us, p10=srt[len(s) // 10], p90=srt[9 * len(s) // 10], samples_us=s,
                           tbs=nbytes / us / 1e6, vs_cublas=base / us)
            print(f"{layer} M={M} {r}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s, {base / us:.3f}x cuBLAS", flush=True)
        for r, e in errors.items():
            print(f"{layer} M={M} {r}: {e}", flush=True)
        report["cells"].append(dict(layer=layer, N=N, K=K, w12_bytes=w12_bytes, bf16_bytes=bf16_bytes, rows=rows,
                                    errors=errors))
    return report


def probe_table(report: dict) -> str:
    lines = ["| layer | row | µs (median) | p10-p90 | TB/s | % of 4.28 TB/s | x cuBLAS |",
             "|---|---|---|---|---|---|---|"]
    for cell in report["cells"]:
        for r, c in cell["rows"].items():
            lines.append(f"| {cell['layer']} | {r} | {c['us']:.1f} | {c['p10']:.1f}-{c['p90']:.1f} | {c['tbs']:.2f} | "
                         f"{100 * c['tbs'] / COPY_TBS:.0f}% | {c['vs_cublas']:.3f} |")
        for r, e in cell.get("errors", {}).items():
            lines.append(f"| {cell['layer']} | {r} | {e} | | | | |")
    return "\n".join(lines) + "\n"


def probe_main(args) -> int:
    """--even-split: the probe's builds (registers, spills), then on a GPU its rows beside cuBLAS and the shipped
    flow kernel, into $OUT/w12-even-split.json and its table $OUT/w12-even-split.md."""
    import re

    t0 = time.perf_counter()
    variants = [v for v in PROBE_VARIANTS if args.only is None or re.fullmatch(args.only, v[0])]
    builds = {}
    for name, warps, cps, assign, x, full in variants:
        builds[name] = dict(probe_build(warps, cps, assign, x, full, f"sm_{args.arch}").resources(),
                            smem=probe_smem(warps, x))
        r = builds[name]
        print(f"{name}: {r['registers']} registers, {r['spill_stores'] + r['spill_loads']} bytes spilled, "
              f"{r['smem']} bytes of shared memory", flush=True)
    if args.build_only:
        return 0
    if not torch.cuda.is_available():
        print("w12_ladder: --even-split times on a CUDA GPU (sm_90); --build-only builds without one", file=sys.stderr)
        return 2
    for name in args.probe_layers:
        ab_layer_shape(name)
    report = probe_run(args.probe_layers, args.rounds, variants)
    report["builds"] = builds
    out = ab_write(report, args, t0, "w12-even-split.json")
    table = probe_table(report)
    out.with_suffix(".md").write_text(table)
    print(table + f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.even_split:
        return probe_main(args)
    if args.batch:
        return batch_main(args)
    if args.forms:
        return forms_main(args)
    if args.ab is not None:
        return ab_main(args)
    if args.build_only:
        return build_only(args)
    if not torch.cuda.is_available():
        print("w12_ladder: no CUDA device; use --build-only on a CPU", file=sys.stderr)
        return 2
    from autotune.config import versions

    t0 = time.perf_counter()
    if args.trace:
        trows, raw = trace_run(args)
        table = format_trace(trows)
        print("\n" + table, flush=True)
        if os.environ.get("OUT"):
            import numpy as np

            meta = {"gpu": torch.cuda.get_device_name(), **versions(), "copy_tbs": COPY_TBS,
                    "wall_s": round(time.perf_counter() - t0, 1), "args": {**vars(args), "configs": []}}
            Path(os.environ["OUT"], "w12-trace.md").write_text(table + "\n")
            Path(os.environ["OUT"], "w12-trace.json").write_text(json.dumps({"meta": meta, "rows": trows}, indent=1))
            np.savez_compressed(Path(os.environ["OUT"], "w12-trace-stamps.npz"), **raw)
        return 0
    rows: list[Row] = []
    try:
        rows = run(args)
    except Exception:
        traceback.print_exc()
    meta = {"gpu": torch.cuda.get_device_name(), **versions(), "wall_s": round(time.perf_counter() - t0, 1),
            "copy_tbs": COPY_TBS, "args": {**vars(args), "configs": [c.tag() for c in args.configs]}}
    write_outputs(rows, meta)
    failed = [r for r in rows if r.status != "ok" and not r.status.startswith("skipped")]
    print(f"\n{len(rows)} rows, {len(failed)} failed, {meta['wall_s']} s", flush=True)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
