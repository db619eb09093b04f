#!/usr/bin/env bash
# The CUDA C++ GDN kernel in one device call: its GPU tests, then the exploration sweep beside the Triton
# default (48 layers per CUDA graph, outputs checked before timing), then (BENCH=1) the benchmark.
#   env: TESTS (0: skip) TEST_K TEST_TIMEOUT EXPLORE (0: skip) EXPLORE_ARGS EXPLORE_TIMEOUT BENCH BENCH_TIMEOUT
#        GPU_SUITE (1: also tests/gdn -m gpu, all of it) SUITE_TIMEOUT
cd "$(dirname "$0")/.."
. perf/session_env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -n 2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$OUT/env.txt" 2>&1
WHEELS="no .whl"
if compgen -G ".whl/*.whl" >/dev/null; then  # fla for the benchmark's chains (../shared/tools/device-wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH && WHEELS="installed $(ls .whl/*.whl | wc -l) wheels"
fi
echo "wheels: $WHEELS" >>"$OUT/env.txt"
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_WORKERS:-8}")
TEST_RC=skipped
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/gdn/test_gdn_cuda_gpu.py -q -x ${TEST_K:+-k "$TEST_K"} \
    "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$OUT/pytest-cuda.log" 2>&1
  TEST_RC=$?
fi
SUITE_RC=skipped
if [ "${GPU_SUITE:-0}" = 1 ]; then
  timeout "${SUITE_TIMEOUT:-300}" python3 -m pytest tests/gdn tests/test_sm90_codegen.py -m "gpu or hopper" -q \
    "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$OUT/pytest-gpu-suite.log" 2>&1
  SUITE_RC=$?
fi
EXPLORE_RC=skipped
if [ "${EXPLORE:-1}" != 0 ]; then
  timeout "${EXPLORE_TIMEOUT:-260}" python3 perf/gdn_explore.py ${EXPLORE_ARGS:---cases B1-N32,chain8,chain16,chain32,B24-N8 --configs none} \
    --budget "${EXPLORE_BUDGET:-230}" --fla-budget "${FLA_BUDGET:-0}" --out "$OUT" >"$OUT/explore.log" 2>&1
  EXPLORE_RC=$?
fi
BENCH_RC=skipped
if [ "${BENCH:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 -m specpilot bench --shapes hybrid-27b --ops gdn --out "$OUT" >"$OUT/bench.log" 2>&1
  BENCH_RC=$?
fi
TRACE_RC=skipped
if [ -n "${TRACE:-}" ]; then  # TRACE="--bv 64;--bv 64 --nopdl;...": perf/gdn_cuda_trace.py runs, ';'-separated
  IFS=';' read -ra TR <<<"$TRACE"
  for t in "${TR[@]}"; do
    echo "== trace $t" >>"$OUT/trace.log"
    timeout 120 python3 perf/gdn_cuda_trace.py $t --out "$OUT" >>"$OUT/trace.log" 2>&1
    TRACE_RC=$?
  done
fi
NCU_RC=skipped
if [ "${NCU:-0}" = 1 ]; then
  for bv in ${NCU_BV:-32}; do
    BV=$bv timeout 120 ncu --clock-control none --kernel-name gdn_tree_cuda_kernel --launch-skip 5 --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      python3 perf/gdn_cuda_one.py >"$OUT/ncu-bv$bv.txt" 2>&1
    NCU_RC=$?
  done
fi
LATEST=$(ls -t "$OUT"/2*-gdn.md 2>/dev/null | head -n 1)
{
  cat "$OUT/env.txt"
  echo "cuda tests rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$OUT/pytest-cuda.log" 2>/dev/null | tail -n 1)"
  grep -E "^FAILED|^ERROR|Error|assert" "$OUT/pytest-cuda.log" 2>/dev/null | head -n 12
  echo "gpu suite rc=$SUITE_RC: $(grep -E '(passed|failed|error)' "$OUT/pytest-gpu-suite.log" 2>/dev/null | tail -n 1)"
  grep -E "^FAILED|^ERROR" "$OUT/pytest-gpu-suite.log" 2>/dev/null | head -n 12
  echo "explore rc=$EXPLORE_RC"
  grep -E "^== |^  (wy|recurrent|cuda|ablate-cuda)" "$OUT/explore.log" 2>/dev/null | head -n 80
  echo "trace rc=$TRACE_RC"
  [ -f "$OUT/trace.log" ] && cat "$OUT/trace.log"
  echo "ncu rc=$NCU_RC"
  for f in "$OUT"/ncu-bv*.txt; do [ -f "$f" ] && { echo "$f"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Dynamic Shared|No Eligible|Block Limit" "$f" | head -n 14; }; done
  echo "bench rc=$BENCH_RC ${LATEST:-no result}"
  [ -n "$LATEST" ] && grep -E "gdn" "$LATEST" | head -n 40
} 2>&1 | tee "$OUT/summary.txt"
