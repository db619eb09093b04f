#!/usr/bin/env bash
# GPU check in one call: GPU tests, `specpilot info`, then the benchmark registry.
#
#   bash perf/gpu_check.sh            (or: make gpu-check)
#
# Environment:
#   OUT            folder for everything that must come back (default perf/out)
#   BENCH_OPS      space-separated registered ops to bench (default: all)
#   BENCH_SHAPES   shape set (default hybrid-27b)
#   BENCH_REPS     timed samples per case (default: the runner's, 100 on CUDA)
#   TEST_TIMEOUT   seconds for the test stage (default 240)
#   BENCH_TIMEOUT  seconds for the bench stage (default 300)
#
# At most 8 files land in $OUT, flat, named with letters, digits, '.', '_' and '-' only:
#   pytest.log info.txt bench.log <stamp>-<ops or "all">.{json,md,png} summary.txt
# A failing test never stops the bench: every stage's exit status is recorded in summary.txt.
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/perf/out}
mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

# Wheels carried from the development machine (no network on the GPU machine).
if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >"$OUT/pip.tmp" 2>&1; then
    export PYTHONPATH=/tmp/site:$REPO
    WHEELS="installed $(ls .whl/*.whl | wc -l) wheel(s) into /tmp/site"
  else
    WHEELS="wheel install FAILED (rc=$?): $(tail -n 3 "$OUT/pip.tmp" | tr '\n' ' ')"
  fi
  rm -f "$OUT/pip.tmp"
else
  WHEELS="no .whl/ wheels carried"
fi
echo "== $WHEELS"

# 1. GPU tests. pyproject's addopts name pytest-benchmark; drop them if it is not installed.
PYTEST_OPTS=()
python3 -c "import pytest_benchmark" 2>/dev/null || PYTEST_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
echo "== pytest -m 'gpu or hopper'"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests -m "gpu or hopper" -q "${PYTEST_OPTS[@]}" 2>&1 | tee "$OUT/pytest.log"
TEST_RC=$?

# 2. Device, versions, measured roofs, variants per op.
echo "== specpilot info"
timeout 120 python3 -m specpilot info 2>&1 | tee "$OUT/info.txt"
INFO_RC=$?

# 3. Benchmarks, written straight into $OUT.
OPS_ARGS=()
if [ -n "${BENCH_OPS:-}" ]; then
  # shellcheck disable=SC2206
  OPS_ARGS=(--ops $BENCH_OPS)
fi
REPS_ARGS=()
[ -n "${BENCH_REPS:-}" ] && REPS_ARGS=(--reps "$BENCH_REPS")
echo "== specpilot bench --shapes ${BENCH_SHAPES:-hybrid-27b} ${OPS_ARGS[*]:-} ${REPS_ARGS[*]:-}"
timeout "${BENCH_TIMEOUT:-300}" python3 -m specpilot bench --shapes "${BENCH_SHAPES:-hybrid-27b}" \
  "${OPS_ARGS[@]}" "${REPS_ARGS[@]}" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
BENCH_RC=$?

# Keep a copy of the results with the repository's per-GPU results.
LATEST=$(ls -t "$OUT"/*.json 2>/dev/null | head -n 1)
if [ -n "$LATEST" ]; then
  SLUG=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['meta']['gpu_slug'])" "$LATEST" 2>/dev/null || echo unknown)
  mkdir -p "perf/results/$SLUG"
  cp "${LATEST%.json}".* "perf/results/$SLUG/" 2>/dev/null || true
fi

# Summary, last.
{
  echo "== summary"
  echo "wheels : $WHEELS"
  echo "tests  : rc=$TEST_RC  $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest.log" | tail -n 1)"
  echo "info   : rc=$INFO_RC  $(grep -E '^(device|ceilings)' "$OUT/info.txt" | tr -s ' ' | paste -sd ';' -)"
  if [ -n "$LATEST" ]; then
    python3 - "$LATEST" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
m, rows = d["meta"], d["rows"]
print(f"bench  : {m['ok']} timed, {m['failed']} not ({sys.argv[1].rsplit('/', 1)[-1]}, {m['wall_s']} s)")
acc = {}
for r in rows:
    if r["status"] == "ok" and r.get("speedup"):
        acc.setdefault((r["op"], r["variant"]), []).append(math.log(r["speedup"]))
for (op, v), xs in sorted(acc.items()):
    print(f"  {op}/{v}: geomean {math.exp(sum(xs) / len(xs)):.3f}x over {len(xs)} shapes")
for r in rows:
    if r["status"] != "ok":
        print(f"  NOT REPORTED {r['op']}/{r['variant']} {r['shape']}: {r['status']}: {str(r['error'])[:160]}")
PY
  fi
  echo "bench  : rc=$BENCH_RC"
  echo "files  : $(cd "$OUT" && ls | paste -sd ' ' -)"
} 2>&1 | tee "$OUT/summary.txt"
# Non-zero only after everything ran: a test failure (rc 5 = no tests selected is fine) or a bench failure.
[ "$TEST_RC" -eq 0 ] || [ "$TEST_RC" -eq 5 ] || exit 1
[ "$BENCH_RC" -eq 0 ] || exit 1
exit 0
