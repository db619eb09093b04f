#!/usr/bin/env bash
# The GDN operator on the GPU machine in one device call (<= 10 minutes): test, sanitize, profile, benchmark.
# Tuning: perf/tune_gpu.sh (specpilot tune --op gdn.tree_verify).
#
#   bash perf/gdn_gpu.sh                                   (OUT defaults to perf/out)
#   STAGES="sanitize bench" bash perf/gdn_gpu.sh           (a subset, in this order)
#   TEST_SHARD=2/3 STAGES=tests bash perf/gdn_gpu.sh       (the whole GPU suite takes ~20 minutes: 3 calls)
#
# Stages (STAGES, default "tests bench"), each under its own timeout; keep their sum under the call's 600 s:
#   tests   the GDN GPU tests (tests/gdn, tests/test_sm90_codegen.py; TEST_K, TEST_SHARD, TEST_TIMEOUT 300 s,
#           TEST_WORKERS pytest-xdist processes when its wheels travel in .whl).
#   sanitize  the index-guard tests (tests/gdn/test_gdn_guard_gpu.py) under `compute-sanitizer --tool memcheck`,
#           every tensor its own allocation (PYTORCH_NO_CUDA_MEMORY_CACHING=1); host API return codes are not
#           reported (cuda.bindings probes optional driver entry points with cuGetProcAddress at import, which
#           memcheck counts as errors); SANITIZE_TIMEOUT 200 s; its log is sanitize.log.
#   ncu     Nsight Compute on NCU_COUNT GDN kernel launches of the benchmark, one line per kernel
#           (perf/ncu_summary.py) in summary.txt.
#   bench   specpilot bench --ops gdn (BENCH_SHAPES, default hybrid-27b; BENCH_TIMEOUT 240 s), and its summary.
# Files in $OUT (<= 8): summary.txt pytest.log sanitize.log <stamp>-gdn.{json,md,png}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-tests bench}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage tests; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} run_tests "$OUT/pytest.log" tests/gdn tests/test_sm90_codegen.py
  RC[tests]=$?
fi
if has_stage sanitize; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-200}" compute-sanitizer --tool memcheck \
    --leak-check no --report-api-errors no --target-processes application-only --print-limit 50 --error-exitcode 86 \
    python3 -m pytest tests/gdn/test_gdn_guard_gpu.py -q "${PYTEST_OPTS[@]}" >"$OUT/sanitize.log" 2>&1
  RC[sanitize]=$?
fi
if has_stage ncu; then
  run_ncu "$SCRATCH/ncu.csv" "gdn" python3 -m specpilot bench --shapes "${BENCH_SHAPES:-hybrid-27b}" --ops gdn \
    --reps 1 --out "$SCRATCH/ncu-bench"
  RC[ncu]=$?
fi
has_stage bench && run_bench 240 gdn

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  has_stage sanitize && grep -E "passed|failed|ERROR SUMMARY|Invalid" "$OUT/sanitize.log" | tail -n 5
  summary_common
} 2>&1 | tee "$OUT/summary.txt"
finish
