# Sourced by the perf/*.sh GPU scripts (from the repository root): shell options, $OUT, PYTHONPATH on the
# checkout, the wheels carried in .whl/ (the GPU machine has no network), PYTEST_OPTS for an image whose
# pytest lacks pytest-benchmark (the project's addopts name its options), and XDIST (pytest-xdist workers
# when its wheels travel: TEST_WORKERS, default 8, 0 for none).
set -u -o pipefail
export PYTHONUNBUFFERED=1
REPO=$PWD
OUT=${OUT:-$REPO/perf/out}
mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
WHEELS="no .whl/ wheels carried"
if compgen -G ".whl/*.whl" >/dev/null; then
  PIP_LOG=$(mktemp)
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >"$PIP_LOG" 2>&1; then
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    WHEELS="installed $(ls .whl/*.whl | wc -l) wheel(s) into /tmp/site"
  else
    WHEELS="wheel install FAILED: $(tail -n 3 "$PIP_LOG" | tr '\n' ' ')"
  fi
  rm -f "$PIP_LOG"
fi
PYTEST_OPTS=()
python3 -c "import pytest_benchmark" 2>/dev/null || PYTEST_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
XDIST=()
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  XDIST=(-n "${TEST_WORKERS:-8}")
  # one test at a time per worker (pytest-xdist >= 3.4): by default a worker starts with a run of consecutive
  # tests, and under the longest-first order (specpilot.testing.longest_first) the longest ones all go to the first
  # worker, one after another
  python3 -c "import inspect, sys, xdist.plugin as p; sys.exit('maxschedchunk' not in inspect.getsource(p))" \
    2>/dev/null && XDIST+=(--maxschedchunk 1)
fi

# has_stage NAME: whether NAME is in $STAGES (space-separated)
has_stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# run_tests LOG SELECTION...: the GPU tests of SELECTION (-m "gpu or hopper"), TEST_K as -k, TEST_SHARD=i/n as
# the i-th of n round-robin shards (perf/pytest_shard.py), under TEST_TIMEOUT; returns pytest's status.
run_tests() {
  local log=$1
  shift
  if [ -n "${TEST_SHARD:-}" ]; then
    timeout "${TEST_TIMEOUT:-240}" python3 perf/pytest_shard.py "$TEST_SHARD" "$@" -m "gpu or hopper" -q \
      ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$log" 2>&1
  else
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest "$@" -m "gpu or hopper" -q \
      ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" >"$log" 2>&1
  fi
}

# run_bench LIMIT OPS...: `specpilot bench --ops OPS` on BENCH_SHAPES (default hybrid-27b) under BENCH_TIMEOUT
# (default LIMIT seconds), its log in $SCRATCH/bench.log; sets RC[bench] and LATEST (the run's JSON in $OUT).
run_bench() {
  local limit=$1
  shift
  timeout "${BENCH_TIMEOUT:-$limit}" python3 -m specpilot bench --shapes "${BENCH_SHAPES:-hybrid-27b}" --ops "$@" \
    --out "$OUT" >"$SCRATCH/bench.log" 2>&1
  RC[bench]=$?
  LATEST=$(ls -t "$OUT"/2*-"$(IFS=-; echo "$*")".json 2>/dev/null | head -n 1)
}

# tests_line LOG: pytest's last count line
tests_line() { grep -E '(passed|failed|error|skipped|no tests ran)' "$1" 2>/dev/null | tail -n 1; }

# run_ncu OUTFILE KERNEL_REGEX CMD...: Nsight Compute details (CSV) of NCU_COUNT launches (default 6) of the
# kernels matching KERNEL_REGEX, after NCU_SKIP (default 20) matching launches, while CMD runs.
run_ncu() {
  local out=$1 regex=$2
  shift 2
  command -v ncu >/dev/null || { echo "no ncu on PATH" >"$out"; return 127; }
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --target-processes all -k "regex:$regex" \
    --launch-skip "${NCU_SKIP:-20}" --launch-count "${NCU_COUNT:-6}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    --csv --page details "$@" >"$out" 2>/dev/null
}

# summary_common: the lines every script's summary ends with: the tests, ncu and the benchmark ($LATEST: its JSON)
summary_common() {
  has_stage tests && { echo "tests: $(tests_line "$OUT/pytest.log")"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -n 10; }
  has_stage ncu && [ -s "$SCRATCH/ncu.csv" ] && python3 perf/ncu_summary.py "$SCRATCH/ncu.csv"
  if has_stage bench; then
    grep -E "CHECK FAILED|setup failed|timing failed" "$SCRATCH/bench.log" | head -n 10
    [ -n "${LATEST:-}" ] && python3 perf/bench_summary.py "$LATEST"
  fi
  return 0
}

# finish: drop $SCRATCH, then exit 1 if a stage failed (the tests' status 5, nothing selected, counts as passed)
finish() {
  rm -rf "$SCRATCH"
  for s in $STAGES; do [ "${RC[$s]:-1}" -eq 0 ] || [ "$s:${RC[$s]:-1}" = "tests:5" ] || exit 1; done
  exit 0
}
