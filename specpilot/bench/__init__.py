"""Benchmark harness: shape sets, the case registry and the runner."""

from .registry import Case, Prepared, collect, register, rotations
from .shapes import SHAPE_SETS, ModelShapes, get_shape_set

__all__ = ["Case", "Prepared", "collect", "register", "rotations", "SHAPE_SETS", "ModelShapes", "get_shape_set"]
