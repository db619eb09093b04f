"""The ground floor: hardware table and measured ceilings, byte floors, launch configs (tuned
configs as data), the dispatch types (`Variants`, `Plan`), the JIT builds and launches of the CUDA C++
kernels (`autotune.jit`), Triton launches with less host work (`autotune.launch_triton`) and the interpreter
repairs.

Imports nothing of this project: operators build on it, never the other way round
(docs/architecture.md). With TRITON_INTERPRET=1 set, importing it applies the repairs of
`autotune.interpreter`, so every operator runs under the interpreter without a setup call.
"""

import os

from .config import bucket_m, drop_tuned, force, forced, get_config, load_tuned, shape_key, store_tuned, versions
from .dispatch import Plan, PlanCache, Variants, clear_plans, which_variant
from .hardware import (
    GPUS,
    Ceilings,
    GpuSpec,
    byte_floor,
    cached_ceilings,
    compute_capability,
    floor_rates,
    gpu_name,
    gpu_slug,
    gpu_spec,
    has_cuda,
    has_wgmma,
    is_interpreter,
    measure_ceilings,
    paper_floor,
    peak_rates,
)
from .jit import BuildError
from .triton_launch import launch as launch_triton

__all__ = [
    "BuildError", "GPUS", "Ceilings", "GpuSpec", "Plan", "PlanCache", "Variants", "bucket_m", "byte_floor", "cached_ceilings",
    "clear_plans", "compute_capability", "drop_tuned", "floor_rates", "force", "forced", "get_config", "gpu_name",
    "gpu_slug", "gpu_spec", "has_cuda", "has_wgmma", "is_interpreter", "launch_triton", "load_tuned",
    "measure_ceilings", "paper_floor",
    "peak_rates", "shape_key",
    "store_tuned", "versions", "which_variant",
]

# Submodules load on first attribute access (`autotune.tuner.SearchSpace` after `import autotune`), so the
# import stays light.
_SUBMODULES = ("config", "dispatch", "hardware", "interpreter", "jit", "promotion", "triton_launch", "tuner")


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

if os.environ.get("TRITON_INTERPRET") == "1":
    from . import interpreter as _interpreter

    _interpreter.apply()
