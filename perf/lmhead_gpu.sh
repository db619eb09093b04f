#!/usr/bin/env bash
# The lmhead operator (certified greedy LM head) on the GPU machine in one device call (<= 10 minutes): test,
# benchmark.
#
#   bash perf/lmhead_gpu.sh                      (OUT defaults to perf/out)
#   STAGES=bench bash perf/lmhead_gpu.sh         (a subset, in this order)
#
# Stages (STAGES, default "tests bench"), each under its own timeout; keep their sum under the call's 600 s:
#   tests   the lmhead GPU tests (tests/lmhead, -m "gpu or hopper"), serially by default (TEST_WORKERS=0;
#           TEST_K, TEST_SHARD, TEST_TIMEOUT 200 s).
#   bench   specpilot bench --ops lmhead.argmax (BENCH_SHAPES, default hybrid-27b; BENCH_TIMEOUT 330 s): the
#           certified heads (INT8 and W12 screens) and w12.matmul + argmax beside cuBLAS F.linear + argmax, in
#           groups lm_head-M{1..32} and lm_head-{peaked,moderate,flat}-M{1,8} (the provider emits its cuBLAS
#           baseline itself, so the other linears are not run); its summary (perf/bench_summary.py), the table's
#           lm_head rows and the survivors each certified case printed.
# Files in $OUT (<= 8): summary.txt pytest.log bench.log <stamp>-lmhead.argmax.{json,md,png}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-tests bench}
TEST_WORKERS=${TEST_WORKERS:-0}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage tests; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} run_tests "$OUT/pytest.log" tests/lmhead
  RC[tests]=$?
fi
if has_stage bench; then
  run_bench 330 lmhead.argmax
  cp "$SCRATCH/bench.log" "$OUT/"
fi

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  summary_common
  if [ -n "${LATEST:-}" ]; then
    grep '^| lm_head' "${LATEST%.json}.md"
    grep -E "^  lm_head/certified-.*survivors" "$OUT/bench.log"
  fi
} 2>&1 | tee "$OUT/summary.txt"
finish
