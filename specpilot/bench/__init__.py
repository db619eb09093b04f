"""Benchmark harness: shape sets, the case registry and the runner."""

from .registry import Case, Prepared, collect, register, rotations
from .shapes import SHAPE_SETS, ModelShapes, get_shape_set
from .timing import Timing, time_cpu, time_cuda, time_fns

__all__ = ["Case", "Prepared", "collect", "register", "rotations", "SHAPE_SETS", "ModelShapes", "get_shape_set",
           "Timing", "time_cpu", "time_cuda", "time_fns"]
