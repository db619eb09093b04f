"""specpilot.fault_guard under pytest-xdist: after a test fails with a sticky CUDA error its worker ends and xdist
starts a fresh one, so the tests queued behind it run in a clean process instead of failing with the same error."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specpilot.fault_guard import is_sticky_cuda_error

pytest.importorskip("xdist")


def test_sticky_errors_are_recognised():
    assert is_sticky_cuda_error("RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel "
                                "errors might be asynchronously reported")
    assert is_sticky_cuda_error("triton.runtime.errors: CUDA_ERROR_ILLEGAL_ADDRESS")
    assert not is_sticky_cuda_error("AssertionError: 3 outputs differ")
    assert not is_sticky_cuda_error("torch.OutOfMemoryError: CUDA out of memory")  # recoverable: the worker stays


def test_a_lost_context_ends_the_worker_and_later_tests_run_elsewhere(tmp_path):
    (tmp_path / "conftest.py").write_text("from specpilot.fault_guard import pytest_runtest_makereport, "
                                          "pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_x.py").write_text(textwrap.dedent('''
        import os

        POISON = os.path.join(os.path.dirname(__file__), "poisoned-" + os.environ["PYTEST_XDIST_WORKER"])

        def _check_context():
            # a process whose context was lost fails every later test: this stands in for a real CUDA context
            if os.path.exists(POISON) and open(POISON).read() == str(os.getpid()):
                raise RuntimeError("CUDA error: an illegal memory access was encountered (a poisoned context)")

        def test_a_faults():
            open(POISON, "w").write(str(os.getpid()))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def test_b():
            _check_context()

        def test_c():
            _check_context()

        def test_d_ordinary_failure():
            assert 1 == 2
    '''))
    root = str(Path(__file__).resolve().parents[1])  # this checkout's specpilot, whatever is installed
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-o", "addopts=",
                          "-rA", "-p", "xdist", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    text = out.stdout + out.stderr
    assert "test_b PASSED" in text or "2 passed" in text, text[-3000:]
    assert "poisoned context" not in text, text[-3000:]  # no test ran in the lost worker after the fault
    assert "test_x.py::test_a_faults" in text and "test_x.py::test_d_ordinary_failure" in text
    assert "replacing crashed worker" in text or "crashed while running" in text, text[-3000:]
