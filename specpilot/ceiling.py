"""The cost model of a speculative decoding step (`specpilot ceiling`, docs/ceiling.md).

For a shape set, a GPU, a weight format and a step of `rows` rows (1: the autoregressive step; the tree's
node count: the verify step) over a `prefix`-token context, every kernel class gets its FLOPs, its bytes
and its byte floor: the slower of the FLOPs at the BF16 matmul rate and the bytes at the copy rate, the
rates measured where they were measured (`Peaks`; `autotune.byte_floor`), never discounted. The paper's
floor (60% of the datasheet's peak compute, 90% of its peak bandwidth; `autotune.paper_floor`) is reported
beside it, labelled as the paper's. The step floor is the sum of the class floors (each class runs as its
own kernels, one after the other). From floors and measured step times:

* the ceiling speedup over autoregressive decoding: tau / (t_verify / t_ar);
* the three factors of the paper, as speedups of the verify step (the step that sets tokens/s):
  leftover tree acceptance (tau_ideal / tau), distance to the byte floor (the step with every profiled
  class at its floor, the time outside the profile unchanged) and time outside the profile (the step
  without it);
* a prediction of the verify step from per-operator benchmark JSONs (`specpilot bench`), checked
  against the engine's measured verify step (`python -m specpilot.bench.engine`).

Bytes count what each kernel must move once: weights in the step's format, the KV prefix, the fp32
recurrent state, inputs and outputs. W12 weights take `N*Kp*1.5 + N*5 + 4 + 6*E` bytes (docs/w12-format.md;
E escapes, `escapes` = E / (N*K)). The certified LM head reads its INT8 screen copy (`lmhead`); its INT8
products count as BF16-equivalent FLOPs (scaled by the BF16 / INT8 peak ratio), and the exact recompute
of the survivors is left out (a few rows of the head when the screen is sharp).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import autotune
from autotune.hardware import BANDWIDTH_FRACTION, COMPUTE_FRACTION, GPUS, GpuSpec, floor_rates

from .bench.shapes import ModelShapes, get_shape_set

__all__ = ["CLASSES", "ENGINE_GROUPS", "Cost", "Peaks", "peaks", "linear_bytes", "step_costs", "step_floor_ms",
           "ceiling_speedup", "engine_measured", "compare", "factors", "perop_times", "predict_verify", "report",
           "markdown", "plot"]

CLASSES = ("linears", "lm head", "gdn verify", "gdn conv", "gdn commit", "tree attention", "glue")
FORMATS = ("bf16", "w12")
SCREENS = ("int8", "w12", "none")
_BF16 = 2

# Measured groups: (label, model classes, engine profile categories). The engine (specpilot/bench/engine.py,
# `_CATEGORIES`) names a kernel's category by the first regex that matches its name, so:
# * "gdn verify" holds gdn_tree_cuda_kernel (or the Triton tree kernels) and gdn_tree_conv_kernel: the tree
#   conv matches `gdn_tree` before `gdn.*conv`;
# * "gdn conv" holds gdn_commit_conv_kernel (the commit's conv-state copy), "gdn commit" gdn_commit_state_kernel;
# * "other (norms, gates, copies)" is every kernel no other regex claims: the glue of the model; "memcpy / memset"
#   (a graph's copy and fill nodes) is glue too.
ENGINE_GROUPS = (
    ("linears", ("linears",), ("cuBLAS GEMM", "w12 GEMM")),
    ("lm head", ("lm head",), ("lm head",)),
    ("gdn verify + conv", ("gdn verify", "gdn conv"), ("gdn verify",)),
    ("gdn commit", ("gdn commit",), ("gdn commit", "gdn conv")),
    ("tree attention", ("tree attention",), ("tree attention",)),
    ("glue", ("glue",), ("other (norms, gates, copies)", "memcpy / memset")),
)


def _err(fn: str, what: str, fix: str) -> ValueError:
    return ValueError(f"specpilot.ceiling.{fn}: {what}; {fix}")


# --------------------------------------------------------------------------------------------
# Peaks and floors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peaks:
    """The rates a floor is taken against (copy TB/s, BF16 matmul TFLOP/s, INT8 TOP/s) and where they come from:
    `source` names the measurement, or says "datasheet" where nothing was measured. `datasheet_*`: the GPU's
    datasheet peaks, which the paper's floor takes 60% and 90% of."""

    gpu: str
    bandwidth_tbs: float
    bf16_tflops: float
    int8_tops: float
    source: str = "datasheet"
    datasheet_bandwidth_tbs: float = 0.0
    datasheet_bf16_tflops: float = 0.0

    def spec(self) -> GpuSpec:
        """A GpuSpec whose datasheet and measured rates are the floor's rates, for `autotune.byte_floor`."""
        return GpuSpec(self.gpu, self.bandwidth_tbs, self.bf16_tflops, self.int8_tops, 0.0, 0, (0, 0), False,
                       copy_tbs=self.bandwidth_tbs, matmul_tflops=self.bf16_tflops)

    def floor_s(self, flops: float, nbytes: float) -> float:
        """The physical floor: FLOPs at the BF16 rate, bytes at the copy rate, the slower of the two."""
        return autotune.byte_floor(flops, nbytes, self.spec())

    def paper_floor_s(self, flops: float, nbytes: float) -> float:
        """The paper's floor (`autotune.paper_floor`): FLOPs at 60% of the datasheet's BF16 peak, bytes at 90% of
        its bandwidth."""
        sheet = GpuSpec(self.gpu, self.datasheet_bandwidth_tbs, self.datasheet_bf16_tflops, 0.0, 0.0, 0, (0, 0), False)
        return autotune.paper_floor(flops, nbytes, sheet)


def _slug(gpu: str) -> str:
    for slug, spec in GPUS.items():
        if autotune.gpu_spec(gpu) is spec:
            return slug
    return gpu


def peaks(gpu: str | GpuSpec = "h200", measured: str | Path | dict | None = None) -> Peaks:
    """Floor rates of `gpu` (a name or slug of `autotune.GPUS`, or a GpuSpec): the rates measured on that GPU
    model (`GpuSpec.copy_tbs`, `matmul_tflops`) where it has them, else its datasheet's; or, with `measured`, the
    roofs a `specpilot bench` run measured (its JSON file or its meta dict: `ceilings.copy_tbs`,
    `ceilings.bf16_tflops`); `measured="datasheet"` takes the datasheet's peaks whatever was measured (a lower
    floor). INT8 keeps the datasheet's ratio to BF16."""
    spec = gpu if isinstance(gpu, GpuSpec) else autotune.gpu_spec(gpu) if isinstance(gpu, str) else None
    if spec is None:
        raise _err("peaks", f"unknown GPU {gpu!r}", f"pass one of {sorted(GPUS)} or a GpuSpec")
    name = _slug(gpu) if isinstance(gpu, str) else spec.name
    sheet = dict(datasheet_bandwidth_tbs=spec.bandwidth_tbs, datasheet_bf16_tflops=spec.bf16_tflops)
    int8 = spec.int8_tops / spec.bf16_tflops
    if measured is None:
        bw, rate, src = floor_rates(spec)
        return Peaks(name, bw / 1e12, rate / 1e12, rate / 1e12 * int8, src, **sheet)
    if measured == "datasheet":
        return Peaks(name, spec.bandwidth_tbs, spec.bf16_tflops, spec.int8_tops, "datasheet", **sheet)
    src = "meta"
    if not isinstance(measured, dict):
        src = str(measured)
        try:
            measured = json.loads(Path(measured).read_text()).get("meta", {})
        except (OSError, ValueError, AttributeError) as e:
            raise _err("peaks", f"cannot read measured roofs from {src!r} ({e})",
                       "pass a results JSON of `specpilot bench` (it has meta.ceilings)") from None
    c = measured.get("ceilings") or {}
    bw, bf = c.get("copy_tbs"), c.get("bf16_tflops")
    if not (isinstance(bw, (int, float)) and isinstance(bf, (int, float)) and bw > 0 and bf > 0):
        raise _err("peaks", f"{src} holds no measured roofs (meta.ceilings = {c!r})",
                   "pass a results JSON of a GPU run of `specpilot bench`, or use the datasheet peaks")
    return Peaks(name, float(bw), float(bf), float(bf) * int8, f"measured ({src})", **sheet)


# --------------------------------------------------------------------------------------------
# FLOPs and bytes per kernel class
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One kernel class of a step. `flops`: BF16-equivalent FLOPs; `floor_ms`: the physical floor of them
    (`Peaks.floor_s`); `bound`: which term sets it; `paper_floor_ms`: the paper's floor (`Peaks.paper_floor_s`);
    `parts`: per linear name for "linears"."""

    name: str
    flops: float
    bytes: float
    floor_ms: float
    bound: str
    calls: int = 1
    parts: tuple = field(default_factory=tuple)
    paper_floor_ms: float = 0.0


def linear_bytes(N: int, K: int, weights: str, escapes: float = 0.0) -> float:
    """Bytes of one [N, K] weight: BF16 2*N*K; W12 N*Kp*1.5 + N*5 + 4 + 6*E (Kp = K rounded up to 64,
    E = round(escapes * N * K), docs/w12-format.md)."""
    if weights == "bf16":
        return float(_BF16 * N * K)
    if weights == "w12":
        kp = -(-K // 64) * 64
        return N * kp * 1.5 + N * 5 + 4 + 6 * round(escapes * N * K)
    raise _err("linear_bytes", f"weights={weights!r}", "pass 'bf16' or 'w12'")


def _cost(name, flops, nbytes, pk: Peaks, calls=1, parts=()) -> Cost:
    s = pk.floor_s(flops, nbytes)
    bound = "compute" if flops / pk.bf16_tflops > nbytes / pk.bandwidth_tbs else "bytes"
    return Cost(name, float(flops), float(nbytes), 1e3 * s, bound, calls, tuple(parts),
                1e3 * pk.paper_floor_s(flops, nbytes))


def _default_screen(gpu: str, weights: str) -> str:
    """The screen `lmhead.CertifiedHead(screen="auto")` takes on this GPU (lmhead/configs.py: AUTO_SCREEN)."""
    from lmhead.configs import AUTO_SCREEN

    return AUTO_SCREEN.get(gpu, {}).get(weights, "none")


def _shapes(shapes) -> ModelShapes:
    if isinstance(shapes, ModelShapes):
        return shapes
    try:
        return get_shape_set(shapes)
    except ValueError as e:
        raise _err("step_costs", str(e),
                   "pass a name from specpilot.bench.shapes.SHAPE_SETS or a ModelShapes") from None


def step_costs(shapes: str | ModelShapes, rows: int, *, prefix: int = 4096, weights: str = "bf16",
               gpu: str | GpuSpec | Peaks = "h200", screen: str | None = None, escapes: float = 0.0,
               accepted: int = 1) -> dict[str, Cost]:
    """FLOPs, bytes and byte floor of every kernel class (`CLASSES`) of one request's step of `rows` rows
    (the root and the tree below it) over `prefix` cached tokens, weights in `weights`.

    screen: the LM head's screen ("int8": an INT8 copy of the head, "w12": the W12 8-bit view, "none": the
    exact head over the whole weight; default: the one `lmhead` picks on this GPU). accepted: the nodes the
    commit advances the state by (the root and the accepted path; 1 when nothing is accepted)."""
    s = _shapes(shapes)
    pk = gpu if isinstance(gpu, Peaks) else peaks(gpu)
    if not isinstance(rows, int) or rows < 1:
        raise _err("step_costs", f"rows={rows!r}", "pass the step's rows as an int >= 1 (1: autoregressive)")
    if not isinstance(prefix, int) or prefix < 0:
        raise _err("step_costs", f"prefix={prefix!r}", "pass the cached context length as an int >= 0")
    if weights not in FORMATS:
        raise _err("step_costs", f"weights={weights!r}", "pass 'bf16' or 'w12'")
    if not (isinstance(escapes, (int, float)) and 0.0 <= escapes <= 1.0):
        raise _err("step_costs", f"escapes={escapes!r}", "pass the W12 escape rate (escapes per weight) in [0, 1]")
    if not isinstance(accepted, int) or not 1 <= accepted <= rows:
        raise _err("step_costs", f"accepted={accepted!r} with rows={rows}",
                   "pass the committed nodes (root included) as an int in [1, rows]")
    screen = _default_screen(pk.gpu, weights) if screen is None else screen
    if screen not in SCREENS:
        raise _err("step_costs", f"screen={screen!r}", f"pass one of {list(SCREENS)} or None (the GPU's default)")
    R, H, F, V = rows, s.hidden, s.ffn, s.vocab
    Lg, La = s.gdn_layers, s.attn_layers
    out: dict[str, Cost] = {}

    # Linears: each call reads its weight once, its R input rows and writes R output rows (BF16).
    parts = []
    for name, (N, K) in s.linears.items():
        c = s.linear_counts.get(name, 0)
        one = _cost(name, 2 * R * N * K, linear_bytes(N, K, weights, escapes) + _BF16 * R * (N + K), pk)
        parts.append(replace(one, flops=one.flops * c, bytes=one.bytes * c, floor_ms=one.floor_ms * c, calls=c,
                             paper_floor_ms=one.paper_floor_ms * c))
    out["linears"] = Cost("linears", sum(p.flops for p in parts), sum(p.bytes for p in parts),
                          sum(p.floor_ms for p in parts),
                          "compute" if any(p.bound == "compute" for p in parts) else "bytes",
                          sum(p.calls for p in parts), tuple(parts), sum(p.paper_floor_ms for p in parts))

    # LM head: the screen's read (or the exact head's), the hidden rows in, the ids out.
    G = -(-H // 128)
    if screen == "int8":
        # INT8 codes, 3 BF16 tables per 128-column group and 3 fp32 norms per row; the screen writes an
        # fp32 upper bound per (row, token) that the selection reads back.
        nbytes = V * H + 3 * V * G * _BF16 + 3 * V * 4 + R * H * (_BF16 + 1) + 2 * R * V * 4 + R * 8
        flops = 2 * R * V * H * pk.bf16_tflops / pk.int8_tops
    elif screen == "w12":
        # the W12 record's hi bytes and row bases, 2 BF16 tables per group, 3 fp32 norms per row
        nbytes = V * (-(-H // 64) * 64) + V + 2 * V * G * _BF16 + 3 * V * 4 + R * H * _BF16 + 2 * R * V * 4 + R * 8
        flops = 2 * R * V * H
    else:
        nbytes = linear_bytes(V, H, weights, escapes) + R * H * _BF16 + R * 8
        flops = 2 * R * V * H
    out["lm head"] = _cost("lm head", flops, nbytes, pk)

    # Gated DeltaNet (per layer, summed over the GDN layers). Verify: q, k, v, g (fp32), beta (BF16) per row,
    # the request's fp32 state read once, o written; WY-form FLOPs (specpilot/bench/cases/gdn.py).
    HK, HV, D = s.gdn_k_heads, s.gdn_v_heads, s.gdn_head_dim
    C, W = 2 * HK * D + HV * D, s.conv_width
    state = HV * D * D * 4
    if Lg:
        vb = 2 * R * HK * D * _BF16 + R * HV * D * _BF16 + R * HV * (4 + _BF16) + state + R * HV * D * _BF16
        vf = HV * (4 * R * R * D + 4 * R * D * D + 4 * R * R * D)
        out["gdn verify"] = _cost("gdn verify", Lg * vf, Lg * vb, pk, Lg)
        # tree conv: x in and y out per row, the conv state (W - 1 columns) and the conv weights read
        cb = 2 * R * C * _BF16 + C * (W - 1) * _BF16 + C * W * _BF16
        out["gdn conv"] = _cost("gdn conv", Lg * R * C * 2 * W, Lg * cb, pk, Lg)
        # commit: the state read and written, the accepted nodes' k, v, g, beta and conv inputs read, the
        # conv state read and written
        mb = 2 * state + accepted * (HK * D * _BF16 + HV * D * _BF16 + HV * 6 + C * _BF16) + 2 * C * (W - 1) * _BF16
        out["gdn commit"] = _cost("gdn commit", Lg * accepted * HV * 6 * D * D, Lg * mb, pk, Lg)
    else:
        for k in ("gdn verify", "gdn conv", "gdn commit"):
            out[k] = Cost(k, 0.0, 0.0, 0.0, "bytes", 0)

    # Tree attention (per attention layer): the KV prefix read once, q in, o out, the tree's own k and v;
    # FLOPs of QK^T and PV over prefix + tree, the tree mask not subtracted (specpilot/bench/cases/tree_attn.py).
    Hq, Hkv, Dh = s.attn_q_heads, s.attn_kv_heads, s.attn_head_dim
    ab = 2 * prefix * Hkv * Dh * _BF16 + 2 * R * Hq * Dh * _BF16 + 2 * R * Hkv * Dh * _BF16
    out["tree attention"] = _cost("tree attention", La * 4 * R * Hq * Dh * (prefix + R), La * ab, pk, La)

    # Glue: the elementwise work between the kernels above, activations only: each op reads its inputs and
    # writes its output once (BF16; g in fp32), no FLOPs counted (CUDA-core work, far below either roof).
    # Per layer: two RMSNorms (rows in and out, weight), two residual adds (two in, one out), silu(gate) * up.
    common = 2 * (4 * R * H + 2 * H) + 2 * 6 * R * H + 6 * R * F
    # GDN layer (the conv reads its input, and the commit its x, k and v, in place): g (fp32) and beta written;
    # beta = sigmoid(b); g from a; the gated output norm (o and z in, out; weight).
    gdn_extra = 8 * R * HV + 4 * R * HV + 4 * R * HV + 6 * R * HV + 6 * R * HV * D + 2 * D
    # attention layer: q and k norms (with weights), the rotary embedding of q and k, stash copies of k and
    # v, o * sigmoid(gate), the commit's copy of the accepted nodes' k and v into the cache.
    attn_extra = (4 * R * Hq * Dh + 4 * R * Hkv * Dh + 4 * Dh + 4 * R * (Hq + Hkv) * Dh + 8 * R * Hkv * Dh
                  + 6 * R * Hq * Dh + 8 * accepted * Hkv * Dh)
    # once: the embedding gather (ids in, rows out), the final norm
    once = 4 * R * H + 8 * R + 4 * R * H + 2 * H
    gb = s.layers * common + Lg * gdn_extra + La * attn_extra + once
    out["glue"] = _cost("glue", 0.0, gb, pk, s.layers)
    return {k: out[k] for k in CLASSES}


def step_floor_ms(costs: dict[str, Cost]) -> float:
    """The step floor: the sum of the class floors."""
    return sum(c.floor_ms for c in costs.values())


def ceiling_speedup(tau: float, t_verify: float, t_ar: float) -> float:
    """Speedup over autoregressive decoding: tau tokens per verify step / (t_verify / t_ar)."""
    for name, v in (("tau", tau), ("t_verify", t_verify), ("t_ar", t_ar)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise _err("ceiling_speedup", f"{name}={v!r}", "pass a finite number > 0 (tau: tokens per step; times "
                       "in any one unit)")
    return tau * t_ar / t_verify


# --------------------------------------------------------------------------------------------
# Measurements: the engine's step benchmark, per-operator benchmarks
# --------------------------------------------------------------------------------------------


def _load_json(path, fn: str, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise _err(fn, f"cannot read {path} ({e})", f"pass {what}") from None


def engine_measured(engine: str | Path | dict, weights: str, step: str) -> dict:
    """The engine benchmark's measured `step` ("ar" or "verify") of format `weights`: the step time and the
    profiled time per group of `ENGINE_GROUPS` (categories it does not know go to "unmapped"): each moment of the
    timeline charged once (the breakdown's `exclusive_ms`) where the JSON has it, so that kernels launched early
    (programmatic dependent launch) do not count their wait twice; else the profiler's durations (`ms`).
    Returns {"step_ms", "groups": {label: ms}, "profiled_ms", "outside_ms", "kernels"}."""
    res = engine if isinstance(engine, dict) else _load_json(engine, "engine_measured",
                                                            "an engine JSON of `python -m specpilot.bench.engine`")
    if step not in ("ar", "verify"):
        raise _err("engine_measured", f"step={step!r}", "pass 'ar' or 'verify'")
    fmts = res.get("formats") if isinstance(res, dict) else None
    if not isinstance(fmts, dict) or weights not in fmts:
        have = sorted(fmts) if isinstance(fmts, dict) else []
        raise _err("engine_measured", f"no {weights!r} results in the engine JSON (it has {have})",
                   "pass a format it holds, or run the engine benchmark with --formats " + weights)
    row = fmts[weights]
    b = row.get(f"{step}_breakdown")
    if not b or "ms" not in b:
        raise _err("engine_measured", f"the {weights} {step} step has no kernel breakdown",
                   "run the engine benchmark with the profiler (its default)")
    cats = dict(b.get("exclusive_ms") or b["ms"])
    groups = {}
    for label, _, names in ENGINE_GROUPS:
        groups[label] = sum(cats.pop(n, 0.0) for n in names)
    if cats:
        groups["unmapped"] = sum(cats.values())
    prof = sum(groups.values())
    t = float(row[f"{step}_ms"])
    return {"step_ms": t, "groups": groups, "profiled_ms": prof, "outside_ms": t - prof,
            "kernels": b.get("kernels_per_call"), "unmapped": sorted(cats)}


def _group_floors(costs: dict[str, Cost]) -> dict[str, float]:
    return {label: sum(costs[c].floor_ms for c in classes) for label, classes, _ in ENGINE_GROUPS}


def compare(costs: dict[str, Cost], measured: dict) -> list[dict]:
    """Per group: floor ms, measured ms, measured / floor, ms above the floor."""
    floors = _group_floors(costs)
    rows = []
    for label, ms in measured["groups"].items():
        f = floors.get(label, 0.0)
        rows.append({"group": label, "floor_ms": f, "measured_ms": ms, "over_floor": ms / f if f > 0 else None,
                     "above_floor_ms": ms - f})
    return rows


def factors(taus: Sequence[float], tau_ideal: float | None, costs_v: dict[str, Cost], measured_v: dict) -> dict:
    """The paper's three factors for the verify step, each as the speedup it stands for:
    acceptance tau_ideal / tau (per tau; None without tau_ideal); floor: t / (t - sum of the profiled time
    above the floors); outside: t / (t - time outside the profile). `largest` names the largest per tau."""
    t = measured_v["step_ms"]
    above = sum(max(0.0, r["above_floor_ms"]) for r in compare(costs_v, measured_v))
    out_ms = max(0.0, measured_v["outside_ms"])
    floor_f, out_f = t / (t - above), t / (t - out_ms)
    acc = {f"{tau:g}": (tau_ideal / tau if tau_ideal else None) for tau in taus}
    largest = {}
    for tau, a in acc.items():
        cand = {"floor": floor_f, "outside": out_f}
        if a is not None:
            cand["acceptance"] = a
        largest[tau] = max(cand, key=cand.get)
    return {"acceptance": acc, "tau_ideal": tau_ideal, "floor": floor_f, "above_floor_ms": above,
            "outside": out_f, "outside_ms": measured_v["outside_ms"], "largest": largest}


# Per-operator benchmark rows that time a group of the engine's step, as `specpilot bench` names them.
# (op, variant, shape) per group; `{M}` the rows, `{L}` the GDN layers, `{P}` the prefix in k tokens.
# Linears: one row per linear name (times its count); the variant is what the engine runs: F.linear, and for W12
# the flow kernel on the runtime layout (`w12.matmul_tiled`, the engine's `Linear.tiled` on a GPU; rows
# "w12.flow"), or where a run has no such rows the planes' default CUDA kernel (mma), which the engine ran before
# it held the runtime layout. LM head: the certified head
# with the screen the engine's head takes. GDN: all layers in one case. Tree attention: one layer (times
# the attention layers). The commit case commits its tree's deepest path; it stands for the step only when
# that is the step's accepted count.
_PEROP = {
    "linears": {"bf16": (("linear", "cublas", "{name}-M{M}"),),
                "w12": (("w12.matmul", "w12.flow", "{name}-M{M}"), ("w12.matmul", "w12.mma", "{name}-M{M}"))},
    "lm head": {("bf16", "int8"): ("lm_head", "certified-int8", "lm_head-M{M}"),
                ("w12", "int8"): ("lm_head", "certified-w12-int8", "lm_head-M{M}"),
                ("w12", "w12"): ("lm_head", "certified-w12", "lm_head-M{M}")},
    "gdn verify + conv": (("gdn.tree_verify", "cuda", "tree_verify-B1-N{M}-L{L}"),
                          ("gdn.tree_conv1d", "triton", "tree_conv1d-B1-N{M}-L{L}")),
    "gdn commit": ("gdn.commit", "triton", "commit-B1-N{M}-L{L}"),
    "tree attention": ("tree_attn.tree_attention", "wgmma", "B1-N{M}-L{P}k"),
}


def _index_rows(files: Sequence) -> dict:
    idx = {}
    for f in files:
        data = f if isinstance(f, dict) else _load_json(f, "perop_times", "a results JSON of `specpilot bench`")
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise _err("perop_times", f"{f if not isinstance(f, dict) else 'a dict'} is not a results file (no 'rows')",
                       "pass results JSONs of `specpilot bench`")
        src = Path(f).name if not isinstance(f, dict) else "rows"
        for r in data["rows"]:
            if r.get("status") == "ok" and r.get("median_us") is not None:
                idx[(r["op"], r["variant"], r["shape"])] = (r, src)
    return idx


def perop_times(files: Sequence, shapes: str | ModelShapes, rows: int, *, prefix: int = 4096,
                weights: str = "bf16", screen: str | None = None, gpu: str = "h200", accepted: int = 1) -> dict:
    """Time per group (ms) of a step of `rows` rows from per-operator benchmark JSONs, where they hold the
    rows the group needs (`_PEROP`). Returns {group: {"ms", "sources": [...]}}; groups they miss are absent."""
    s = _shapes(shapes)
    idx = _index_rows(files)
    screen = _default_screen(_slug(gpu), weights) if screen is None else screen
    fill = dict(M=rows, L=s.gdn_layers, P=prefix // 1024)  # the tree attention cases run whole k-token prefixes
    out = {}

    def get(op, var, shape):
        return idx.get((op, var, shape.format(**fill)))

    for op, var, shp in _PEROP["linears"][weights]:  # the first variant whose rows cover every linear
        hits = {name: idx.get((op, var, shp.format(name=name, M=rows))) for name in s.linears}
        if all(hits.values()):
            break
    if s.linears and all(hits.values()):
        files = sorted({h[1] for h in hits.values()})
        out["linears"] = {"ms": sum(h[0]["median_us"] * s.linear_counts.get(n, 0) for n, h in hits.items()) / 1e3,
                          "sources": [f"{', '.join(files)}: {op}/{var} <linear>-M{rows}, each times its count"]}
    key = _PEROP["lm head"].get((weights, screen))
    hit = get(*key) if key else None
    if hit:
        out["lm head"] = {"ms": hit[0]["median_us"] / 1e3,
                          "sources": [f"{hit[1]}: {key[0]}/{key[1]} {hit[0]['shape']}"]}
    hits = [get(*k) for k in _PEROP["gdn verify + conv"]]
    if s.gdn_layers and all(hits):
        out["gdn verify + conv"] = {"ms": sum(h[0]["median_us"] for h in hits) / 1e3,
                                    "sources": [f"{h[1]}: {h[0]['op']}/{h[0]['variant']} {h[0]['shape']}"
                                                for h in hits]}
    hit = get(*_PEROP["gdn commit"]) if s.gdn_layers else None
    if hit and hit[0].get("dims", {}).get("accepted") == accepted:
        out["gdn commit"] = {"ms": hit[0]["median_us"] / 1e3, "sources": [f"{hit[1]}: gdn.commit {hit[0]['shape']}"]}
    hit = get(*_PEROP["tree attention"]) if prefix % 1024 == 0 else None
    if hit:
        out["tree attention"] = {"ms": hit[0]["median_us"] * s.attn_layers / 1e3,
                                 "sources": [f"{hit[1]}: tree_attention/wgmma {hit[0]['shape']} x{s.attn_layers}"]}
    return out


def predict_verify(costs_ar: dict[str, Cost], costs_v: dict[str, Cost], measured_ar: dict, perop: dict) -> dict:
    """The verify step predicted group by group: from the per-operator benchmarks (`perop_times`) where they
    time the group; otherwise from the measured AR step plus the growth of the group's floor from AR to
    verify (the time above the floor taken as independent of the rows); the time outside the profile from
    the AR step. Returns {"groups": {label: {"ms", "method", "sources"}}, "outside_ms", "step_ms"}."""
    fa, fv = _group_floors(costs_ar), _group_floors(costs_v)
    groups = {}
    for label, ms in measured_ar["groups"].items():
        if label in perop:
            groups[label] = {"ms": perop[label]["ms"], "method": "per-operator benchmark",
                             "sources": perop[label]["sources"]}
        else:
            d = fv.get(label, 0.0) - fa.get(label, 0.0)
            groups[label] = {"ms": ms + d, "method": "AR step + floor growth", "sources": [f"AR {ms:.3f} + {d:.3f}"]}
    out = measured_ar["outside_ms"]
    return {"groups": groups, "outside_ms": out, "step_ms": sum(g["ms"] for g in groups.values()) + out}


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _floats(xs, fn, name) -> list[float]:
    try:
        out = [float(x) for x in xs]
    except (TypeError, ValueError):
        raise _err(fn, f"{name}={xs!r}", "pass numbers, e.g. 4,6,8") from None
    if not out or any(not (math.isfinite(x) and x > 0) for x in out):
        raise _err(fn, f"{name}={xs!r}", "pass one or more finite numbers > 0")
    return out


def report(shapes: str = "hybrid-27b", gpu: str = "h200", *, nodes: int = 32, prefix: int = 4096,
           weights: Sequence[str] = FORMATS, taus: Sequence[float] = (4, 6, 8), tau_ideal: float | None = None,
           measured: str | Path | None = None, perop: Sequence = (), peak_source=None, escapes: float = 0.0,
           accepted: int = 1) -> dict:
    """Floors per class for the AR step and the `nodes`-row verify step of each format in `weights`; with
    `measured` (an engine JSON) the comparison, the ceiling on measured times, the factors and the
    prediction of the verify step from `perop` (per-operator benchmark JSONs). JSON-ready."""
    s = _shapes(shapes)
    pk = peaks(gpu, peak_source)
    if isinstance(weights, str):
        weights = [w.strip() for w in weights.split(",")]
    bad = [w for w in weights if w not in FORMATS]
    if bad or not weights:
        raise _err("report", f"weights={list(weights)!r}", "pass 'bf16', 'w12' or both")
    if not isinstance(nodes, int) or nodes < 2:
        raise _err("report", f"nodes={nodes!r}", "pass the verify step's rows (root included) as an int >= 2")
    taus = _floats(taus, "report", "taus")
    if tau_ideal is not None:
        tau_ideal = _floats([tau_ideal], "report", "tau_ideal")[0]
    eng = _load_json(measured, "report", "an engine JSON of `python -m specpilot.bench.engine`") if measured else None
    if eng is not None:
        ran = autotune.gpu_spec(str(eng["gpu"])) if eng.get("gpu") else None
        if ran is not None and _slug(str(eng["gpu"])) != pk.gpu:
            raise _err("report", f"the engine JSON ran on {eng['gpu']!r}, the floors are asked for {pk.gpu!r}",
                       f"pass --gpu {_slug(eng['gpu'])}")
        for key, want in (("shapes", s.name), ("prefix", prefix), ("nodes", nodes)):
            if key in eng and eng[key] != want:
                raise _err("report", f"the engine JSON ran {key}={eng[key]!r}, the model is asked for {want!r}",
                           f"pass --{key} {eng[key]} (or an engine run of {key}={want!r})")
    rep = {"shapes": s.name, "gpu": pk.gpu, "peaks": asdict(pk), "nodes": nodes, "prefix": prefix, "taus": taus,
           "tau_ideal": tau_ideal, "escapes": escapes, "accepted": accepted,
           "paper_fractions": {"compute": COMPUTE_FRACTION, "bandwidth": BANDWIDTH_FRACTION},
           "measured": str(measured) if measured else None, "perop": [str(p) for p in perop], "formats": {}}
    if eng is not None:
        rep["measured_gpu"] = eng.get("gpu")
    for w in weights:
        screen = _default_screen(pk.gpu, w)
        ca = step_costs(s, 1, prefix=prefix, weights=w, gpu=pk, screen=screen, escapes=escapes, accepted=1)
        cv = step_costs(s, nodes, prefix=prefix, weights=w, gpu=pk, screen=screen, escapes=escapes, accepted=accepted)
        fa, fv = step_floor_ms(ca), step_floor_ms(cv)
        r = {"screen": screen, "ar": {k: asdict(c) for k, c in ca.items()},
             "verify": {k: asdict(c) for k, c in cv.items()},
             "ar_floor_ms": fa, "verify_floor_ms": fv,
             "ar_paper_floor_ms": sum(c.paper_floor_ms for c in ca.values()),
             "verify_paper_floor_ms": sum(c.paper_floor_ms for c in cv.values()),
             "ceiling": {f"{t:g}": {"floors": ceiling_speedup(t, fv, fa)} for t in taus}}
        if eng is not None and w in eng.get("formats", {}):
            ma, mv = engine_measured(eng, w, "ar"), engine_measured(eng, w, "verify")
            r["measured"] = {"ar": ma, "verify": mv}
            r["compare"] = {"ar": compare(ca, ma), "verify": compare(cv, mv)}
            r["factors"] = factors(taus, tau_ideal, cv, mv)
            r["factors_ar"] = factors(taus, None, ca, ma)
            po = perop_times(perop, s, nodes, prefix=prefix, weights=w, screen=screen, gpu=pk.gpu,
                             accepted=accepted) if perop else {}
            pred = predict_verify(ca, cv, ma, po)
            kern = [g for g, v in pred["groups"].items() if v["method"] == "per-operator benchmark"]
            pred["relative_error"] = pred["step_ms"] / mv["step_ms"] - 1
            pred["perop_groups"] = kern
            if kern:
                pk_ms, mk_ms = sum(pred["groups"][g]["ms"] for g in kern), sum(mv["groups"][g] for g in kern)
                pred["perop_groups_ms"], pred["perop_groups_measured_ms"] = pk_ms, mk_ms
                pred["perop_groups_relative_error"] = pk_ms / mk_ms - 1
            r["prediction"] = pred
            for t in taus:
                c = r["ceiling"][f"{t:g}"]
                c["measured"] = ceiling_speedup(t, mv["step_ms"], ma["step_ms"])
                c["verify_floor_vs_measured_ar"] = ceiling_speedup(t, fv, ma["step_ms"])
                c["predicted"] = ceiling_speedup(t, pred["step_ms"], ma["step_ms"])
        rep["formats"][w] = r
    return rep


def _f(x, d=2) -> str:
    if x is None:
        return "-"
    return f"{x:.{d}f}"


def markdown(rep: dict) -> str:
    """The report as Markdown tables."""
    pk = rep["peaks"]
    L = [f"# Ceiling: {rep['shapes']} on the {pk['gpu'].upper()}, one request, prefix {rep['prefix']}, "
         f"{rep['nodes']}-row verify", "",
         f"Floor rates ({pk['source']}): {pk['bandwidth_tbs']:.3g} TB/s copy, {pk['bf16_tflops']:.4g} TFLOP/s BF16, "
         f"{pk['int8_tops']:.4g} TOP/s INT8. Floor of a class = max(FLOPs / BF16 rate, bytes / copy rate), no "
         f"fraction; the step floor is the sum over classes. The paper's floor takes "
         f"{rep['paper_fractions']['compute']:.0%} of the datasheet's {pk['datasheet_bf16_tflops']:.4g} TFLOP/s and "
         f"{rep['paper_fractions']['bandwidth']:.0%} of its {pk['datasheet_bandwidth_tbs']:.3g} TB/s. W12 escape "
         f"rate {rep['escapes']:.3g}; the commit advances {rep['accepted']} node(s)."]
    if rep.get("measured"):
        L.append(f"Measured: `{rep['measured']}` ({rep.get('measured_gpu')}).")
    for w, r in rep["formats"].items():
        L += ["", f"## {w}: byte floors per kernel class (LM head screen: {r['screen']})", "",
              "| class | AR GFLOP | AR MB | AR floor ms | verify GFLOP | verify MB | verify floor ms | verify bound |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
        for k in CLASSES:
            a, v = r["ar"][k], r["verify"][k]
            L.append(f"| {k} | {a['flops'] / 1e9:.2f} | {a['bytes'] / 1e6:.1f} | {a['floor_ms']:.3f} | "
                     f"{v['flops'] / 1e9:.2f} | {v['bytes'] / 1e6:.1f} | {v['floor_ms']:.3f} | {v['bound']} |")
        L.append(f"| **step** | | | **{r['ar_floor_ms']:.3f}** | | | **{r['verify_floor_ms']:.3f}** | |")
        L.append(f"| the paper's floor (60% / 90% of the datasheet) | | | {r['ar_paper_floor_ms']:.3f} | | | "
                 f"{r['verify_paper_floor_ms']:.3f} | |")
        L += ["", "| linear | calls | verify GFLOP | weight + activation MB | AR floor ms | verify floor ms |",
              "|---|---:|---:|---:|---:|---:|"]
        for pa, pv in zip(r["ar"]["linears"]["parts"], r["verify"]["linears"]["parts"]):
            L.append(f"| {pa['name']} | {pa['calls']} | {pv['flops'] / 1e9:.1f} | {pv['bytes'] / 1e6:.0f} | "
                     f"{pa['floor_ms']:.3f} | {pv['floor_ms']:.3f} |")
        if "compare" in r:
            ma, mv = r["measured"]["ar"], r["measured"]["verify"]
            L += ["", f"## {w}: measured against the floor", "",
                  "| class | AR floor ms | AR measured ms | AR x floor | verify floor ms | verify measured ms | "
                  "verify x floor |", "|---|---:|---:|---:|---:|---:|---:|"]
            for a, v in zip(r["compare"]["ar"], r["compare"]["verify"]):
                L.append(f"| {a['group']} | {a['floor_ms']:.3f} | {a['measured_ms']:.3f} | {_f(a['over_floor'])} | "
                         f"{v['floor_ms']:.3f} | {v['measured_ms']:.3f} | {_f(v['over_floor'])} |")
            L.append(f"| profiled | {r['ar_floor_ms']:.3f} | {ma['profiled_ms']:.3f} | "
                     f"{ma['profiled_ms'] / r['ar_floor_ms']:.2f} | {r['verify_floor_ms']:.3f} | "
                     f"{mv['profiled_ms']:.3f} | "
                     f"{mv['profiled_ms'] / r['verify_floor_ms']:.2f} |")
            L.append(f"| outside the profile | 0 | {ma['outside_ms']:.3f} | - | 0 | {mv['outside_ms']:.3f} | - |")
            L.append(f"| **step** | **{r['ar_floor_ms']:.3f}** | **{ma['step_ms']:.3f}** | "
                     f"**{ma['step_ms'] / r['ar_floor_ms']:.2f}** | **{r['verify_floor_ms']:.3f}** | "
                     f"**{mv['step_ms']:.3f}** | **{mv['step_ms'] / r['verify_floor_ms']:.2f}** |")
            L += ["", f"Kernels per step (profiled): AR {ma['kernels']:.0f}, verify {mv['kernels']:.0f}."
                  if ma.get("kernels") and mv.get("kernels") else ""]
            if ma.get("unmapped") or mv.get("unmapped"):
                L.append("Profile categories without a class: "
                         + ", ".join(sorted(set(ma["unmapped"]) | set(mv["unmapped"]))))
        head = "| τ | floors | measured |" if "compare" in r else "| τ | floors |"
        L += ["", f"## {w}: ceiling speedup over autoregressive decoding, τ / (t_verify / t_AR)", ""]
        if "compare" in r:
            L += [head + " predicted verify | verify at floor vs measured AR |", "|---:|---:|---:|---:|---:|"]
            for t, c in r["ceiling"].items():
                L.append(f"| {float(t):g} | {c['floors']:.2f}x | {c['measured']:.2f}x | {c['predicted']:.2f}x | "
                         f"{c['verify_floor_vs_measured_ar']:.2f}x |")
        else:
            L += [head, "|---:|---:|"]
            for t, c in r["ceiling"].items():
                L.append(f"| {float(t):g} | {c['floors']:.2f}x |")
        if "factors" in r:
            fc = r["factors"]
            L += ["", f"## {w}: the three factors (verify step, as speedups)", "",
                  f"- distance to the byte floor: {fc['floor']:.2f}x ({fc['above_floor_ms']:.2f} ms of profiled "
                  "kernel time above the class floors)",
                  f"- time outside the profile: {fc['outside']:.2f}x ({fc['outside_ms']:.2f} ms between and around "
                  "the profiled kernels)"]
            if fc["tau_ideal"]:
                L.append("- leftover tree acceptance (τ_ideal = " + f"{fc['tau_ideal']:g}): " + ", ".join(
                    f"{a:.2f}x at τ = {float(t):g}" for t, a in fc["acceptance"].items()))
            L.append("- largest: " + ", ".join(f"{g} at τ = {float(t):g}" for t, g in fc["largest"].items()))
            p, mv = r["prediction"], r["measured"]["verify"]
            L += ["", f"## {w}: the verify step predicted from per-kernel measurements", "",
                  "| class | predicted ms | measured ms | predicted / measured | method | from |",
                  "|---|---:|---:|---:|---|---|"]
            for g, v in p["groups"].items():
                m = mv["groups"].get(g, 0.0)
                L.append(f"| {g} | {v['ms']:.3f} | {m:.3f} | {_f(v['ms'] / m if m else None)} | {v['method']} | "
                         + "; ".join(v["sources"]) + " |")
            L.append(f"| outside the profile | {p['outside_ms']:.3f} | {mv['outside_ms']:.3f} | "
                     f"{_f(p['outside_ms'] / mv['outside_ms'] if mv['outside_ms'] else None)} | AR step | |")
            L.append(f"| **step** | **{p['step_ms']:.3f}** | **{mv['step_ms']:.3f}** | "
                     f"**{p['step_ms'] / mv['step_ms']:.3f}** | | |")
            L += ["", f"Predicted verify step {p['step_ms']:.2f} ms against {mv['step_ms']:.2f} ms measured: "
                  f"{p['relative_error']:+.1%}."]
            if p.get("perop_groups"):
                L[-1] += (f" The groups timed by per-operator benchmarks ({', '.join(p['perop_groups'])}): "
                          f"{p['perop_groups_ms']:.2f} ms predicted against {p['perop_groups_measured_ms']:.2f} ms "
                          f"measured, {p['perop_groups_relative_error']:+.1%}.")
    return "\n".join(L) + "\n"


_COLORS = {"linears": "#4c72b0", "lm head": "#dd8452", "gdn verify + conv": "#55a868", "gdn commit": "#8c8c8c",
           "tree attention": "#c44e52", "glue": "#8172b3", "unmapped": "#937860", "outside the profile": "#dddddd"}


def plot(rep: dict, path) -> Path:
    """PNG: per format, a stacked bar per step (AR, verify): measured by class beside the floor by class
    (floors only without a measurement)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    fmts = list(rep["formats"])
    fig, axes = plt.subplots(1, len(fmts), figsize=(4.8 * len(fmts), 4.8), dpi=120, squeeze=False)
    for ax, w in zip(axes[0], fmts):
        r = rep["formats"][w]
        bars = []
        for step, lab in (("ar", "AR"), ("verify", f"verify ({rep['nodes']})")):
            costs = {k: r[step][k]["floor_ms"] for k in CLASSES}
            floors = {label: sum(costs[c] for c in classes) for label, classes, _ in ENGINE_GROUPS}
            if "measured" in r:
                m = r["measured"][step]
                meas = dict(m["groups"])
                meas["outside the profile"] = max(0.0, m["outside_ms"])
                bars.append((f"{lab}\nmeasured", meas))
            bars.append((f"{lab}\nfloor", floors))
        seen = set()
        for i, (lab, parts) in enumerate(bars):
            bottom = 0.0
            for g, ms in parts.items():
                kw = {"label": g} if g not in seen else {}
                seen.add(g)
                ax.bar(i, ms, bottom=bottom, color=_COLORS.get(g, "#999999"), edgecolor="white", lw=0.5,
                       hatch="//" if g == "outside the profile" else None, **kw)
                bottom += ms
            ax.text(i, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{rep['shapes']}, {w}, {rep['gpu']}", fontsize=10)
        ax.grid(True, axis="y", lw=0.3, alpha=0.5)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
