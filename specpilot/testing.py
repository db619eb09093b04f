"""Checking helpers used by the test suites and by the benchmark runner's correctness gates.

* `assert_bitwise_equal`: compares bit patterns, not values: -0.0 != +0.0 and NaN payloads count.
* `sass` / `mma_loop`: a CUBIN's SASS (Triton's bundled cuobjdump, no GPU needed) and its innermost loop holding
  tensor-core instructions, for checks of what the compiler made of a kernel.
* `raises_helpful`: the call raises in the house style "<pkg>.<fn>: what is wrong; how to fix".
* `error_bound` / `assert_close`: tolerances derived, not guessed. The kernel's error against an
  fp64 reference may be at most `factor` x the error of the same-precision PyTorch computation
  (plus a floor of `ulps` unit roundoffs of the baseline's dtype, for the case where PyTorch
  happens to be exact; small, so that the 2x rule and not the floor decides).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["assert_bitwise_equal", "bits_of", "error_bound", "assert_close", "rel_err", "Closeness", "capture_graph",
           "assert_replays_equal", "raises_helpful", "poison", "poisoned_empty", "poisoned_empty_like", "torch_path",
           "longest_first", "sass", "mma_loop"]

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's storage as same-width integers (contiguous copy if needed)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_OF[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Exact equality of shape, dtype and every bit. Reports the first mismatches."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{msg} dtype {actual.dtype} != {expected.dtype}")
    a, e = bits_of(actual).cpu(), bits_of(expected).cpu()
    bad = a != e
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        n = int(bad.sum())
        width = actual.element_size() * 2
        mask = (1 << (8 * actual.element_size())) - 1
        show = ", ".join(
            f"{tuple(i)}: 0x{int(a[tuple(i)]) & mask:0{width}x} != 0x{int(e[tuple(i)]) & mask:0{width}x}" for i in idx
        )
        raise AssertionError(f"{msg} {n}/{a.numel()} elements differ bitwise; first: {show}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||x - ref|| / ||ref|| over finite reference entries, in fp64."""
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    d = torch.linalg.vector_norm((x - ref)[fin])
    r = torch.linalg.vector_norm(ref[fin])
    return float(d / r) if r > 0 else float(d)


@dataclass(frozen=True)
class Closeness:
    err: float  # normwise relative error of the candidate
    base_err: float  # same for the same-precision PyTorch computation
    max_abs: float  # elementwise max |candidate - ref|
    base_max_abs: float
    bound: float
    max_abs_bound: float

    @property
    def ok(self) -> bool:
        """Within both derived bounds (what assert_close asserts)."""
        return self.err <= self.bound and self.max_abs <= self.max_abs_bound


def error_bound(actual: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, *, factor: float = 2.0,
                ulps: float = 1.0) -> Closeness:
    """Measure `actual` and `baseline` against an fp64 `ref64` and derive the bound."""
    # unit roundoff u = eps / 2 of the baseline's precision
    eps = torch.finfo(baseline.dtype).eps / 2 if baseline.is_floating_point() else 0.0
    fin = torch.isfinite(ref64)
    a, b, r = actual.double(), baseline.double(), ref64.double()
    base_err, err = rel_err(b, r), rel_err(a, r)
    base_max = float((b - r)[fin].abs().max()) if fin.any() else 0.0
    act_max = float((a - r)[fin].abs().max()) if fin.any() else 0.0
    scale = float(r[fin].abs().max()) if fin.any() else 0.0
    return Closeness(
        err=err,
        base_err=base_err,
        max_abs=act_max,
        base_max_abs=base_max,
        bound=factor * base_err + ulps * eps,
        max_abs_bound=factor * base_max + ulps * eps * scale,
    )


def assert_close(actual: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, *, factor: float = 2.0,
                 ulps: float = 1.0, msg: str = "") -> Closeness:
    """`actual` must be within `factor` x the error of `baseline` (same-precision PyTorch), both
    normwise and elementwise, against the fp64 reference; non-finite entries must match in kind
    (NaN where the reference is NaN, the same infinity where it is infinite)."""
    if actual.shape != ref64.shape:
        raise AssertionError(f"{msg} shape {tuple(actual.shape)} != {tuple(ref64.shape)}")
    a, r = actual.double().cpu(), ref64.double().cpu()
    nan_a, nan_r = torch.isnan(a), torch.isnan(r)
    if not torch.equal(nan_a, nan_r):
        raise AssertionError(f"{msg} NaN pattern differs: {int((nan_a != nan_r).sum())} positions")
    inf_r = torch.isinf(r)
    if not torch.equal(a[inf_r], r[inf_r]) or torch.isinf(a[~inf_r & ~nan_r]).any():
        raise AssertionError(f"{msg} infinities differ from the reference")
    c = error_bound(a, r, baseline.cpu(), factor=factor, ulps=ulps)
    if not c.ok:
        raise AssertionError(
            f"{msg} error {c.err:.3e} (max {c.max_abs:.3e}) exceeds {factor}x PyTorch's "
            f"{c.base_err:.3e} (max {c.base_max_abs:.3e}): bounds {c.bound:.3e} / {c.max_abs_bound:.3e}"
        )
    return c


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `fn()`: one warm-up call on a side stream (compiles and allocates outside the capture), then
    the capture on the current stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def assert_replays_equal(graph, outs, want, reps: int = 20) -> None:
    """Replay `graph` `reps` times, its outputs `outs` poisoned with NaN before each, and compare them bitwise with
    `want` (the same launches run eagerly)."""
    for rep in range(reps):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, w) in enumerate(zip(outs, want)):
            assert torch.equal(o, w), f"replay {rep}, launch {i}: differs from the eager launches"


@contextlib.contextmanager
def raises_helpful(pkg: str, *patterns: str, exc=(ValueError, TypeError)):
    """The block must raise `exc` with a message "<pkg>.<fn>: <what>; <how to fix>" whose text matches every
    regex in `patterns` (case-sensitive: they name the argument at fault). For test suites (needs pytest)."""
    import pytest

    style = re.compile(re.escape(pkg) + r"\.[\w.]+: [^;]+; \S")
    with pytest.raises(exc) as info:
        yield info
    text = str(info.value)
    assert style.match(text), f"not in the '{pkg}.<fn>: what; how to fix' style: {text!r}"
    for p in patterns:
        assert re.search(p, text), f"{p!r} not in the message: {text!r}"


_REAL_EMPTY = torch.empty
_REAL_EMPTY_LIKE = torch.empty_like


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh tensor so that an element a kernel never writes is caught: NaN for floating and complex
    tensors, True for bool, the dtype's max (0xA5 for uint8) for integers. Left alone while torch.compile traces
    (a fill would enter the graph) and for tensors that require grad (inductor's own helpers allocate those)."""
    if torch.compiler.is_compiling() or t.requires_grad:
        return t
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.numel():
        t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.uint8 else 0xA5)
    return t


def poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """`torch.empty`, poisoned (tests/conftest.py installs it for every test). It lives in this module, not in a
    conftest, so that torch.compile's guards on it name a module that imports by one name."""
    return poison(_REAL_EMPTY(*args, **kwargs))


def poisoned_empty_like(*args, **kwargs) -> torch.Tensor:
    """`torch.empty_like`, poisoned (see `poisoned_empty`)."""
    return poison(_REAL_EMPTY_LIKE(*args, **kwargs))


@contextlib.contextmanager
def torch_path():
    """The CPU a user without a GPU has: TRITON_INTERPRET=0 while the block runs (no Triton interpreter, so the
    operators take their torch paths), the variable as it was afterwards."""
    import os

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def longest_first(items, times_file) -> None:
    """Reorder pytest `items` in place by the call seconds a `SPECPILOT_TEST_TIMES` file (tests/conftest.py)
    recorded (tab-separated outcome, phase, seconds, test id, and optional further columns): longest first, each followed by the shortest one
    left, so the list alternates long and short from both ends. Tests the file does not name count as the longest,
    in collection order (their time is unknown). Under pytest-xdist every worker reads the same file, so every
    worker collects the same order. With `--maxschedchunk 1` (perf/gpu_env.sh) xdist hands each worker two tests
    to start and one more as each ends: a worker starts on a long test with a short one queued behind it, instead
    of two long ones in a row, and the run does not end waiting for one."""
    seconds = {}
    for line in Path(times_file).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[1] == "call":
            try:
                seconds[parts[3]] = float(parts[2])
            except ValueError:
                continue
    rank = {id(item): (0 if item.nodeid not in seconds else 1, -seconds.get(item.nodeid, 0.0), i)
            for i, item in enumerate(items)}
    ordered = sorted(items, key=lambda item: rank[id(item)])
    n = len(ordered)
    items[:] = [ordered[i // 2] if i % 2 == 0 else ordered[n - 1 - i // 2] for i in range(n)]


def sass(cubin) -> str:
    """The SASS of a CUBIN (bytes, or the path of a .cubin file), by the cuobjdump shipped in Triton's package."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if isinstance(cubin, (str, os.PathLike)):
        return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def mma_loop(text: str) -> list[str]:
    """The instructions, in order, of the shortest loop (a backward branch and the code from its target up to it) of
    SASS `text` that holds a tensor-core instruction (HMMA, HGMMA); empty when there is none."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    best: list[str] | None = None
    for addr, op in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) <= addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("MMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    return best or []
