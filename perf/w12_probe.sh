#!/usr/bin/env bash
# Session-4 probe in one device call: the TMA GPU tests, perf/w12_tma_probe.py (the TMA kernel
# beside its null-consumer build, the mma kernel, cuBLAS and a plain read), the probe grid on
# three shapes.  Files in $OUT: pytest.log explore.log w12_mma_explore.json w12_tma_probe.json probe.log
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/perf/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTEST_OPTS=()
python3 -c "import pytest_benchmark" 2>/dev/null || PYTEST_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/w12/test_matmul_gpu.py -m "gpu or hopper" -q -k "${TEST_K:-tma or wg}" \
  "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
echo "tests rc=$?: $(tail -n 1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 10
timeout "${PROBE_TIMEOUT:-150}" python3 perf/w12_tma_probe.py --out "$OUT" >"$OUT/probe.log" 2>&1
echo "probe rc=$?"
timeout "${EXPLORE_TIMEOUT:-200}" python3 perf/w12_mma_explore.py --grid probe --only "${ONLY:-gdn.in_proj,attn.o_proj,mlp.gate_up_proj}" \
  --budget-s "${EXPLORE_BUDGET:-150}" --out "$OUT" >"$OUT/explore.log" 2>&1
echo "explore rc=$?"
grep -vE "^(built|SASS)" "$OUT/explore.log" | tail -n 24
