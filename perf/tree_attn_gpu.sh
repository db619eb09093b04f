#!/usr/bin/env bash
# The tree_attn operator on the GPU machine in one device call (<= 10 minutes): test, benchmark.
#
#   bash perf/tree_attn_gpu.sh                   (OUT defaults to perf/out)
#   STAGES=bench bash perf/tree_attn_gpu.sh      (a subset, in this order)
#
# Stages (STAGES, default "tests bench"), each under its own timeout; keep their sum under the call's 600 s:
#   explore perf/tree_attn_explore.py: the split kernel's config grid and the time breakdown of one call
#           (EXPLORE_TIMEOUT 200 s); tree_attn_explore.{md,json} in $OUT.
#   tests   the tree_attn GPU tests (tests/tree_attn, -m "gpu or hopper"), serially by default (TEST_WORKERS=0;
#           TEST_K, TEST_SHARD, TEST_TIMEOUT 200 s).
#   bench   specpilot bench --ops tree_attn.tree_attention (BENCH_SHAPES, default hybrid-27b; BENCH_TIMEOUT
#           360 s: every "flex" case compiles first), and its summary (perf/bench_summary.py).
# Files in $OUT (<= 8): summary.txt pytest.log bench.log <stamp>-tree_attn.tree_attention.{json,md,png},
# tree_attn_explore.{md,json}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-tests bench}
TEST_WORKERS=${TEST_WORKERS:-0}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage explore; then
  timeout "${EXPLORE_TIMEOUT:-200}" python3 perf/tree_attn_explore.py --out "$OUT" >"$SCRATCH/explore.log" 2>&1
  RC[explore]=$?
  tail -n 20 "$SCRATCH/explore.log"
fi
if has_stage tests; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} run_tests "$OUT/pytest.log" tests/tree_attn
  RC[tests]=$?
fi
if has_stage bench; then
  run_bench 360 tree_attn.tree_attention
  cp "$SCRATCH/bench.log" "$OUT/"
fi

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  summary_common
  [ -n "${LATEST:-}" ] && grep '^| tree_attn' "${LATEST%.json}.md"
} 2>&1 | tee "$OUT/summary.txt"
finish
