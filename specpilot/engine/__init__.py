"""The SpecPilot engine: Qwen3.5 hybrid models decoded greedily, autoregressively or with draft trees,
on this library's operators (docs/engine.md)."""

from .engine import NEAR_TIE, Engine, LosslessReport, SelfDrafter, check_lossless
from .loader import HybridConfig, load_config, load_tensors
from .model import HybridModel, KernelFallbackWarning, Kernels, Linear, Paths, Step
from .records import StepRecord

__all__ = ["Engine", "SelfDrafter", "StepRecord", "LosslessReport", "check_lossless", "NEAR_TIE", "HybridConfig",
           "HybridModel", "Kernels", "KernelFallbackWarning", "Linear", "Paths", "Step",
           "load_config", "load_tensors"]
