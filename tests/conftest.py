"""Test setup shared by every suite.

* Without CUDA, Triton runs under its interpreter (TRITON_INTERPRET=1, set before any
  Triton import); importing autotune then repairs the two interpreter traps (autotune/interpreter.py).
* `gpu` marker: skipped where CUDA is missing; `hopper` marker: skipped unless sm_90.
* `torch.empty` / `empty_like` fill floating outputs with NaN (integers with a sentinel)
  so unwritten elements are caught.
* Every test starts with no cached dispatch plans, so a test that stubs a capability check or
  a launch sees its own stubs (autotune.clear_plans).
* Under pytest-xdist a worker whose CUDA context a test lost (a sticky CUDA error) ends after that test, and
  xdist starts a fresh one for the rest (specpilot/fault_guard.py).
* Under pytest-xdist each worker, and each process its tests start, runs cores / workers OpenMP, BLAS and numba
  threads (one on a 2-core machine), unless the caller set the variables.
* oneDNN (torch's CPU BF16 matmuls) is capped at AVX2 unless the caller set ONEDNN_MAX_CPU_ISA: with AMX or
  AVX512-BF16 it rounds BF16 products differently, and results committed from one x86 machine (the planted-fault
  check report) would not come out again on another.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# Under pytest-xdist each worker (and each process a test starts) gets its share of the cores for OpenMP, BLAS and
# numba threads: `make test` runs one worker per core, and a worker's second thread then waits on a core the other
# worker holds, at every parallel region (tests ran 1.6x slower than alone, with the CPU about half idle).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = str(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_var, _share)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or _share))  # in case torch came in before this file

from autotune import clear_plans, has_cuda, has_wgmma  # noqa: E402
from specpilot.fault_guard import pytest_runtest_makereport, pytest_runtest_protocol  # noqa: E402,F401
from specpilot.testing import longest_first, poisoned_empty, poisoned_empty_like  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the order is of the tests that run
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_hopper = pytest.mark.skip(reason="needs sm_90 (wgmma)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not has_wgmma():
            item.add_marker(skip_hopper)
    order = os.environ.get("SPECPILOT_TEST_ORDER")  # `make test-gpu` sets it to tests/gpu_durations.tsv
    if order and Path(order).is_file():
        longest_first(items, order)
    modules = {getattr(item, "module", None) for item in items}
    for m in modules:  # a run that selects the sm_90 codegen tests starts their builds in the background
        if m is not None and m.__name__.rpartition(".")[2] == "test_sm90_codegen":
            m.start_build(config)


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Every `torch.empty`/`empty_like` made during a test comes back full of NaN."""
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)
    yield


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_plans()
    yield


@pytest.fixture
def device():
    return torch.device("cuda" if has_cuda() else "cpu")


@pytest.fixture
def fake_h200(tmp_path, monkeypatch):
    """Pretend to be on an H200: the shipped tuned-config folder is the returned tmp folder, the user cache
    `tmp_path / "cache"` (never the developer's own ~/.cache), no tuned file read yet, no warning given yet."""
    from autotune import config as cfgmod

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(shipped))
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECPILOT_TUNED_CONFIGS", raising=False)
    monkeypatch.setattr(cfgmod, "has_cuda", lambda: True)
    monkeypatch.setattr(cfgmod, "is_interpreter", lambda: False)
    monkeypatch.setattr(cfgmod, "gpu_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(cfgmod, "gpu_slug", lambda device=None: "h200")
    monkeypatch.setattr(cfgmod, "_TUNED", {})
    monkeypatch.setattr(cfgmod, "_WARNED", set())
    return shipped


_TIMES = os.environ.get("SPECPILOT_TEST_TIMES")


def _cuda_in_use():
    """torch.cuda when this process has a CUDA context, else None (never creates one)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


class _GpuModules:
    """Where the session collects all of tests/, the modules holding GPU-marked tests, as `config.specpilot_gpu_modules`
    (None elsewhere): tests/test_gpu_selection.py reads them there instead of collecting tests/ again in a process of
    its own. Taken first among the collection hooks, before -m, -k, --deselect or --lf drop any item."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        whole = [Path(a.split("::")[0]).resolve() for a in config.args] == [Path(config.rootpath, "tests").resolve()]
        config.specpilot_gpu_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("gpu")
                                        or item.get_closest_marker("hopper")} if whole else None


class _GpuPeak:
    """With SPECPILOT_TEST_TIMES, a test call's peak of GPU memory held by torch's allocator (GiB) travels with its
    report: the workers of `make test-gpu` share one GPU's memory, and the file says which tests need the most. A
    plugin object, beside specpilot.fault_guard's report hook."""

    def pytest_runtest_setup(self, item):
        if (cuda := _cuda_in_use()) is not None:
            cuda.reset_peak_memory_stats()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "call" and (cuda := _cuda_in_use()) is not None:
            outcome.get_result().user_properties.append(("gpu_peak_gib", cuda.max_memory_reserved() / 2**30))


def pytest_configure(config):
    config.specpilot_gpu_modules = None
    config.pluginmanager.register(_GpuModules(), "specpilot-gpu-modules")
    if _TIMES:
        config.pluginmanager.register(_GpuPeak(), "specpilot-gpu-peak")


def pytest_runtest_logreport(report):
    """With SPECPILOT_TEST_TIMES=FILE, a line per test call, and per other phase that failed or took a second or
    more, is appended as it ends (outcome, phase, seconds, id, worker, start, GPU peak in GiB or -):
    a run killed at its time limit still says what took the time (`make test-gpu` sets it)."""
    if not _TIMES or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes what its workers report
        return
    if report.when == "call" or report.outcome != "passed" or report.duration >= 1.0:
        # the fifth and sixth columns: the xdist worker and the phase's start (Unix seconds), to lay the run out in
        # time; the seventh: the call's peak of GPU memory held by torch's allocator
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", "-")
        start = getattr(report, "start", 0.0)
        peak = dict(report.user_properties).get("gpu_peak_gib")
        with open(_TIMES, "a") as f:
            f.write(f"{report.outcome}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\t{worker}\t"
                    f"{start:.2f}\t{'-' if peak is None else f'{peak:.2f}'}\n")
    if report.failed:  # the failure itself, in case the run is stopped before pytest's summary
        with open(_TIMES + ".failures", "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{str(report.longreprtext)[-4000:]}\n")


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
    """A fresh JIT cache for one module's build tests: every build is a real NVRTC compilation, once per module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPILOT_CACHE", str(tmp_path_factory.mktemp("jit")))
    yield
    mp.undo()
