"""The one timing loop: every benchmark, tuner and exploration script times through this module.

* `time_cuda(fns)`: warm-up passes, then a CUDA graph (`specpilot.testing.capture_graph`) holding
  enough calls over the rotated inputs `fns` that one replay lasts ~200 µs; each replay is timed
  with CUDA events and divided by its calls. Without a graph (`graph=False`, or when capture is refused, e.g. by a
  host sync): CUDA events around eager passes over the rotated inputs, as many back to back as last ~5 ms (at
  least one), so that a call whose host work outlasts its kernels is timed at its steady rate, not at the latency
  of its first launch after the events' start.
* `time_cpu(fns)`: `time.perf_counter` around each call.
* `time_fns(fns, device)`: the one that suits the device.
* `time_ab(fns_a, fns_b, device)`: interleaved A/B rounds for the promotion rule (`autotune.promotion`): both
  captured as graphs of the same number of calls, then per round one replay of each, the order alternating,
  so that drift (clocks, temperature) reaches both alike.

`fns` is one callable or a sequence of them: the same call on different input copies, rotated so
that reads come from HBM and not from L2 (`specpilot.bench.rotations` says how many copies).
Each returns a `Timing`: the samples (seconds per call), the method and the calls per sample;
`.median`, `.p10`, `.p90` are quantiles of the samples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specpilot.testing import capture_graph

__all__ = ["Timing", "time_cuda", "time_cpu", "time_fns", "time_ab", "quantile"]

# Target duration of one timed sample (one graph replay) on CUDA, in seconds.
SAMPLE_S = 200e-6
MAX_CALLS_PER_GRAPH = 256
# Target duration of one eager sample (CUDA events around back-to-back calls): long enough that the host's lead
# before the first kernel (a call's own host work, ~0.1 ms for a one-call API with two launches) is a few percent
EAGER_SAMPLE_S = 5e-3


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile `q` in [0, 1] of `xs` (nan when empty)."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    samples: tuple[float, ...]  # seconds per call, one entry per timed sample
    method: str  # "cuda_graph", "cuda_events" or "perf_counter"
    calls: int  # calls per sample

    @property
    def median(self) -> float:
        return quantile(self.samples, 0.5)

    @property
    def p10(self) -> float:
        return quantile(self.samples, 0.1)

    @property
    def p90(self) -> float:
        return quantile(self.samples, 0.9)


def _as_list(fns) -> list[Callable[[], object]]:
    fns = [fns] if callable(fns) else list(fns)
    if not fns:
        raise ValueError("nothing to time: fns is empty")
    return fns


def _events_once(fns, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = len(fns)
    start.record()
    for i in range(calls):
        fns[i % n]()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / calls


def _time_events(fns, reps: int, warmup: int) -> Timing:
    n = len(fns)
    for i in range(max(warmup, 1) * n):
        fns[i % n]()
    torch.cuda.synchronize()
    est = min(_events_once(fns, n) for _ in range(3))
    calls = n * math.ceil(min(MAX_CALLS_PER_GRAPH, max(n, math.ceil(EAGER_SAMPLE_S / max(est, 1e-7)))) / n)
    return Timing(tuple(_events_once(fns, calls) for _ in range(reps)), "cuda_events", calls)


def _graph_of(fns, warmup: int, sample_s: float, calls: int | None = None):
    """(graph, calls): a CUDA graph of `calls` calls over the rotated inputs (whole passes), sized so that one
    replay lasts about `sample_s` when `calls` is None."""
    n = len(fns)
    for i in range(max(warmup, 1) * n):
        fns[i % n]()
    torch.cuda.synchronize()
    if calls is None:
        est = min(_events_once(fns, n) for _ in range(3))
        calls = max(1, math.ceil(sample_s / max(est, 1e-7)))
        calls = min(MAX_CALLS_PER_GRAPH, max(n, calls))
    calls = n * math.ceil(calls / n)  # whole passes over the rotated inputs

    def many():
        for i in range(calls):
            fns[i % n]()

    graph = capture_graph(many)  # its warm-up pass runs on a side stream (cuBLAS picks its workspace there)
    graph.replay()
    torch.cuda.synchronize()
    return graph, calls


def _time_graph(fns, reps: int, warmup: int, sample_s: float) -> Timing:
    graph, calls = _graph_of(fns, warmup, sample_s)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    samples = tuple(s.elapsed_time(e) * 1e-3 / calls for s, e in zip(starts, ends))
    del graph
    return Timing(samples, "cuda_graph", calls)


def time_cuda(fns, *, reps: int = 100, warmup: int = 5, graph: bool = True, sample_s: float = SAMPLE_S) -> Timing:
    """Time CUDA work on the current device: CUDA-graph replays when `graph` and capture works, else CUDA
    events around eager passes. `warmup`: passes over the rotated inputs before timing."""
    fns = _as_list(fns)
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if graph:
        try:
            return _time_graph(fns, reps, warmup, sample_s)
        except Exception:  # capture refused (e.g. a host sync inside fns): time eagerly instead
            torch.cuda.synchronize()
    return _time_events(fns, reps, warmup)


def time_cpu(fns, *, reps: int = 20, warmup: int = 2, budget_s: float | None = None) -> Timing:
    """`time.perf_counter` around each call. `budget_s`: stop sampling once this many seconds have passed
    (Triton kernels under the interpreter take seconds a call; at least one sample is taken)."""
    fns = _as_list(fns)
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    n = len(fns)
    for i in range(warmup):
        fns[i % n]()
    out = []
    start = time.perf_counter()
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % n]()
        out.append(time.perf_counter() - t0)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return Timing(tuple(out), "perf_counter", 1)


def time_fns(fns, device=None, *, reps: int | None = None, warmup: int | None = None, graph: bool = True,
             budget_s: float | None = None) -> Timing:
    """`time_cuda` on a CUDA device, else `time_cpu`. `device` defaults to CUDA where present; `reps` and
    `warmup` default to 100 / 5 on CUDA and 20 / 2 on the CPU."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return time_cuda(fns, reps=100 if reps is None else reps, warmup=5 if warmup is None else warmup,
                             graph=graph)
    return time_cpu(fns, reps=20 if reps is None else reps, warmup=2 if warmup is None else warmup,
                    budget_s=budget_s)


def time_ab(fns_a, fns_b, device=None, *, rounds: int = 60, warmup: int = 3, sample_s: float = SAMPLE_S
            ) -> tuple[Timing, Timing]:
    """Interleaved A/B timing: `rounds` paired samples of `fns_a` and `fns_b` (each one callable or rotated
    inputs, as `time_fns` takes them), A first in even rounds and B first in odd ones. On CUDA both are
    CUDA graphs of the same number of calls (sized on A) and each sample is one replay between events; on
    the CPU each sample is one pass under `time.perf_counter`. Returns (A's timing, B's timing)."""
    fa, fb = _as_list(fns_a), _as_list(fns_b)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type != "cuda":
        def one(fns):
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) / len(fns)

        for fns in (fa, fb):
            for _ in range(warmup):
                one(fns)
        a, b = [], []
        for r in range(rounds):
            if r % 2:
                b.append(one(fb))
                a.append(one(fa))
            else:
                a.append(one(fa))
                b.append(one(fb))
        return Timing(tuple(a), "perf_counter", len(fa)), Timing(tuple(b), "perf_counter", len(fb))
    with torch.cuda.device(device):
        ga, calls = _graph_of(fa, warmup, sample_s)
        gb, calls_b = _graph_of(fb, warmup, sample_s, calls=calls)
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(rounds)]
        for r in range(rounds):
            first, second = (ga, gb) if r % 2 == 0 else (gb, ga)
            e = ev[r]
            e[0].record()
            first.replay()
            e[1].record()
            second.replay()
            e[2].record()
        torch.cuda.synchronize()
        a, b = [], []
        for r in range(rounds):
            t1 = ev[r][0].elapsed_time(ev[r][1]) * 1e-3
            t2 = ev[r][1].elapsed_time(ev[r][2]) * 1e-3
            ta, tb = (t1, t2) if r % 2 == 0 else (t2, t1)
            a.append(ta / calls)
            b.append(tb / calls_b)
        del ga, gb
        return Timing(tuple(a), "cuda_graph", calls), Timing(tuple(b), "cuda_graph", calls_b)
