"""`specpilot tune`: every operator's search spaces tuned on this GPU through `autotune.tune`.

One entry per operator (`OPS`): its spaces (declared in the operator's `space.py`), the named shapes of a
shape set, and a *problem*: the inputs of one shape, built once, with the check and the calls the timer runs.
The problems reuse the benchmark cases' inputs and checks (`specpilot.bench.cases`), so a config is
checked on the very inputs it is timed on, against the fp64 reference within the benchmark's derived
tolerance, before any timing.

* **timer**: `specpilot.bench.timing.time_fns` over the problem's rotated input sets (CUDA graphs,
  events); the config is pinned with `autotune.force` around every call.
* **check**: the problem's check under the same pin; any error of the kernel (a compile that fails, a
  launch with too many resources) becomes `autotune.BuildError`, which prunes the trial.
* **A/B**: `specpilot.bench.timing.time_ab`, interleaved rounds of the current config (what the operator's
  lookup returns today: a stored entry, else the heuristic) and the study's best, for
  `autotune.promotion.promote`.
* **precompile**: the configs a study starts with, compiled on a thread pool of the host's cores (one call
  each under its pin; Triton and NVRTC compile outside the GIL), so that the trials find them built.

`run(...)` tunes one operator and writes the decisions (JSON, one record per (op, variant, shape), merged
into an existing file) and the before/after table (Markdown); `report_png(...)` draws time over floor of the
stored configs. A backend (`GpuBackend`, or a fake one in tests) provides check, timer, A/B and
precompile; `make_backend` is the one the command line uses.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import fnmatch
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import autotune
from autotune.tuner import SearchSpace, TuneResult, tune

__all__ = ["OpTuning", "OPS", "GpuBackend", "make_backend", "run", "current_config", "table_md", "report_png",
           "named_shapes"]

DECISIONS = "tune-decisions.json"
TABLE = "tune-before-after.md"


# --------------------------------------------------------------------------------------------
# Problems: the inputs of one shape, built once
# --------------------------------------------------------------------------------------------


def _error_ok(out, r64, base, factor: float) -> bool:
    from specpilot.testing import error_bound

    return error_bound(out, r64, base, factor=factor).ok


class _W12Problem:
    """w12.matmul at {M, N, K}: rotated packed Gaussian weights (escapes included), x; checked against fp64
    within 2x cuBLAS's error (specpilot/bench/cases/w12.py)."""

    op = "w12.matmul"

    def __init__(self, shape, device):
        import torch.nn.functional as F

        import w12
        from specpilot.bench.registry import rotations

        m, n, k = shape["M"], shape["N"], shape["K"]
        g = torch.Generator(device=device).manual_seed(4321 + n + k)
        sets = rotations(n * k * 1.5, device)
        w0 = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        # the planes: the tuner times w12.matmul's variants on them
        self.packs = [w12.pack(w0, layout="planes")] + [
            w12.pack((torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16), layout="planes")
            for _ in range(sets - 1)]
        self.x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
        self.out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        self.r64 = self.x.double() @ w0.double().T
        self.base = F.linear(self.x, w0)

    def fns(self, variant):
        import w12

        x, out = self.x, self.out
        variant = "mma" if variant == "tma" else variant  # the TMA kernel runs under variant mma (its config picks it)
        return [lambda p=p: w12.matmul(x, p, variant=variant, out=out) for p in self.packs]

    def check(self, variant) -> bool:
        self.fns(variant)[0]()
        return _error_ok(self.out, self.r64, self.base, 2.0)


class _GdnProblem:
    """gdn.tree_verify at {B, M, H, HV, K, V}: B draft trees of M nodes (specpilot/bench/cases/gdn.py's trees
    and inputs), one layer's inputs per rotated set; checked on set 0 as the benchmark checks it: the bf16
    output against fp64 within 2x the error of torch's fp32 form rounded to bf16 (the output the timer
    writes, so the check and the timing run one specialisation of the kernel)."""

    op = "gdn.tree_verify"

    def __init__(self, shape, device):
        import gdn
        from gdn.reference import chunk_reference, tree_reference
        from specpilot.bench.cases import draft_tree
        from specpilot.bench.cases.gdn import _inputs
        from specpilot.bench.registry import rotations

        b, m, h, hv, k, v = (shape[x] for x in ("B", "M", "H", "HV", "K", "V"))
        rng = random.Random(4321)
        self.trees = [draft_tree(m, rng) for _ in range(b)]
        t = b * m
        nbytes = 2 * t * h * k * 2 + t * hv * v * 2 + b * hv * k * v * 4
        self.sets = rotations(nbytes, device)
        self.args = _inputs(self.sets, t, h, hv, k, v, b, device, 7 + t)
        self.plan = gdn.build_tree_plan(self.trees, device=device)
        self.idx = torch.arange(b, device=device, dtype=torch.int32)
        self.out = torch.empty(self.sets, t, hv, v, device=device, dtype=torch.bfloat16)
        q, kk, vv, g, beta, pool = (a[0] for a in self.args)
        idx = list(range(b))
        self.r64 = tree_reference(q, kk, vv, g, beta, pool.double(), idx, self.trees, use_qk_l2norm=True,
                                  dtype=torch.float64)
        self.r32 = tree_reference(q, kk, vv, g, beta, pool, idx, self.trees, use_qk_l2norm=True,
                                  fn=chunk_reference).to(torch.bfloat16)

    def _call(self, variant, s, out):
        import gdn

        q, k, v, g, beta, pool = self.args
        gdn.tree_verify(q[s], k[s], v[s], g[s], beta[s], pool[s], self.idx, self.plan, use_qk_l2norm=True,
                        variant=variant, out=out)

    def fns(self, variant):
        return [lambda s=s: self._call(variant, s, self.out[s]) for s in range(self.sets)]

    def check(self, variant) -> bool:
        self.out[0].fill_(float("nan"))
        self._call(variant, 0, self.out[0])
        return _error_ok(self.out[0], self.r64, self.r32, 2.0)


class _TreeAttnProblem:
    """tree_attn.run at {D, G, H, Hkv, L, N}: one N-node draft tree over an L-token prefix, nodes in the cache
    (specpilot/bench/cases/tree_attn.py's problem; its check's tolerance, factor 3, with the references of set 0
    computed once); the plan is made under the pinned config (its schedule depends on it)."""

    op = "tree_attn.tree_attention"

    def __init__(self, shape, device):
        from specpilot.bench.cases import draft_tree
        from specpilot.bench.cases.tree_attn import Problem, Spec
        from specpilot.bench.registry import rotations

        spec = Spec(trees=[draft_tree(shape["N"], random.Random(2718))], lens=[shape["L"]], H=shape["H"],
                     Hkv=shape["Hkv"], D=shape["D"])
        self.spec = spec
        self.prob = Problem(spec, device, rotations(spec.bytes(), device), 2718)
        self.out = torch.empty(spec.T, spec.H, spec.D, dtype=torch.bfloat16, device=device)

    def fns(self, variant):
        import tree_attn

        p, sp, out = self.prob, self.spec, self.out
        plan = tree_attn.plan(p.qo_indptr, p.kv_indptr, p.kv_indices, p.tree_mask, num_qo_heads=sp.H,
                              num_kv_heads=sp.Hkv, head_dim=sp.D, cache_slots=sp.slots, nodes_in_cache=True,
                              dtype=torch.bfloat16, variant=variant)
        return [lambda q=q, k=k, v=v: tree_attn.run(plan, q, k, v, out=out) for q, k, v in p.sets]

    def check(self, variant) -> bool:
        from tree_attn.reference import tree_attention_reference

        self.out.fill_(float("nan"))
        self.fns(variant)[0]()
        if not hasattr(self, "_refs"):  # one request: the fp64 and fp32 references of set 0, computed once
            p, sp = self.prob, self.spec
            q, k, v = p.sets[0]
            args = (q, k, v, p.kv_indptr, p.kv_indices, p.qo_indptr, p.tree_mask)
            self._refs = (tree_attention_reference(*args, sm_scale=sp.D ** -0.5, dtype=torch.float64)[0],
                          tree_attention_reference(*args, sm_scale=sp.D ** -0.5)[0].to(self.out.dtype))
        return _error_ok(self.out, *self._refs, 3.0)


class _HeadProblem:
    """lmhead.CertifiedHead(W, screen="int8").argmax at {M, V, K}: W ~ N(0, 1/K) in BF16, hidden states of the
    benchmark's "moderate" regime (the planted token 1.5 sigma ahead). The check: argmax equals the exact
    logits' argmax, and those logits are within the fp32 dot-product bound of fp64 (|err| <= 2 K 2^-24 sum |h||w|,
    which any fp32 accumulation order meets; the first 16384 rows). A bound relative to torch's own fp32 product
    is not usable here: on the H200 cuBLAS's fp32 GEMM is more accurate than a k-sequential dot, and every
    config failed it. The head plans at construction: each config gets a copy of the head planned under its pin."""

    op = "lmhead.argmax"
    _ROWS = 16384

    def __init__(self, shape, device):
        import lmhead
        from specpilot.bench.cases.lmhead import _hidden

        m, v, k = shape["M"], shape["V"], shape["K"]
        g = torch.Generator(device=device).manual_seed(9173)
        self.w = (torch.randn(v, k, device=device, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        self.h, _ = _hidden(self.w, m, "moderate", 9173)
        self.head = lmhead.CertifiedHead(self.w, screen="int8")
        self.ids = torch.empty(m, dtype=torch.int64, device=device)
        rows = self.w[: self._ROWS]
        self.r64 = self.h.double() @ rows.double().T
        self.tol = 2 * k * 2.0**-24 * (self.h.double().abs() @ rows.double().abs().T)

    def _head(self, variant):
        from lmhead import ops

        hd = copy.copy(self.head)
        hd.plan = ops._plan(variant, hd.device, hd.V, hd.H)
        hd.cfg = hd.plan.config
        return hd

    def fns(self, variant):
        hd, h, ids = self._head(variant), self.h, self.ids
        return [lambda: hd.argmax(h, out=ids)]

    def check(self, variant) -> bool:
        hd = self._head(variant)
        ids = hd.argmax(self.h)
        logits = hd.logits(self.h)
        if not torch.equal(ids, logits.argmax(-1)):
            return False
        return bool(((logits[:, : self._ROWS].double() - self.r64).abs() <= self.tol).all())


# --------------------------------------------------------------------------------------------
# The operators
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpTuning:
    """One operator's tuning: its spaces, its named shapes for a shape set, and the problem of a shape."""

    op: str
    spaces: Callable[[], tuple[SearchSpace, ...]]
    shapes: Callable[[Any], list[tuple[str, dict]]]
    problem: type


def _w12_spaces():
    from w12 import space

    # the CUDA C++ kernels' spaces (the default at M <= 32) where w12.space declares them, then the Triton one
    return tuple(getattr(space, n) for n in ("MMA_SPACE", "TMA_SPACE", "FLOW_SPACE", "TC_SPACE") if hasattr(space, n))


def _w12_shapes(s) -> list[tuple[str, dict]]:
    # "mma"/"tma" (CUDA C++) take M <= 32; "tc" runs above that on sm_90 and wherever it is asked for
    return [(f"{name}-M{m}", {"M": m, "N": n, "K": k}) for name, (n, k) in list(s.linears.items()) + [
        ("lm_head", s.lm_head)] for m in (1, 8, 32, 64)]


def _gdn_spaces():
    from gdn.space import CUDA_SPACE, WY_SPACE

    return (CUDA_SPACE, WY_SPACE)


def _gdn_shapes(s) -> list[tuple[str, dict]]:
    d = dict(H=s.gdn_k_heads, HV=s.gdn_v_heads, K=s.gdn_head_dim, V=s.gdn_head_dim)
    # draft trees, and one token (the engine's autoregressive step)
    return [(f"B{b}-N{m}", dict(B=b, M=m, **d)) for b, m in ((1, 32), (1, 16), (1, 8), (24, 8), (1, 1))]


def _attn_spaces():
    from tree_attn.space import MMA_SPACE, WGMMA_SPACE, WS_SPACE

    return (WGMMA_SPACE, MMA_SPACE, WS_SPACE)


def _attn_shapes(s) -> list[tuple[str, dict]]:
    from specpilot.bench.cases.tree_attn import head_dims

    h, hkv, d = head_dims(s)
    # a 32-node tree over a long prefix, and one token over the engine's prefix (its autoregressive step): the
    # tuned key holds the node count's bucket, so each tunes its own entry
    shapes = []
    for n, length in ((32, 32768), (1, 4096)) if s.name != "tiny" else ((32, 40), (1, 40)):
        name = f"B1-N{n}-L{length // 1024}k" if length >= 1024 else f"B1-N{n}-L{length}"
        shapes.append((name, dict(D=d, G=h // hkv, H=h, Hkv=hkv, L=length, N=n)))
    return shapes


def _head_spaces():
    from lmhead.space import HEAD_SPACE

    return (HEAD_SPACE,)


def _head_shapes(s) -> list[tuple[str, dict]]:
    v, k = s.lm_head
    return [("M32", dict(M=32, V=v, K=k))]


OPS: dict[str, OpTuning] = {
    "w12.matmul": OpTuning("w12.matmul", _w12_spaces, _w12_shapes, _W12Problem),
    "gdn.tree_verify": OpTuning("gdn.tree_verify", _gdn_spaces, _gdn_shapes, _GdnProblem),
    "tree_attn.tree_attention": OpTuning("tree_attn.tree_attention", _attn_spaces, _attn_shapes, _TreeAttnProblem),
    "lmhead.argmax": OpTuning("lmhead.argmax", _head_spaces, _head_shapes, _HeadProblem),
}


def named_shapes(op: str, shape_set: str, only: str | None = None) -> list[tuple[str, dict]]:
    """The shapes `op` is tuned at for `shape_set`, filtered by `only` (comma-separated fnmatch patterns)."""
    from specpilot.bench.shapes import get_shape_set

    shapes = OPS[op].shapes(get_shape_set(shape_set))
    if only:
        pats = [p.strip() for p in only.split(",") if p.strip()]
        shapes = [(n, s) for n, s in shapes if any(fnmatch.fnmatch(n, p) for p in pats)]
    return shapes


def current_config(space: SearchSpace, shape: dict, device=None):
    """What the operator's lookup returns today at `shape`: the stored entry (user cache, then shipped), else
    the space's heuristic; or what the space's `current` hook says runs the cell (W12's `tma` space: the `mma`
    kernel's config until a `tma` entry takes the cell). The baseline of the promotion rule and the "before" of
    the table."""
    if space.current is not None:
        return space.current(shape, device)
    heur = space.heuristic(shape)
    if heur is None:
        return None
    return autotune.get_config(space.op, space.variant, type(heur), lambda: heur, key=space.key(shape), device=device)


# --------------------------------------------------------------------------------------------
# The GPU backend
# --------------------------------------------------------------------------------------------


class GpuBackend:
    """check, timer, A/B and precompile on the current GPU for one operator (module doc). One problem is kept
    at a time (the LM head's alone is 2.5 GB at hybrid-27b)."""

    def __init__(self, op: str, device=None, *, reps: int = 30, rounds: int = 60, workers: int | None = None,
                 log=print):
        if not torch.cuda.is_available():
            raise RuntimeError(f"specpilot tune: tuning {op} needs a GPU and none is visible here; run it on the GPU "
                               f"host, or use `specpilot tune --report` to read the stored configs")
        self.entry = OPS[op]
        self.device = torch.device(device or "cuda")
        self.reps, self.rounds = reps, rounds
        self.workers = workers or min(16, os.cpu_count() or 1)
        self.log = log
        self._key, self._prob = None, None

    def problem(self, shape):
        key = tuple(sorted(shape.items()))
        if key != self._key:
            self._key, self._prob = None, None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._prob = self.entry.problem(shape, self.device)
            self._key = key
        return self._prob

    def _pinned(self, space, cfg, fns):
        op = space.op

        def wrap(f):
            def call():
                with autotune.force(op, config=cfg):
                    return f()
            return call
        return [wrap(f) for f in fns]

    def _fns(self, space, cfg, shape):
        p = self.problem(shape)
        with autotune.force(space.op, config=cfg):
            return self._pinned(space, cfg, p.fns(space.variant))

    def check(self, space):
        def check(cfg, shape) -> bool:
            p = self.problem(shape)
            try:
                with autotune.force(space.op, config=cfg):
                    return bool(p.check(space.variant))
            except (KeyboardInterrupt, autotune.BuildError):
                raise
            except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is pruned
                raise autotune.BuildError(f"{type(e).__name__}: {str(e)[:300]}") from e
        return check

    def timer(self, space):
        from specpilot.bench.timing import time_fns

        def timer(cfg, shape) -> list[float]:
            try:
                return list(time_fns(self._fns(space, cfg, shape), self.device, reps=self.reps).samples)
            except (KeyboardInterrupt, autotune.BuildError):
                raise
            except Exception as e:  # noqa: BLE001
                raise autotune.BuildError(f"{type(e).__name__}: {str(e)[:300]}") from e
        return timer

    def ab(self, space):
        from specpilot.bench.timing import time_ab

        def ab(current, candidate, shape):
            a, b = time_ab(self._fns(space, current, shape), self._fns(space, candidate, shape), self.device,
                           rounds=self.rounds)
            return list(a.samples), list(b.samples)
        return ab

    def precompile(self, space):
        def precompile(cfgs, shape) -> None:
            p = self.problem(shape)
            t0 = time.monotonic()

            idx = None
            if self.device.type == "cuda":  # set_device needs an index; a plain "cuda" is the current device
                idx = self.device.index if self.device.index is not None else torch.cuda.current_device()

            def one(cfg):
                if idx is not None:
                    torch.cuda.set_device(idx)  # the thread's current context (NVRTC modules load into it)
                with autotune.force(space.op, config=cfg):
                    p.check(space.variant)  # what the check compiles (the LM head's exact logits)
                    p.fns(space.variant)[0]()

            failed, first = 0, None
            with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:
                for f in concurrent.futures.as_completed([ex.submit(one, c) for c in cfgs]):
                    e = f.exception()
                    failed += e is not None
                    first = first or (None if e is None else f"{type(e).__name__}: {str(e)[:200]}")
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.log(f"{_stamp()} precompiled {len(cfgs)} configs on {self.workers} threads in "
                     f"{time.monotonic() - t0:.1f} s ({failed} failed" + (f", first: {first}" if first else "") +
                     "; a failed build is built again, and pruned, in its trial)")
        return precompile


def make_backend(op: str, device=None, **kw):
    """The backend `specpilot tune` uses: `GpuBackend` (tests replace this function)."""
    return GpuBackend(op, device, **kw)


# --------------------------------------------------------------------------------------------
# One operator's run
# --------------------------------------------------------------------------------------------


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def _asdict(c):
    return dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c


def _record(op, variant, name, key, shape, res: TuneResult | None, current, seconds, error=None, where=None) -> dict:
    rec = dict(op=op, variant=variant, shape_name=name, key=key, shape=shape, seconds=round(seconds, 1),
               current=_asdict(current), error=error)
    if res is None:
        return rec
    d = res.decision
    before_s = d.current_median if d else res.heuristic_median_s
    after_s = d.candidate_median if d else res.median_s
    rec.update(tuned=_asdict(res.config), trials=res.trials, pruned=res.pruned, floor_s=res.floor_s,
               study_best_s=res.median_s, study_current_s=res.heuristic_median_s,
               before_s=before_s, after_s=after_s,
               before_over_floor=None if before_s is None else before_s / res.floor_s,
               after_over_floor=None if after_s is None else after_s / res.floor_s,
               decision=d.to_dict() if d else None, promoted=bool(d and d.promoted), stored=res.stored,
               stored_in=where if res.stored else None, note=res.note, study=res.study_name)
    return rec


def _merge(path: Path, records: list[dict]) -> list[dict]:
    old = []
    if path.exists():
        try:
            old = json.loads(path.read_text()).get("records", [])
        except (OSError, ValueError, AttributeError):
            old = []
    mine = {(r["op"], r["variant"], r["key"]) for r in records}
    allr = [r for r in old if (r.get("op"), r.get("variant"), r.get("key")) not in mine] + records
    meta = {"gpu": autotune.gpu_name(), **autotune.versions()}
    path.write_text(json.dumps({"meta": meta, "records": allr}, indent=1, sort_keys=True, default=str) + "\n")
    return allr


def _us(x) -> str:
    return "" if x is None else f"{x * 1e6:.1f}"


def _x(x) -> str:
    return "" if x is None else f"{x:.2f}"


def _cfg_str(space_params, cfg) -> str:
    if not isinstance(cfg, dict):
        return ""
    keys = list(space_params) if space_params else list(cfg)
    return " ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


def table_md(records: list[dict]) -> str:
    """The before/after table: the current config (stored entry or heuristic) against the study's best,
    medians of the interleaved A/B rounds when they ran (else of the study's trials), their ratio to the byte
    floor, and the promotion decision with its numbers."""
    lines = ["| op | variant | shape | key | before µs | before × floor | after µs | after × floor | gain | "
             "95% lower bound | noise | threshold | decision | stored | trials (pruned) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in records:
        d = r.get("decision") or {}
        if r.get("error"):
            lines.append(f"| {r['op']} | {r['variant']} | {r['shape_name']} | {r['key']} | | | | | | | | | "
                         f"failed: {str(r['error'])[:120]} | no | |")
            continue
        pct = (lambda v: "" if v is None else f"{v:+.1%}")
        decision = ("promoted" if r.get("promoted") else "kept current") if d else (r.get("note") or "")
        lines.append(
            f"| {r['op']} | {r['variant']} | {r['shape_name']} | {r['key']} | {_us(r.get('before_s'))} | "
            f"{_x(r.get('before_over_floor'))} | {_us(r.get('after_s'))} | {_x(r.get('after_over_floor'))} | "
            f"{pct(d.get('gain'))} | {pct(d.get('lower_bound'))} | {pct(d.get('noise'))} | {pct(d.get('threshold'))} | "
            f"{decision} | {'yes' if r.get('stored') else 'no'} | {r.get('trials', '')} ({r.get('pruned', '')}) |")
    configs = ["", "Configs (before -> after):", ""]
    for r in records:
        if r.get("tuned"):
            configs.append(f"- {r['op']}/{r['variant']}/{r['key']}: `{_cfg_str(None, r.get('current'))}` -> "
                           f"`{_cfg_str(None, r['tuned'])}`")
    return "\n".join(lines + configs) + "\n"


def run(op: str, *, shape_set: str = "hybrid-27b", only: str | None = None, variants: list[str] | None = None,
        trials: int = 32, time_budget: float | None = None, storage: str | None = None, out: str | None = None,
        ship: bool = False, backend=None, device=None, progress: bool = True, startup: int = 8,
        log: Callable[[str], None] = print) -> list[dict]:
    """Tune `op` at its shapes of `shape_set`, every declared variant (or `variants`), one study per (variant,
    shape); returns the decision records and writes them (DECISIONS, TABLE) under `out`. A failing shape is
    recorded with its error and the others go on. `time_budget` (seconds) is shared evenly among the (variant,
    shape) pairs still to run."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if op not in OPS:
        raise ValueError(f"specpilot tune: unknown op {op!r}; known: {', '.join(OPS)}")
    entry = OPS[op]
    spaces = [s for s in entry.spaces() if variants is None or s.variant in variants]
    if not spaces:
        known = [s.variant for s in entry.spaces()]
        raise ValueError(f"specpilot tune: {op} has no variant {variants}; its spaces: {', '.join(known)}")
    shapes = named_shapes(op, shape_set, only)
    if not shapes:
        every = ", ".join(n for n, _ in named_shapes(op, shape_set))
        raise ValueError(f"specpilot tune: no shape of {op} in {shape_set} matches --only {only!r}; its shapes: {every}")
    backend = backend or make_backend(op, device, log=log)
    dev = getattr(backend, "device", device)
    floor_dev = getattr(backend, "floor_device", dev)
    outdir = Path(out) if out else None
    if outdir:
        outdir.mkdir(parents=True, exist_ok=True)
    pairs = [(sp, n, s) for sp in spaces for n, s in shapes]
    deadline = None if time_budget is None else time.monotonic() + time_budget
    bar = None
    try:
        from tqdm import tqdm
    except ImportError:  # the per-shape log lines remain
        progress = False
    if progress:
        bar = tqdm(total=len(pairs) * trials, desc=op, unit="trial", file=sys.stderr, mininterval=2.0,
                   dynamic_ncols=True)
    records = []
    where = "shipped" if ship else "user cache"
    log(f"{_stamp()} {op}: {len(pairs)} studies ({', '.join(s.variant for s in spaces)} x {len(shapes)} shapes), "
        f"{trials} trials each" + ("" if time_budget is None else f", {time_budget:.0f} s in all") +
        f"; winners promoted go to the {where}")
    for i, (space, name, shape) in enumerate(pairs):
        t0 = time.monotonic()
        key = space.key(shape)
        share = None if deadline is None else max(0.0, (deadline - time.monotonic()) / (len(pairs) - i))
        current = None
        try:
            current = current_config(space, shape, dev)
            sp = dataclasses.replace(space, heuristic=lambda s, c=current: c,
                                     check=space.check or backend.check(space))

            def tick(ev, name=name):
                if bar is not None:
                    bar.update(1)
                    best = ev.get("best")
                    bar.set_postfix_str(f"{space.variant} {name} best {best:.2f}x floor" if best else
                                        f"{space.variant} {name}")

            if share is not None and share <= 0:
                raise TimeoutError("no time left in --time-budget")
            (res,) = tune(op, [shape], space=sp, timer=backend.timer(space), trials=trials, time_budget=share,
                          storage=storage, study_name="specpilot", floor_device=floor_dev, device=dev,
                          ab=backend.ab(space), precompile=backend.precompile(space), store_kw={"user": not ship},
                          startup=startup, progress=tick)
            rec = _record(op, space.variant, name, key, shape, res, current, time.monotonic() - t0, where=where)
            d = res.decision
            log(f"{_stamp()} {op}/{space.variant} {name} ({key}): before {_us(rec['before_s'])} us "
                f"({_x(rec['before_over_floor'])}x floor), after {_us(rec['after_s'])} us "
                f"({_x(rec['after_over_floor'])}x floor); {d.reason if d else res.note}; "
                f"{'stored in the ' + where if res.stored else 'not stored'} "
                f"[{res.trials} trials, {res.pruned} pruned, {time.monotonic() - t0:.0f} s]")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - one shape's failure is recorded; the others go on
            rec = _record(op, space.variant, name, key, shape, None, current, time.monotonic() - t0,
                          error=f"{type(e).__name__}: {e}")
            log(f"{_stamp()} {op}/{space.variant} {name} ({key}): FAILED {type(e).__name__}: {str(e)[:300]}")
        records.append(rec)
        if outdir:
            allr = _merge(outdir / DECISIONS, records)
            (outdir / TABLE).write_text(f"# Tuning: before and after ({autotune.gpu_name()})\n\n" + table_md(allr))
    if bar is not None:
        bar.close()
    return records


# --------------------------------------------------------------------------------------------
# The report's figure
# --------------------------------------------------------------------------------------------


def report_png(entries: dict[str, dict], path) -> Path | None:
    """Bars of time over the byte floor per stored entry (`op/variant/key`): the tuned config and, where
    recorded, the config it replaced. None (no file) when no entry carries the numbers."""
    rows = [(name, e["_"]["over_floor"], (e["_"].get("promotion") or {}).get("current_median"),
             e["_"].get("heuristic_over_floor"), e["_"].get("floor_s"))
            for name, e in sorted(entries.items()) if isinstance(e.get("_"), dict) and e["_"].get("over_floor")]
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ys = range(len(rows))
    before = [(cm / fl if cm and fl else h) or float("nan") for _, _, cm, h, fl in rows]
    ax.barh([y + 0.2 for y in ys], [r[1] for r in rows], height=0.4, label="tuned")
    ax.barh([y - 0.2 for y in ys], before, height=0.4, label="before (heuristic or replaced entry)", alpha=0.6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r[0] for r in rows], fontsize=7)
    ax.set_xlabel("median time / byte floor (1 = the floor)")
    ax.set_title(f"tuned configs: time over floor ({autotune.gpu_name()})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
