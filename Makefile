# Two commands do all of the setup on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) ./.venv. Where the system Python already has torch (a GPU box),
# the venv sees it; elsewhere the CPU build is installed.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.specpilot-installed
TORCH_CPU ?= torch==2.13.0
TRITON  ?= triton==3.6.0
PYTEST_ARGS ?=
# pytest-xdist workers: the suite is CPU-bound (the Triton interpreter); one per core of a 2-core CI machine
TEST_WORKERS ?= 2

.PHONY: demo test test-fast gpu-check bench info clean

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if python3 -c "import torch" 2>/dev/null; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q $(TRITON)
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specpilot demo

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The edit loop: every test not marked slow (CUDA builds, sm_90 codegen, CLI subprocesses, deep trees,
# exhaustive sweeps run only in `make test`).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" -x -q $(PYTEST_ARGS)

info: $(STAMP)
	$(VENV)/bin/specpilot info

bench: $(STAMP)
	$(VENV)/bin/specpilot bench

# On the GPU machine: GPU tests, info and benchmarks in one call, results under $$OUT (or perf/out).
# Per operator: perf/w12_gpu.sh, perf/gdn_gpu.sh (perf/README.md).
gpu-check:
	bash perf/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
