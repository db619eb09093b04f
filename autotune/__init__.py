"""Hardware ceilings, byte floors, the launch-config mechanism every operator uses, and the JIT builds and
launches of the CUDA C++ kernels (`autotune.jit`)."""

from .config import bucket_m, force, forced, get_config, drop_tuned, load_tuned, select_variant, shape_key, store_tuned, versions
from .hardware import (
    GPUS,
    Ceilings,
    GpuSpec,
    byte_floor,
    cached_ceilings,
    compute_capability,
    gpu_name,
    gpu_slug,
    gpu_spec,
    has_cuda,
    has_wgmma,
    is_interpreter,
    measure_ceilings,
    peak_rates,
)
from .jit import BuildError

__all__ = [
    "BuildError", "GPUS", "Ceilings", "GpuSpec", "bucket_m", "byte_floor", "cached_ceilings", "compute_capability",
    "force", "forced", "get_config", "gpu_name", "gpu_slug", "gpu_spec", "has_cuda", "has_wgmma",
    "drop_tuned", "is_interpreter", "load_tuned", "measure_ceilings", "peak_rates", "select_variant", "shape_key",
    "store_tuned", "versions",
]
