#!/usr/bin/env bash
# The GPU check of the whole library in one device call: the GPU tests of every operator and of the
# benchmark harness, `specpilot info`, then the benchmark registry (all ops), and a summary last.
#
#   bash perf/gpu_check.sh            (or: make gpu-check; OUT defaults to perf/out)
#   TESTS=tests/lmhead BENCH_OPS=lmhead.argmax TEST_WORKERS=0 bash perf/gpu_check.sh      (one operator)
#   TESTS=tests/tree_attn BENCH_OPS=tree_attn.tree_attention BENCH_TIMEOUT=360 TEST_WORKERS=0 bash perf/gpu_check.sh
#
# Environment:
#   TESTS          space-separated test paths (default: tests); TESTS=none skips the test stage
#   BENCH_OPS      space-separated registered ops to bench (default: all)
#   BENCH_SHAPES   shape set (default hybrid-27b)
#   BENCH_REPS     timed samples per case (default: the runner's, 100 on CUDA)
#   TEST_K / TEST_SHARD=i/n   a -k subset / the i-th of n shards of the GPU tests (perf/pytest_shard.py)
#   TEST_TIMEOUT   seconds for the test stage (default 240; a cold machine compiles Triton kernels first)
#   BENCH_TIMEOUT  seconds for the bench stage (default 300)
#
# Files in $OUT (<= 8): pytest.log info.txt bench.log <stamp>-<ops or "all">.{json,md,png} summary.txt
# A failing test never stops the bench: every stage's exit status is in summary.txt, and the script exits
# non-zero at the end if the tests or the bench failed.
cd "$(dirname "$0")/.."
. perf/gpu_env.sh
echo "== $WHEELS"

TEST_RC=0
if [ "${TESTS:-tests}" != none ]; then
  echo "== pytest -m 'gpu or hopper' ${TESTS:-tests}"
  # shellcheck disable=SC2086
  run_tests "$OUT/pytest.log" ${TESTS:-tests}
  TEST_RC=$?
  tail -n 30 "$OUT/pytest.log"
fi

echo "== specpilot info"
timeout 120 python3 -m specpilot info 2>&1 | tee "$OUT/info.txt"
INFO_RC=$?

OPS_ARGS=()
# shellcheck disable=SC2206
[ -n "${BENCH_OPS:-}" ] && OPS_ARGS=(--ops $BENCH_OPS)
REPS_ARGS=()
[ -n "${BENCH_REPS:-}" ] && REPS_ARGS=(--reps "$BENCH_REPS")
echo "== specpilot bench --shapes ${BENCH_SHAPES:-hybrid-27b} ${OPS_ARGS[*]:-} ${REPS_ARGS[*]:-}"
timeout "${BENCH_TIMEOUT:-300}" python3 -m specpilot bench --shapes "${BENCH_SHAPES:-hybrid-27b}" \
  "${OPS_ARGS[@]}" "${REPS_ARGS[@]}" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
BENCH_RC=$?
LATEST=$(ls -t "$OUT"/2*.json 2>/dev/null | head -n 1)

{
  echo "== summary"
  echo "wheels : $WHEELS"
  echo "tests  : rc=$TEST_RC  $(tests_line "$OUT/pytest.log")"
  grep -E "^FAILED|^ERROR" "$OUT/pytest.log" 2>/dev/null | head -n 10
  echo "info   : rc=$INFO_RC  $(grep -E '^(device|ceilings)' "$OUT/info.txt" | tr -s ' ' | paste -sd ';' -)"
  [ -n "$LATEST" ] && python3 perf/bench_summary.py "$LATEST"
  echo "bench  : rc=$BENCH_RC"
  echo "files  : $(cd "$OUT" && ls | paste -sd ' ' -)"
} 2>&1 | tee "$OUT/summary.txt"
# rc 5 = no tests selected (e.g. an empty shard) is fine
[ "$TEST_RC" -eq 0 ] || [ "$TEST_RC" -eq 5 ] || exit 1
[ "$BENCH_RC" -eq 0 ] || exit 1
exit 0
