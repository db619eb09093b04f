"""The SpecPilot engine: Qwen3.5 hybrid models decoded greedily, autoregressively or with draft trees,
on this library's operators (docs/engine.md)."""

from .engine import Engine, SelfDrafter, StepRecord
from .loader import HybridConfig, load_config, load_tensors
from .model import HybridModel, Kernels, Linear, Step

__all__ = ["Engine", "SelfDrafter", "StepRecord", "HybridConfig", "HybridModel", "Kernels", "Linear", "Step",
           "load_config", "load_tensors"]
