"""Hardware ceilings, byte floors and the launch-config mechanism every operator uses."""

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

__all__ = [
    "GPUS", "Ceilings", "GpuSpec", "bucket_m", "byte_floor", "cached_ceilings", "compute_capability",
    "force", "forced", "get_config", "gpu_name", "gpu_slug", "gpu_spec", "has_cuda", "has_wgmma",
    "drop_tuned", "is_interpreter", "load_tuned", "measure_ceilings", "peak_rates", "select_variant", "shape_key",
    "store_tuned", "versions",
]
