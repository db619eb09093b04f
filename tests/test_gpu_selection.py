"""`make test-gpu` collects only the modules that hold GPU-marked tests (perf/test_gpu.sh): that list must be the one
a collection of all of tests/ selects, or a GPU test would silently never run."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _listed(pkg: str = "") -> set[str]:
    env = {"PATH": "/usr/bin:/bin", "PKG": pkg}
    out = subprocess.run(["bash", "perf/test_gpu.sh", "--list"], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    return set(out.split())


def test_listed_modules_are_the_collected_gpu_modules(request):
    """The modules of GPU-marked tests: this session's collection where it collected all of tests/ (before any
    selection drops items; tests/conftest.py), else a collection of all of tests/ in a process of its own."""
    collected = request.config.specpilot_gpu_modules
    if collected is None:
        out = subprocess.run([sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-m", "gpu or hopper",
                              "-p", "no:cacheprovider", "-o", "addopts="], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
        assert collected, out.stdout[-2000:]
    assert collected and _listed() == collected


@pytest.mark.parametrize("pkg", ["w12", "gdn", "engine", "specpilot"])
def test_a_package_lists_its_own_modules(pkg):
    listed = _listed(pkg)
    assert listed and listed <= _listed()
    if pkg == "specpilot":
        assert all(p.startswith(("tests/test_", "tests/tools/")) for p in listed)
    else:
        assert all(p.startswith(f"tests/{pkg}/") for p in listed)
