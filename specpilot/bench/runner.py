"""Benchmark runner: check, then time side by side, then write one JSON file per run.

For each group of cases (`Case.group`), every case is set up and its `check()` runs first. A
case is timed and reported only if its check passed in this run; otherwise its row carries
`status` "check_failed" (or "setup_failed", "no_check", "error") and the error, and no time.

Timing: `specpilot.bench.timing` (CUDA-graph replays over the rotated input sets
`Prepared.fns`, timed with CUDA events; eager CUDA events for cases with `graph_safe=False` or
whose capture fails; `time.perf_counter` on the CPU).

The sample median is reported with the 10th and 90th percentiles. Floors are physical: `autotune.byte_floor`,
the case's bytes at the copy rate and its FLOPs at the BF16 matmul rate, both measured once at the start of the
run and never discounted. `paper_floor_us` beside it is the paper's floor (`autotune.paper_floor`: 90% of the
datasheet's bandwidth, 60% of its compute), labelled as such; None where the device has no datasheet entry.

On a CPU with TRITON_INTERPRET=1, a case whose check launched a Triton kernel ran under the interpreter: its
row says so (`interpreted`), it is timed with a few samples (a call takes seconds) and it gets no speedup, since
an interpreter's time says nothing about the kernel's. The log has a line per group and, per case, a line
when its check passed and one when it was timed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch

import autotune

from . import timing
from .registry import Case, Prepared

__all__ = ["run", "Results", "default_out_dir", "summarize_errors"]


class Results(list):
    """The rows of one run (a list of dicts), plus `meta` and the JSON `path` written (or None)."""

    meta: dict
    path: Path | None

    def __init__(self, rows=(), meta=None, path=None):
        super().__init__(rows)
        self.meta = meta or {}
        self.path = path


def default_out_dir(device: torch.device) -> Path:
    """perf/results/<gpu_slug> in the repository checkout (or under the working directory)."""
    repo = Path(__file__).resolve().parents[2]
    root = repo / "perf" / "results" if (repo / "perf").is_dir() else Path.cwd() / "perf" / "results"
    return root / autotune.gpu_slug(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Interpreted cases: at most this many timed samples, no warm-up (the check ran the call once), and this budget
# when the run sets none
INTERPRETED_REPS = 3
INTERPRETED_BUDGET_S = 2.0
GROUP_WARM_S = 0.25  # CUDA: seconds of the group's own calls before its first timing (clocks up, caches and JIT warm)


@contextlib.contextmanager
def _interpreter_launches(counter: list[int]):
    """Count Triton kernel launches under the interpreter (TRITON_INTERPRET=1) into counter[0]."""
    if not autotune.is_interpreter():
        yield
        return
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        yield
        return
    cls = interp.GridExecutor
    orig = cls.__call__

    def call(self, *args, **kwargs):
        counter[0] += 1
        return orig(self, *args, **kwargs)

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = orig


def _time(prep: Prepared, device: torch.device, reps: int, warmup: int,
          budget_s: float | None = None) -> timing.Timing:
    return timing.time_fns(prep.fns, device, reps=reps, warmup=warmup, graph=prep.graph_safe, budget_s=budget_s)


def _floor_s(case: Case, device: torch.device, floor=autotune.byte_floor) -> float | None:
    try:
        return floor(case.flops, case.bytes, device)
    except ValueError:
        return None


def _base_row(case: Case, common: dict) -> dict:
    return {
        **common,
        "op": case.op,
        "variant": case.variant,
        "shape": case.shape,
        "group": case.group,
        "dims": dict(case.dims),
        "flops": case.flops,
        "bytes": case.bytes,
        "status": "ok",
        "error": None,
        "median_us": None,
        "p10_us": None,
        "p90_us": None,
        "samples": 0,
        "method": None,
        "calls_per_sample": None,
        "rotations": None,
        "tbs": None,
        "tflops": None,
        "floor_us": None,
        "over_floor": None,
        "paper_floor_us": None,
        "baseline": case.baseline,
        "baseline_us": None,
        "speedup": None,
        "interpreted": False,
        "extra": dict(case.extra),
    }


def _short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _warm_group(preps: list[Prepared], device: torch.device) -> int:
    """On CUDA, every timed case's calls in turn, repeated until GROUP_WARM_S seconds have passed (at least one
    round); returns the rounds run (0 on a CPU, where there are no clocks to raise)."""
    if device.type != "cuda" or not preps:
        return 0
    rounds, t0 = 0, time.perf_counter()
    while True:
        for prep in preps:
            for fn in prep.fns:
                fn()
        _sync(device)
        rounds += 1
        if time.perf_counter() - t0 >= GROUP_WARM_S:
            return rounds


def _run_group(cases: list[Case], device: torch.device, reps: int, warmup: int, common: dict,
               log: Callable[[str], None], budget_s: float | None = None) -> list[dict]:
    if len(cases) > 1 and any(c.alone for c in cases):  # one case at a time (Case.alone), ratios over them all
        rows = [r for c in cases for r in _run_group([c], device, reps, warmup, common, log, budget_s)]
        _take_ratios(rows)
        return rows
    rows: list[dict] = []
    prepared: list[Prepared | None] = []
    for case in cases:
        row = _base_row(case, common)
        rows.append(row)
        name = f"{case.op}/{case.variant} {case.shape}"
        t0 = time.perf_counter()
        try:
            prep = case.setup()
        except Exception as e:
            row.update(status="setup_failed", error=_short_error(e))
            log(f"  {name}: setup failed: {row['error']}")
            prepared.append(None)
            _free(device)
            continue
        prepared.append(prep)
        if prep.check is None:
            row.update(status="no_check", error="case has no check(); not timed")
            log(f"  {name}: no check, not timed")
            continue
        launches = [0]
        try:
            with _interpreter_launches(launches):
                prep.check()
            _sync(device)
        except Exception as e:
            row.update(status="check_failed", error=_short_error(e))
            log(f"  {name}: CHECK FAILED: {row['error']}")
            continue
        row["interpreted"] = device.type != "cuda" and launches[0] > 0
        log(f"  {name}: check passed in {time.perf_counter() - t0:.1f} s"
            + (f" (Triton interpreter, {launches[0]} launches)" if row["interpreted"] else ""))
    # Warm the group as a whole before timing any of it: a GPU that idled (the first group of a run, or one after a
    # long setup) runs its first case below its clocks, which would put a cold baseline under every ratio
    _warm_group([p for p, r in zip(prepared, rows) if p is not None and r["status"] == "ok" and not r["interpreted"]],
                device)
    # Time side by side: every checked case of the group, one after the other.
    try:
        for case, prep, row in zip(cases, prepared, rows):
            if prep is None or row["status"] != "ok":
                continue
            t0 = time.perf_counter()
            try:
                if row["interpreted"]:
                    t = _time(prep, device, min(reps, INTERPRETED_REPS), 0,
                              budget_s if budget_s is not None else INTERPRETED_BUDGET_S)
                else:
                    t = _time(prep, device, reps, warmup, budget_s)
            except Exception as e:
                row.update(status="error", error=_short_error(e))
                log(f"  {case.op}/{case.variant} {case.shape}: timing failed: {row['error']}")
                if device.type == "cuda":
                    log(traceback.format_exc(limit=3))
                continue
            med = t.median
            row.update(
                median_us=med * 1e6,
                p10_us=t.p10 * 1e6,
                p90_us=t.p90 * 1e6,
                samples=len(t.samples),
                method=t.method,
                calls_per_sample=t.calls,
                rotations=len(prep.fns),
                tbs=case.bytes / med / 1e12 if med > 0 else None,
                tflops=case.flops / med / 1e12 if med > 0 else None,
            )
            floor = _floor_s(case, device)
            if floor is not None and floor > 0:
                row.update(floor_us=floor * 1e6, over_floor=med / floor)
            paper = _floor_s(case, device, autotune.paper_floor)
            if paper is not None:
                row["paper_floor_us"] = paper * 1e6
            log(f"  {case.op}/{case.variant} {case.shape}: {med * 1e6:.1f} µs median of {len(t.samples)} samples "
                f"in {time.perf_counter() - t0:.1f} s" + (" (interpreted: not a kernel time)" if row["interpreted"]
                                                           else ""))
    finally:
        for prep in prepared:
            if prep is not None and prep.teardown is not None:
                try:
                    prep.teardown()
                except Exception as e:  # teardown trouble must not hide results
                    log(f"  teardown failed: {_short_error(e)}")
        prepared.clear()
        _free(device)
    _take_ratios(rows)
    return rows


def _take_ratios(rows: list[dict]) -> None:
    """Each row's ratio against its group's baseline variant, when it was timed; none where either side was
    interpreted."""
    by_variant = {r["variant"]: r for r in rows if r["status"] == "ok" and r["median_us"]}
    for row in rows:
        base = by_variant.get(row["baseline"]) if row["baseline"] else None
        if base is not None and row["status"] == "ok" and row["median_us"] and not (row["interpreted"]
                                                                                     or base["interpreted"]):
            row.update(baseline_us=base["median_us"], speedup=base["median_us"] / row["median_us"])


def _ceilings(device: torch.device, measure: bool, log) -> tuple[dict | None, str]:
    try:
        if measure:
            if device.type == "cuda":
                c = autotune.measure_ceilings(device)
            else:  # the CPU's own roofs, small and quick; cached per name like a GPU's
                c = autotune.cached_ceilings(device) or autotune.measure_ceilings(
                    device, copy_bytes=16 << 20, matmul_n=512)
        else:
            c = autotune.cached_ceilings(device)
    except Exception as e:
        log(f"measuring ceilings failed: {_short_error(e)}")
        c = None
    if c is not None:
        return asdict(c), "measured"
    spec = autotune.gpu_spec(device)
    if spec is not None:
        return {"device": spec.name, "copy_tbs": spec.bandwidth_tbs, "bf16_tflops": spec.bf16_tflops}, "datasheet"
    return None, "none"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-")


def run(cases: Sequence[Case], device, out_dir=None, reps: int | None = None, warmup: int | None = None, *,
        shapes: str | None = None, measure: bool = True, write: bool = True, tag: str | None = None,
        case_budget_s: float | None = None, log: Callable[[str], None] | None = print) -> Results:
    """Check and time `cases` on `device`; return the rows (a `Results` list).

    `out_dir`: where the JSON goes (default perf/results/<gpu_slug>/); `write=False` writes
    nothing. `reps`: timed samples per case (default 100 on CUDA, 20 on CPU). `warmup`: passes
    over the rotated inputs before timing. `measure`: measure the roofs once at the start
    (cached per device name) so floors use measured ceilings. `tag`: the file name's suffix
    (default: the ops of the cases). `case_budget_s`: on CPU, stop sampling a case after this
    many seconds, with at least one sample (interpreted Triton kernels take seconds a call).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    log = log or (lambda s: None)
    reps = reps if reps is not None else (100 if device.type == "cuda" else 20)
    warmup = warmup if warmup is not None else (5 if device.type == "cuda" else 2)
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    ceilings, source = _ceilings(device, measure, log)
    ver = autotune.versions()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    common = {
        "gpu": autotune.gpu_name(device),
        "gpu_slug": autotune.gpu_slug(device),
        **ver,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, (name, group) in enumerate(groups.items()):
        log(f"[{i + 1}/{len(groups)} {time.perf_counter() - t0:5.0f} s] {name}: "
            + ", ".join(f"{c.op}/{c.variant}" for c in group))
        rows.extend(_run_group(group, device, reps, warmup, common, log, case_budget_s))
    ops = sorted({c.op for c in cases})
    meta = {
        **common,
        "device": str(device),
        "ceilings": ceilings,
        "ceilings_source": source,
        "shapes": shapes,
        "ops": ops,
        "reps": reps,
        "warmup": warmup,
        "case_budget_s": case_budget_s,
        "cases": len(cases),
        "ok": sum(r["status"] == "ok" for r in rows),
        "interpreted": sum(bool(r.get("interpreted")) for r in rows),
        "failed": sum(r["status"] != "ok" for r in rows),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    path = None
    if write:
        out = Path(out_dir) if out_dir is not None else default_out_dir(device)
        out.mkdir(parents=True, exist_ok=True)
        name = _slug(tag if tag is not None else "-".join(ops))[:60] or "none"
        path = out / f"{stamp}-{name}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    return Results(rows, meta, path)


def summarize_errors(rows: Sequence[dict]) -> list[str]:
    """One line per row that was not timed, for printing after the table."""
    return [f"{r['op']}/{r['variant']} {r['shape']}: {r['status']}: {r['error']}" for r in rows if r["status"] != "ok"]
