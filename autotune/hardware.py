"""Hardware model: datasheet table, measured ceilings, byte floors, capability predicates.

Nothing here touches a device at import time. Predicates are computed lazily and cached.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = [
    "GpuSpec",
    "GPUS",
    "Ceilings",
    "gpu_name",
    "gpu_spec",
    "measure_ceilings",
    "cached_ceilings",
    "byte_floor",
    "paper_floor",
    "floor_rates",
    "peak_rates",
    "has_cuda",
    "compute_capability",
    "has_wgmma",
    "has_pdl",
    "is_interpreter",
]

# The paper's ceiling (its cost model): fractions of the datasheet peaks. `paper_floor` applies them; the
# physical floor (`byte_floor`) applies none.
COMPUTE_FRACTION = 0.60
BANDWIDTH_FRACTION = 0.90


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures (dense, no sparsity). Rates in TFLOP/s or TOP/s, bandwidth in TB/s. `copy_tbs` and
    `matmul_tflops`: the fastest rates this project measured on that GPU (`measure_ceilings`: a 2 GiB device copy,
    read plus written bytes; a BF16 8192^3 matmul), None where it measured none."""

    name: str
    bandwidth_tbs: float
    bf16_tflops: float
    int8_tops: float
    fp8_tflops: float
    sm_count: int
    capability: tuple[int, int]
    has_wgmma: bool
    copy_tbs: float | None = None
    matmul_tflops: float | None = None


# Keyed by a lower-case slug; `gpu_spec` matches torch's device name against `aliases`.
GPUS: dict[str, GpuSpec] = {
    # measured: copy 3.04 TB/s and matmul 790-813 TFLOP/s over the benchmark runs of perf/results/h100-sxm/
    "h100-sxm": GpuSpec("H100 SXM", 3.35, 989.0, 1979.0, 1979.0, 132, (9, 0), True, copy_tbs=3.04, matmul_tflops=813.0),
    # measured: copy 4.25-4.28 TB/s and matmul 771-793 TFLOP/s over the benchmark runs of perf/results/h200/
    "h200": GpuSpec("H200", 4.8, 989.0, 1979.0, 1979.0, 132, (9, 0), True, copy_tbs=4.28, matmul_tflops=793.0),
    "a100": GpuSpec("A100 SXM 80GB", 2.039, 312.0, 624.0, 0.0, 108, (8, 0), False),
    "l40s": GpuSpec("L40S", 0.864, 362.0, 733.0, 733.0, 142, (8, 9), False),
    "rtx-pro-6000": GpuSpec("RTX PRO 6000 Blackwell", 1.792, 503.8, 1007.0, 1007.0, 188, (12, 0), False),
    "b200": GpuSpec("B200", 8.0, 2250.0, 4500.0, 4500.0, 148, (10, 0), False),
}

_ALIASES = (
    ("h200", "h200"),
    ("h100", "h100-sxm"),
    ("a100", "a100"),
    ("l40s", "l40s"),
    ("rtx pro 6000", "rtx-pro-6000"),
    ("b200", "b200"),
)


@dataclass(frozen=True)
class Ceilings:
    """Measured roofs of one device. copy_tbs counts bytes read plus bytes written."""

    device: str
    copy_tbs: float
    bf16_tflops: float
    measured_at: str = ""


def has_cuda() -> bool:
    return torch.cuda.is_available()


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def host_only(device) -> bool:
    """CPU tensors without the Triton interpreter: no Triton kernel can run them; the operators' torch
    references do."""
    return torch.device(device).type == "cpu" and not is_interpreter()


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(device=None) -> str:
    """Marketing name of a CUDA device, or "cpu" when there is none (or `device` is a CPU)."""
    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not has_cuda():
        return "cpu"
    return _name_of(_index(device))


def gpu_slug(device=None) -> str:
    """File-system friendly name used for per-GPU results and tuned configs."""
    name = gpu_name(device).lower()
    for needle, slug in _ALIASES:
        if needle in name:
            return slug
    return "".join(c if c.isalnum() else "-" for c in name).strip("-") or "unknown"


def gpu_spec(device=None) -> GpuSpec | None:
    """Datasheet entry for `device` (a torch device, a GPU name or a slug); None if unknown."""
    if isinstance(device, GpuSpec):
        return device
    if isinstance(device, str) and device.lower() in GPUS:
        return GPUS[device.lower()]
    if isinstance(device, str) and not device.startswith(("cuda", "cpu")):
        name = device.lower()
    else:
        name = gpu_name(device).lower()
    for needle, slug in _ALIASES:
        if needle in name:
            return GPUS[slug]
    return None


@functools.cache
def compute_capability(index: int | None = None) -> tuple[int, int]:
    if not has_cuda():
        return (0, 0)
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


def _kernel_cc(device=None) -> tuple[int, int]:
    """Compute capability that compiled kernels target on `device`; (0, 0) on CPU and under the interpreter."""
    if is_interpreter() or not has_cuda():
        return (0, 0)
    if device is not None and torch.device(device).type != "cuda":
        return (0, 0)
    return compute_capability(_index(device))


def has_wgmma(device=None) -> bool:
    """True on sm_90 (Hopper), the only generation with wgmma. False on CPU and under the interpreter."""
    return _kernel_cc(device) == (9, 0)


def has_pdl(device=None) -> bool:
    """True where programmatic dependent launch exists (sm_90+). False on CPU and under the interpreter."""
    return _kernel_cc(device)[0] >= 9


# --------------------------------------------------------------------------------------
# Measured ceilings, cached per device name in memory and on disk.
# --------------------------------------------------------------------------------------

_CEILINGS: dict[str, Ceilings] = {}


def _cache_file() -> Path:
    root = os.environ.get("SPECPILOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specpilot"
    )
    return Path(root) / "ceilings.json"


def _load_disk() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def cached_ceilings(device=None) -> Ceilings | None:
    """Ceilings measured earlier for this device name (this process or the disk cache)."""
    name = gpu_name(device)
    if name in _CEILINGS:
        return _CEILINGS[name]
    entry = _load_disk().get(name)
    if entry:
        _CEILINGS[name] = Ceilings(**entry)
        return _CEILINGS[name]
    return None


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _time_cuda(fn, reps: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return _median([s.elapsed_time(e) for s, e in zip(starts, ends)]) * 1e-3


def _time_cpu(fn, reps: int) -> float:
    # Best of `reps`, not the median: a roof is an upper bound, and on a shared CPU other
    # processes only ever slow a run down (a median once read 2 GB/s for a 50 GB/s copy).
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def measure_ceilings(device=None, *, refresh: bool = False, copy_bytes: int | None = None,
                     matmul_n: int | None = None) -> Ceilings:
    """Measure copy bandwidth (read + write) and a large BF16 matmul rate on `device`.

    Results are cached per device name, in memory and in `~/.cache/specpilot/ceilings.json`
    (override the folder with SPECPILOT_CACHE_DIR). On a machine without CUDA the CPU is
    measured at a small scale, so the figures stay real but are the CPU's.
    """
    cuda = has_cuda() and (device is None or torch.device(device).type == "cuda")
    dev = torch.device("cuda", _index(device)) if cuda else torch.device("cpu")
    name = gpu_name(dev)
    if not refresh:
        hit = cached_ceilings(dev)
        if hit is not None:
            return hit
    gen = torch.Generator(device=dev).manual_seed(0)
    if cuda:
        nbytes = copy_bytes or 2 << 30  # 2 GiB, far past L2
        n = matmul_n or 8192
        timer, reps = _time_cuda, 20
    else:
        nbytes = copy_bytes or 64 << 20
        n = matmul_n or 1024
        timer, reps = _time_cpu, 5
    src = torch.rand(nbytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = timer(lambda: dst.copy_(src), reps)
    del src, dst
    # Random data: zeros run measurably faster on tensor cores (METHOD.md).
    a = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    for _ in range(3):
        a @ b
    mm_s = timer(lambda: a @ b, reps)
    del a, b
    if cuda:
        torch.cuda.synchronize()
    c = Ceilings(
        device=name,
        copy_tbs=2 * nbytes / copy_s / 1e12,
        bf16_tflops=2 * n**3 / mm_s / 1e12,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    _CEILINGS[name] = c
    disk = _load_disk()
    disk[name] = asdict(c)
    try:
        _cache_file().parent.mkdir(parents=True, exist_ok=True)
        _cache_file().write_text(json.dumps(disk, indent=1))
    except OSError:
        pass  # a read-only home is not an error; the in-process cache still holds
    return c


def _measured_or_spec(fn: str, device) -> tuple[float, float, str] | GpuSpec:
    """The ceilings measured on `device` as (B/s, FLOP/s, "measured") when cached, else its GpuSpec. A GPU name,
    slug or GpuSpec asks for the table entry whatever this machine measured. Raises when neither exists."""
    spec = gpu_spec(device) if isinstance(device, (str, GpuSpec)) and not str(device).startswith(("cuda", "cpu")) else None
    if spec is None:
        measured = cached_ceilings(device)
        if measured is not None:
            return measured.copy_tbs * 1e12, measured.bf16_tflops * 1e12, "measured"
        spec = gpu_spec(device)
    if spec is None:
        raise ValueError(
            f"{fn}: no rates known for {gpu_name(device)!r}; call autotune.measure_ceilings() first, "
            f"or pass one of {sorted(GPUS)} as `device`"
        )
    return spec


def peak_rates(device=None) -> tuple[float, float, str]:
    """(bandwidth in B/s, BF16 rate in FLOP/s, source) for `device`: measured ceilings when
    cached, else the datasheet. Raises for an unknown device with nothing measured."""
    got = _measured_or_spec("autotune.peak_rates", device)
    if isinstance(got, tuple):
        return got
    return got.bandwidth_tbs * 1e12, got.bf16_tflops * 1e12, "datasheet"


def floor_rates(device=None) -> tuple[float, float, str]:
    """(copy rate in B/s, BF16 matmul rate in FLOP/s, source) that `byte_floor` divides by: the ceilings measured
    on this device when cached (`measure_ceilings`), else the rates measured on that GPU model (`GpuSpec.copy_tbs`,
    `matmul_tflops`), else the datasheet peaks (a lower floor than any measured rate gives, still one no kernel can
    beat). `device`: a torch device, a GPU name or slug, or a GpuSpec. Raises for a device with none of these."""
    got = _measured_or_spec("autotune.byte_floor", device)
    if isinstance(got, tuple):
        return got
    if got.copy_tbs and got.matmul_tflops:
        return got.copy_tbs * 1e12, got.matmul_tflops * 1e12, f"measured on the {got.name} (autotune.GPUS)"
    return got.bandwidth_tbs * 1e12, got.bf16_tflops * 1e12, f"datasheet of the {got.name} (nothing measured)"


def _check_work(fn: str, flops: float, bytes: float) -> None:
    if flops < 0 or bytes < 0:
        raise ValueError(f"autotune.{fn}: flops and bytes must be non-negative, got {flops}, {bytes}; pass the "
                         "work of one call")


def byte_floor(flops: float, bytes: float, device=None) -> float:
    """Seconds: the physical floor, the slower of `flops` at the BF16 matmul rate and `bytes` at the copy rate
    (`floor_rates`: measured where measured, never discounted). `device` may be a torch device, a GPU name such as
    "H200", a slug from `GPUS`, or a GpuSpec. The paper's ceiling, which discounts the datasheet, is `paper_floor`.
    """
    _check_work("byte_floor", flops, bytes)
    bw, rate, _ = floor_rates(device)
    return max(flops / rate, bytes / bw)


def paper_floor(flops: float, bytes: float, device=None) -> float:
    """Seconds: the SpecPilot paper's floor, the slower of `flops` at 60% of the datasheet's peak BF16 compute and
    `bytes` at 90% of its peak bandwidth. Shown beside `byte_floor`, labelled as the paper's; it is a ceiling of
    the paper's cost model, not a physical bound. Raises for a device without a datasheet entry (a CPU)."""
    _check_work("paper_floor", flops, bytes)
    spec = gpu_spec(device)
    if spec is None:
        raise ValueError(f"autotune.paper_floor: no datasheet for {gpu_name(device) if not isinstance(device, str) else device!r}; "
                         f"pass one of {sorted(GPUS)} (the paper's floor is a fraction of a datasheet peak)")
    return max(flops / (COMPUTE_FRACTION * spec.bf16_tflops * 1e12),
               bytes / (BANDWIDTH_FRACTION * spec.bandwidth_tbs * 1e12))
