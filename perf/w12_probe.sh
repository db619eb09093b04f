#!/usr/bin/env bash
# Session-4 probe in one device call: the TMA GPU tests (look-ahead and wgmma configs run for the
# first time), the probe grid on three shapes (timings side by side with cuBLAS), ncu of the TMA
# variants with per-reason stalls.  Files in $OUT: pytest.log explore.log w12_mma_explore.json ncu.txt
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/perf/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTEST_OPTS=()
python3 -c "import pytest_benchmark" 2>/dev/null || PYTEST_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
SCRATCH=$(mktemp -d)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/w12/test_matmul_gpu.py -m "gpu or hopper" -q -k "tma or wg" \
  "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
echo "tests rc=$?: $(tail -n 1 "$OUT/pytest.log")"
timeout "${EXPLORE_TIMEOUT:-200}" python3 perf/w12_mma_explore.py --grid probe --only "${ONLY:-gdn.in_proj,attn.o_proj,mlp.gate_up_proj}" \
  --budget-s "${EXPLORE_BUDGET:-150}" --out "$OUT" >"$OUT/explore.log" 2>&1
echo "explore rc=$?"
timeout "${NCU_TIMEOUT:-150}" python3 perf/w12_diag.py --out "$SCRATCH/diag" --ncu-only \
  --ncu-configs "${NCU_CONFIGS:-tma-s3,tma,tma-wg,tma-wg-s3,tma-ah,mma}" >/dev/null 2>&1
echo "ncu rc=$?"
[ -f "$SCRATCH/diag/ncu.csv" ] && python3 perf/ncu_summary.py "$SCRATCH/diag/ncu.csv" >"$OUT/ncu.txt" 2>&1
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -n 15
grep -vE "^(built|SASS)" "$OUT/explore.log" | tail -n 30
rm -rf "$SCRATCH"
