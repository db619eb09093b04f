#!/usr/bin/env bash
# The GDN kernels in one device call: the exploration sweep (with --ablate: the default B1 config
# with phases removed, timed only), then the GDN GPU tests, then (BENCH=1) the benchmark.
#
#   bash perf/gdn_session.sh            (OUT defaults to perf/out)
#   env: EXPLORE (0: skip) EXPLORE_ARGS EXPLORE_BUDGET EXPLORE_TIMEOUT FLA_BUDGET TEST_K TEST_SHARD TEST_TIMEOUT
#        TEST_WORKERS
#        BENCH BENCH_TIMEOUT
#
# Files in $OUT: gdn_explore.json explore.log pytest.log [<stamp>-gdn.{json,md,png}] summary.txt
cd "$(dirname "$0")/.."
. perf/session_env.sh

EXPLORE_RC=skipped
if [ "${EXPLORE:-1}" != 0 ]; then
  timeout "${EXPLORE_TIMEOUT:-260}" python3 perf/gdn_explore.py ${EXPLORE_ARGS:---ablate} --budget "${EXPLORE_BUDGET:-230}" \
    --fla-budget "${FLA_BUDGET:-0}" --out "$OUT" >"$OUT/explore.log" 2>&1
  EXPLORE_RC=$?
fi

# TEST_WORKERS: pytest-xdist processes (default 8; 0: none). The GPU tests' time is mostly compiling a
# different config per test (10-30 s each, ~25 min for the 119 in one process), so workers sharing the
# one GPU cut it several-fold. They travel as wheels in .whl: pytest-xdist==3.8.0 and execnet==2.1.1
# (pip download --no-deps --only-binary=:all: into .whl, beside the ones ../shared/tools/device-wheels gets).
XDIST=()
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  XDIST=(-n "${TEST_WORKERS:-8}")
fi

# TEST_K: a pytest -k expression to run a subset (compiles of the many configs dominate the full run);
# TEST_SHARD=i/n: the i-th of n round-robin shards of that selection (perf/pytest_shard.py), so n calls
# run the whole GPU suite once
if [ -n "${TEST_SHARD:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 perf/pytest_shard.py "$TEST_SHARD" tests/gdn tests/test_sm90_codegen.py \
    -m "gpu or hopper" -q ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
else
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gdn tests/test_sm90_codegen.py -m "gpu or hopper" -q \
    ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
fi
TEST_RC=$?

BENCH_RC=skipped
if [ "${BENCH:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 -m specpilot bench --shapes hybrid-27b --ops gdn --out "$OUT" >/dev/null 2>&1
  BENCH_RC=$?
fi
LATEST=$(ls -t "$OUT"/2*-gdn.md 2>/dev/null | head -n 1)

{
  echo "explore rc=$EXPLORE_RC"
  if [ -f "$OUT/explore.log" ]; then
    sed -n '/== best per case/,$p' "$OUT/explore.log"
    grep -E "ABLATION|FAILED|ERROR" "$OUT/explore.log" | head -n 20
  fi
  echo "tests   rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"
  grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -n 10
  echo "bench   rc=$BENCH_RC ${LATEST:-no result}"
  [ -n "$LATEST" ] && grep -E "gdn" "$LATEST" | head -n 40
} 2>&1 | tee "$OUT/summary.txt"
