#!/usr/bin/env bash
# The W12 kernels in one device call: sweep (and tune), GPU tests, ncu profile, benchmark.
#
#   bash perf/w12_session.sh            (OUT defaults to perf/out)
#
# Stages, each under its own timeout so a hung kernel costs one stage, not the call:
#   0. perf/w12_race_probe.py --small and --focus (lines in summary.txt): 0 bad launches except the nofence rows.
#   0b. perf/w12_step_probe.py: a quarter of the decode step in one graph, dispatch variants side by side.
#   1. perf/w12_mma_explore.py --grid final --emit: builds every cubin in parallel, checks each
#      config against fp64 before timing it (a wrong one is reported and skipped), stores the
#      per-cell winners in autotune/configs/<gpu>.json (copied to $OUT: copy it back).
#   2. the W12 GPU tests (tests/w12, test_sm90_codegen) with the warm cubin cache.
#   3. ncu on the default dispatch, cuBLAS and NCU_CONFIGS (perf/w12_diag.py), one line per kernel.
#   4. the benchmark (linear + w12 cases, hybrid-27b) with the new tuned file, and its summary.
# Files in $OUT (<= 10): race_probe_small.json step_probe.json explore.log h200.json pytest.log ncu-summary.txt <stamp>-linear-w12.{json,md,png}
# summary.txt
cd "$(dirname "$0")/.."
. perf/session_env.sh
SCRATCH=$(mktemp -d)

# 0. the race probes: launches alternating x / weights behind sleep kernels, every result checked;
#    --small: session 5's failing configs with and without the consumers' proxy fence
timeout "${RACE_TIMEOUT:-120}" python3 perf/w12_race_probe.py --small --launches "${RACE_SMALL_LAUNCHES:-150}" \
  --out "$SCRATCH/race" >"$SCRATCH/race.log" 2>&1
RACE_RC=$?
cp "$SCRATCH/race/race_probe_small.json" "$OUT/" 2>/dev/null
timeout "${RACE_TIMEOUT:-120}" python3 perf/w12_race_probe.py --focus --launches "${RACE_LAUNCHES:-400}" \
  --out "$SCRATCH/race" >>"$SCRATCH/race.log" 2>&1
RACE_RC=$((RACE_RC + $?))

# 0b. a quarter of the decode step as one CUDA graph: cuBLAS, W12 as dispatched, with PDL, all-TMA
timeout "${STEP_TIMEOUT:-150}" python3 perf/w12_step_probe.py --out "$SCRATCH/step" ${STEP_ARGS:-} \
  >"$SCRATCH/step.log" 2>&1
STEP_RC=$?
cp "$SCRATCH/step/step_probe.json" "$OUT/" 2>/dev/null

timeout "${EXPLORE_TIMEOUT:-240}" python3 perf/w12_mma_explore.py --grid final --emit --out "$SCRATCH/explore" \
  --budget-s "${EXPLORE_BUDGET:-170}" >"$OUT/explore.log" 2>&1
EXPLORE_RC=$?
cp autotune/configs/*.json "$OUT/" 2>/dev/null

timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/w12 tests/test_sm90_codegen.py -m "gpu or hopper" -q \
  "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
TEST_RC=$?

timeout "${NCU_TIMEOUT:-150}" python3 perf/w12_diag.py --out "$SCRATCH/diag" --ncu-only \
  --ncu-configs "${NCU_CONFIGS:-tma-s3,tma,mma-s3}" >/dev/null 2>&1
NCU_RC=$?
[ -f "$SCRATCH/diag/ncu.csv" ] && python3 perf/ncu_summary.py "$SCRATCH/diag/ncu.csv" >"$OUT/ncu-summary.txt" 2>&1

timeout "${BENCH_TIMEOUT:-180}" python3 -m specpilot bench --shapes hybrid-27b --ops linear w12 --out "$OUT" \
  >/dev/null 2>&1
BENCH_RC=$?
LATEST=$(ls -t "$OUT"/2*-linear-w12.json 2>/dev/null | head -n 1)

{
  echo "race    rc=$RACE_RC:"; grep '^{' "$SCRATCH/race.log"
  echo "step    rc=$STEP_RC:"; grep '^{' "$SCRATCH/step.log"; grep -E 'Error|error' "$SCRATCH/step.log" | tail -n 3
  echo "explore rc=$EXPLORE_RC: $(grep -E 'geomean|^bad' "$OUT/explore.log" | tr '\n' ' ')"
  echo "tests   rc=$TEST_RC: $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"
  echo "ncu     rc=$NCU_RC"
  echo "bench   rc=$BENCH_RC ${LATEST:-no result}"
  [ -n "$LATEST" ] && python3 perf/w12_bench_summary.py "$LATEST"
} 2>&1 | tee "$OUT/summary.txt"
rm -rf "$SCRATCH"
