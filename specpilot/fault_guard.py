"""A pytest plugin for GPU runs under pytest-xdist: a worker whose CUDA context is lost ends after the test that
lost it, so that xdist starts a fresh worker for the tests still to run.

A sticky CUDA error (an illegal address, a launch failure, a device-side assert) poisons every later CUDA call of
the process: without this, each later test of that worker fails with the same error (one fault once showed up as
232 failures in `make test-gpu`). The failing test's reports are sent first; xdist then reports the worker's exit
against that same test and hands the worker's queued tests to the others. Outside xdist nothing changes.

`tests/conftest.py` imports the two hooks.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["STICKY", "is_sticky_cuda_error", "pytest_runtest_makereport", "pytest_runtest_protocol"]

# the texts of the CUDA errors after which the context is unusable (torch and Triton raise them as they are)
STICKY = ("an illegal memory access was encountered", "unspecified launch failure", "device-side assert triggered",
          "misaligned address", "an illegal instruction was encountered", "CUDA_ERROR_ILLEGAL_ADDRESS",
          "CUDA_ERROR_LAUNCH_FAILED", "cudaErrorIllegalAddress", "cudaErrorLaunchFailure")
EXIT_CODE = 70  # the worker's exit status after a sticky error


def is_sticky_cuda_error(text: str) -> bool:
    """Whether a failure's text names a CUDA error that leaves the process's context unusable."""
    return any(s in text for s in STICKY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and is_sticky_cuda_error(str(report.longreprtext)):
        item._specpilot_sticky = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    # after the test's reports went out (xdist sends each as it is logged), before its protocol completes
    if getattr(item, "_specpilot_sticky", False) and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(EXIT_CODE)
