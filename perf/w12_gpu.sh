#!/usr/bin/env bash
# The W12 operator on the GPU machine in one device call (<= 10 minutes): tune, test, profile, benchmark.
#
#   bash perf/w12_gpu.sh                          (OUT defaults to perf/out)
#   STAGES="tests bench" bash perf/w12_gpu.sh     (a subset, in this order)
#
# Stages (STAGES, default "sweep tests bench"), each under its own timeout so a hung kernel costs one stage:
#   sweep   perf/w12_mma_explore.py --grid final --emit: every CUDA config checked against fp64, then timed
#           beside cuBLAS; each cell's winner stored in autotune/configs/<gpu>.json (copied to $OUT: copy it
#           back to ship it). SWEEP_ARGS adds options (e.g. --only gdn.in_proj), SWEEP_TIMEOUT (240 s).
#   triton  perf/tune_w12.py: the GEMV kernel's grid (TRITON_ARGS, TRITON_TIMEOUT 240 s); the tensor-core kernel
#           is tuned by perf/tune_gpu.sh (specpilot tune --op w12.matmul).
#   tests   the W12 GPU tests (tests/w12, tests/test_sm90_codegen.py; TEST_K, TEST_SHARD, TEST_TIMEOUT 240 s).
#   ncu     Nsight Compute on NCU_COUNT W12 and cuBLAS launches of the benchmark, one line per kernel
#           (perf/ncu_summary.py) in summary.txt.
#   bench   specpilot bench --ops linear w12 (BENCH_SHAPES, default hybrid-27b; BENCH_TIMEOUT 240 s), and its
#           summary (perf/bench_summary.py).
# Files in $OUT (<= 8): summary.txt explore.log <gpu>.json tune_w12.json pytest.log <stamp>-linear-w12.{json,md,png}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-sweep tests bench}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage sweep; then
  timeout "${SWEEP_TIMEOUT:-240}" python3 perf/w12_mma_explore.py --grid final --emit --out "$SCRATCH/explore" \
    --budget-s "${SWEEP_BUDGET:-200}" ${SWEEP_ARGS:-} >"$OUT/explore.log" 2>&1
  RC[sweep]=$?
  cp autotune/configs/*.json "$OUT/" 2>/dev/null
fi
if has_stage triton; then
  timeout "${TRITON_TIMEOUT:-240}" python3 perf/tune_w12.py --out "$OUT" --budget-s "${TRITON_BUDGET:-200}" \
    ${TRITON_ARGS:-} >"$SCRATCH/tune_w12.log" 2>&1
  RC[triton]=$?
  cp autotune/configs/*.json "$OUT/" 2>/dev/null
fi
if has_stage tests; then
  run_tests "$OUT/pytest.log" tests/w12 tests/test_sm90_codegen.py
  RC[tests]=$?
fi
if has_stage ncu; then
  run_ncu "$SCRATCH/ncu.csv" "w12|gemm|gemv|nvjet|sm90" python3 -m specpilot bench \
    --shapes "${BENCH_SHAPES:-hybrid-27b}" --ops linear w12 --reps 1 --out "$SCRATCH/ncu-bench"
  RC[ncu]=$?
fi
has_stage bench && run_bench 240 linear w12

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  has_stage sweep && grep -E 'geomean|^bad|Error' "$OUT/explore.log" | tail -n 8
  has_stage triton && tail -n 12 "$SCRATCH/tune_w12.log"
  summary_common
} 2>&1 | tee "$OUT/summary.txt"
finish
