#!/usr/bin/env bash
# `make test-gpu`: every GPU-marked test (-m "gpu or hopper") of every package on this machine's GPU, in one
# command, under pytest-xdist. CUDA C++ specialisations are built once per machine: the workers share the JIT
# cache ($SPECPILOT_CACHE, autotune/jit.py), whose per-key lock lets one worker build while the others wait; Triton
# kernels likewise (TRITON_CACHE_MANAGER, autotune/triton_cache.py).
#
#   make test-gpu                 the GPU tests not marked slow (on one H200: docs/architecture.md gives the wall)
#   make test-gpu PKG=gdn         one package's: w12, gdn, tree_attn, lmhead, engine, specpilot (tests/*.py, tests/tools)
#   make test-gpu-full SHARD=1/3  the slow tier too (sweeps that repeat a code path), shard 1 of 3 of it
#
# Environment: OUT (default perf/out; the log is $OUT/test-gpu.log), TEST_WORKERS (default: the CPU cores, at most 16
# and at most one per 9 GiB of GPU memory), TEST_TIMEOUT
# (default 540 s), TEST_K (a pytest -k expression, e.g. "not ws_kernel"), PYTEST_ARGS (extra pytest arguments, split on
# spaces). Each test's seconds (and its peak of GPU memory in torch's allocator, GiB) go to $OUT/test-gpu-times.tsv
# as it ends (tests/conftest.py), so a run stopped at its limit still shows where the time went; the tests run
# longest first by the seconds tests/gpu_durations.tsv holds (SPECPILOT_TEST_ORDER). Wheels carried in .whl/ are installed first
# (perf/gpu_env.sh). Exit status: pytest's.
cd "$(dirname "$0")/.."
# the sources' fingerprint (packages, tests, perf scripts; not perf/results, whose files record runs and change
# nothing a run tests; not git's HEAD, which a copied working tree may not carry):
# `bash perf/test_gpu.sh --fingerprint` prints it on any checkout, to match a log to a commit
fingerprint() {
  find autotune gdn lmhead tree_attn w12 specpilot tests perf \( -path perf/out -o -path perf/results \) -prune -o -type f \
    \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.json' -o -name '*.sh' \) -print \
    | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
}
[ "${1:-}" = "--fingerprint" ] && { fingerprint; exit 0; }
# one worker per CPU core, at most 16: the tests spend their time on the CPU (Triton and NVRTC builds, launches,
# references) more than on the GPU. Each worker's torch gets cores / workers threads: with one OpenMP pool of all
# the cores per worker, the workers' CPU-side tensor work oversubscribes the machine. The workers share the GPU's
# memory, and the largest tests hold tens of GiB: at most one worker per 9 GiB (8 on an 80 GB H100, where 16 workers
# ran out of memory in 18 tests of a run of every package and in 2 of PKG=lmhead's; 15 on the H200). TEST_WORKERS
# overrides it (PKG=w12 passed with 16 on the H100)
NPROC=$(nproc 2>/dev/null || echo 8)
if [ -z "${TEST_WORKERS:-}" ]; then
  TEST_WORKERS=$(( NPROC < 16 ? NPROC : 16 ))
  GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -n 1)
  if [ -n "$GIB" ] && [ "$GIB" -gt 0 ] 2>/dev/null; then
    BY_MEMORY=$(( GIB / 1024 / 9 ))
    TEST_WORKERS=$(( BY_MEMORY < TEST_WORKERS ? (BY_MEMORY > 0 ? BY_MEMORY : 1) : TEST_WORKERS ))
  fi
fi
THREADS=$(( TEST_WORKERS > 0 ? NPROC / TEST_WORKERS : NPROC ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
[ "${1:-}" = "--list" ] || . perf/gpu_env.sh

case "${PKG:-}" in
  "") SEL=(tests) ;;
  w12 | gdn | tree_attn | lmhead | engine) SEL=("tests/$PKG") ;;
  specpilot | autotune) SEL=(tests/tools $(ls tests/test_*.py)) ;;
  *) echo "make test-gpu: unknown PKG=$PKG; use one of w12, gdn, tree_attn, lmhead, engine, specpilot" >&2; exit 2 ;;
esac
# only the modules that hold GPU-marked tests are collected: each of the workers imports and collects what it is
# given, and the CPU-only modules would cost every worker their imports (tests/test_gpu_selection.py checks that
# this list equals what a collection of all of tests/ selects)
mapfile -t SEL < <(grep -lE "mark\.(gpu|hopper)" -r "${SEL[@]}" --include='test_*.py' | LC_ALL=C sort)
[ "${1:-}" = "--list" ] && { printf '%s\n' "${SEL[@]}"; exit 0; }  # the modules it would collect
MARK="(gpu or hopper) and not slow"
[ -n "${FULL:-}" ] && MARK="gpu or hopper"
LOG=$OUT/test-gpu.log
export SPECPILOT_TEST_TIMES=$OUT/test-gpu-times.tsv
# longest tests first (tests/conftest.py): the seconds an H200 run recorded; refresh the file from a run's times with
#   awk -F'\t' -v OFS='\t' '$2=="call" {print $1, $2, $3, $4}' $OUT/test-gpu-times.tsv | sort -t$'\t' -k4 \
#     > tests/gpu_durations.tsv
export SPECPILOT_TEST_ORDER=${SPECPILOT_TEST_ORDER:-tests/gpu_durations.tsv}
# Triton kernels built once per machine as well: a worker that misses a kernel another one is building waits for
# it (autotune/triton_cache.py) instead of compiling the same kernel again
export TRITON_CACHE_MANAGER=${TRITON_CACHE_MANAGER:-autotune.triton_cache:SharedBuildCache}
rm -f "$SPECPILOT_TEST_TIMES"
START=$(date +%s)
{
  echo "# make test-gpu${PKG:+ PKG=$PKG}${FULL:+ (full${SHARD:+, shard $SHARD})}: -m \"$MARK\"${TEST_K:+ -k \"$TEST_K\"} ${SEL[*]}"
  echo "# $(date -u +%FT%TZ); sources $(fingerprint) (bash perf/test_gpu.sh --fingerprint on a checkout)"
  # the versions from the packages' metadata: importing torch, Triton and fla here would cost the log's first seconds
  python3 - <<'PY' 2>&1
import subprocess, sys
from importlib.metadata import PackageNotFoundError, version


def ver(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True).stdout.strip().split(", ")
except OSError:
    gpu = []
name, cc = (gpu + ["?", "?"])[:2]
print(f"# {name} sm_{cc.replace('.', '')}, python {sys.version.split()[0]}, torch {ver('torch')}, "
      f"triton {ver('triton')}")
print(f"# fla {ver('flash-linear-attention') or 'not installed'}")
PY
  echo "# $WHEELS; pytest-xdist workers: ${XDIST[*]:-none}; OMP_NUM_THREADS=$OMP_NUM_THREADS on $NPROC cores"
} >"$LOG"
set +e
if [ -n "${SHARD:-}" ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 perf/pytest_shard.py "$SHARD" "${SEL[@]}" -m "$MARK" -q -rfE --durations=30 \
    ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" ${PYTEST_ARGS:-} >>"$LOG" 2>&1
else
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest "${SEL[@]}" -m "$MARK" -q -rfE --durations=30 \
    ${TEST_K:+-k "$TEST_K"} "${XDIST[@]}" "${PYTEST_OPTS[@]}" ${PYTEST_ARGS:-} >>"$LOG" 2>&1
fi
RC=$?
echo "# exit $RC after $(( $(date +%s) - START )) s of wall time" >>"$LOG"
grep -E "^(FAILED|ERROR)" "$LOG" | head -n 40
tail -n 3 "$LOG"
exit $RC
