"""Fixtures of the perf/ tools' CPU tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ladder():
    """perf/w12_ladder.py, loaded as the module `w12_ladder` for one test module."""
    spec = importlib.util.spec_from_file_location("w12_ladder", ROOT / "perf" / "w12_ladder.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)
