# Two commands do all of the setup on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) ./.venv. Where the system Python already has torch (a GPU box),
# the venv sees it; elsewhere the CPU build is installed.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.specpilot-installed
TORCH_CPU ?= torch==2.13.0
TRITON  ?= triton==3.6.0
PYTEST_ARGS ?=
# pytest-xdist workers: the suite is CPU-bound (the Triton interpreter); one per core of a 2-core CI machine.
# worksteal: each worker starts on its own half of the tests and, when done, takes half of what the other has left,
# so the run does not end with one worker idle behind the other's last long tests (NVRTC builds of 10-30 s).
TEST_WORKERS ?= 2
TEST_DIST    ?= worksteal
# $(call pip_retry,PYTHON,ARGS): pip install ARGS into PYTHON's environment. A download that arrives corrupt fails
# pip's hash check ("THESE PACKAGES DO NOT MATCH THE HASHES"); the same install is tried once more without pip's
# cache before the target fails.
pip_retry = $(1) -m pip install -q $(2) || { echo "pip install failed; once more without the cache" >&2; \
            $(1) -m pip install -q --no-cache-dir $(2); }

.PHONY: demo test test-fast test-gpu test-gpu-full test-sglang gpu-check bench info clean

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if python3 -c "import torch" 2>/dev/null; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	@$(PY) -c "import torch" 2>/dev/null || { $(call pip_retry,$(PY),$(TORCH_CPU)); }
	@$(PY) -c "import triton" 2>/dev/null || { $(call pip_retry,$(PY),$(TRITON)); }
	$(call pip_retry,$(PY),-e ".[test]")
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specpilot demo

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist $(TEST_DIST) $(PYTEST_ARGS)

# The edit loop: every test not marked slow (CUDA builds, sm_90 codegen, CLI subprocesses, deep trees,
# exhaustive sweeps run only in `make test`).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist $(TEST_DIST) -m "not slow" -x -q $(PYTEST_ARGS)

# The SGLang integration's tests (tests_sglang/, docs/sglang.md) in a venv of their own: SGLang pins torch 2.14.1 and
# transformers 5.19.0, and its srt imports torchvision unconditionally. SGLang is installed without its dependencies
# (most are CUDA kernels); SGL_DEPS are the modules its quantization, linear, logits-processor and model-loader code
# imports. torch brings its own Triton (3.8). Installing them from scratch takes about 4.5 minutes and 6.3 GB.
SGL_VENV  ?= .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.specpilot-sglang-installed
SGL_TORCH ?= torch==2.14.1 torchvision==0.29.1
SGLANG    ?= sglang==0.5.23
SGL_DEPS  ?= orjson psutil pybase64 requests packaging starlette msgspec pydantic pyzmq tqdm IPython aiohttp \
             apache-tvm-ffi==0.1.11 dill sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf zstandard \
             transformers==5.19.0 openai==2.8.0 partial-json-parser einops \
             numpy numba safetensors optuna pytest pytest-benchmark

$(SGL_STAMP): pyproject.toml Makefile
	@test -x $(SGL_PY) || python3 -m venv $(SGL_VENV)
	$(call pip_retry,$(SGL_PY),$(SGL_TORCH))
	$(call pip_retry,$(SGL_PY),--no-deps $(SGLANG))
	$(call pip_retry,$(SGL_PY),$(SGL_DEPS) $(SGL_TORCH))
	$(SGL_PY) -m pip install -q --no-deps -e .
	$(SGL_PY) -c "import torch, sglang.srt.layers.linear; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	@touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	$(SGL_PY) -m pytest -p no:cacheprovider tests_sglang $(PYTEST_ARGS)

info: $(STAMP)
	$(VENV)/bin/specpilot info

bench: $(STAMP)
	$(VENV)/bin/specpilot bench

# On a GPU machine (the system python3 with torch; no venv, no network): every GPU-marked test, not marked slow, of
# every package (PKG=w12|gdn|tree_attn|lmhead|engine|specpilot: one package's), under pytest-xdist, the CUDA builds
# shared by the workers; the log in $$OUT/test-gpu.log (perf/test_gpu.sh). test-gpu-full adds the slow tier (sweeps
# that repeat a code path), SHARD=i/n splitting it across device calls.
PKG   ?=
SHARD ?=
test-gpu:
	PKG=$(PKG) bash perf/test_gpu.sh

test-gpu-full:
	FULL=1 PKG=$(PKG) SHARD=$(SHARD) bash perf/test_gpu.sh

# On the GPU machine: GPU tests, info and benchmarks in one call, results under $$OUT (or perf/out).
# Per operator: perf/w12_gpu.sh, perf/gdn_gpu.sh (perf/README.md).
gpu-check:
	bash perf/gpu_check.sh

clean:
	rm -rf $(VENV) $(SGL_VENV) .pytest_cache build *.egg-info
