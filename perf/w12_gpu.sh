#!/usr/bin/env bash
# The W12 operator on the GPU machine in one device call (<= 10 minutes): test, profile, benchmark. Tuning:
# perf/tune_gpu.sh (specpilot tune --op w12.matmul: the mma, tma and tc spaces).
#
#   bash perf/w12_gpu.sh                          (OUT defaults to perf/out)
#   STAGES="ncu bench" bash perf/w12_gpu.sh       (a subset, in this order)
#
# Stages (STAGES, default "tests bench"), each under its own timeout so a hung kernel costs one stage:
#   tests   the W12 GPU tests (tests/w12, tests/test_sm90_codegen.py; TEST_K, TEST_SHARD, TEST_TIMEOUT 240 s).
#   ncu     Nsight Compute on NCU_COUNT W12 and cuBLAS launches of the benchmark, one line per kernel
#           (perf/ncu_summary.py) in summary.txt.
#   ab      perf/w12_ladder.py --ab "$AB" --promote (AB default xh,xs: x reloaded by halves and x through a shared
#           ring beside the shipped configs; AB_ROUNDS 20, AB_TIMEOUT 360 s); the promoted entries land in
#           autotune/configs/<gpu>.json, copied to $OUT/tuned.json. Before bench, so that the benchmark runs them.
#   bench   specpilot bench --ops linear w12 (BENCH_SHAPES, default hybrid-27b; BENCH_TIMEOUT 240 s), and its
#           summary (perf/bench_summary.py).
# Files in $OUT (<= 8): summary.txt pytest.log w12-ab.json tuned.json ab.log <stamp>-linear-w12.{json,md,png}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-tests bench}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage tests; then
  run_tests "$OUT/pytest.log" tests/w12 tests/test_sm90_codegen.py
  RC[tests]=$?
fi
if has_stage ncu; then
  run_ncu "$SCRATCH/ncu.csv" "w12|gemm|gemv|nvjet|sm90" python3 -m specpilot bench \
    --shapes "${BENCH_SHAPES:-hybrid-27b}" --ops linear w12 --reps 1 --out "$SCRATCH/ncu-bench"
  RC[ncu]=$?
fi
if has_stage ab; then
  timeout "${AB_TIMEOUT:-360}" python3 perf/w12_ladder.py --ab "${AB:-xh,xs}" --rounds "${AB_ROUNDS:-20}" --promote \
    >"$OUT/ab.log" 2>&1
  RC[ab]=$?
  tuned=$(python3 -c "import torch; from autotune.config import tuned_file; print(tuned_file(torch.device('cuda')))" \
    2>/dev/null)
  [ -n "$tuned" ] && [ -f "$tuned" ] && cp "$tuned" "$OUT/tuned.json"
fi
has_stage bench && run_bench 240 linear w12

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  has_stage ab && grep -E "^promote|shipped|ERROR" "$OUT/ab.log" | tail -n 40
  summary_common
} 2>&1 | tee "$OUT/summary.txt"
finish
