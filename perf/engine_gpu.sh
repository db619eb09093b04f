#!/usr/bin/env bash
# The engine on the GPU machine in one device call (<= 10 minutes): its GPU tests, then the step benchmark on the
# synthetic full-size model.
#
#   bash perf/engine_gpu.sh                      (bench and demo; OUT defaults to perf/out)
#   STAGES=tests bash perf/engine_gpu.sh         (the GPU tests, in a call of their own)
#   STAGES=bench bash perf/engine_gpu.sh         (a subset, in this order)
#
# Stages (STAGES, default "bench demo"; "tests" is a call of its own), each under its own timeout; keep their sum
# under the call's 600 s:
#   tests   the engine GPU tests (tests/engine, the tiny trained model, the tree builder; -m "gpu or hopper";
#           TEST_TIMEOUT 420 s: about 30 tests, each building its kernels and graphs; TEST_K for a subset, or
#           STAGES=tests alone in one call and STAGES="bench demo" in the next)
#   bench   python -m specpilot.bench.engine (BENCH_SHAPES, default hybrid-27b; ENGINE_ARGS, e.g. "--no-peer --reps 20",
#           "--fused-glue", or "--fused-glue --no-peer --processes --rounds 2" on an 80 GB GPU (--formats
#           bf16,w12,w12-glue-swiglu adds the W12 model with SwiGLU by the glue kernel); BENCH_TIMEOUT 330 s):
#           the AR and verify steps in CUDA graphs, BF16 and W12, against their byte floors, and the transformers
#           peer on the same weights
#   demo    specpilot demo --device cuda: the tiny trained model's τ with each drafter (DEMO_TIMEOUT 120 s)
# Files in $OUT: summary.txt pytest.log bench.log demo.log <stamp>-engine.{json,md}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-bench demo}
TEST_WORKERS=${TEST_WORKERS:-0}
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage tests; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-420} run_tests "$OUT/pytest.log" tests/engine tests/test_tiny_model.py tests/test_tree_builder.py
  RC[tests]=$?
fi
if has_stage bench; then
  timeout "${BENCH_TIMEOUT:-330}" python3 -m specpilot.bench.engine --shapes "${BENCH_SHAPES:-hybrid-27b}" \
    --out "$OUT" ${ENGINE_ARGS:-} >"$OUT/bench.log" 2>&1
  RC[bench]=$?
fi
if has_stage demo; then
  timeout "${DEMO_TIMEOUT:-120}" python3 -m specpilot demo --device cuda >"$OUT/demo.log" 2>&1
  RC[demo]=$?
fi

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  has_stage tests && { echo "tests: $(tests_line "$OUT/pytest.log")"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -n 20; }
  has_stage bench && { grep -v -i warn "$OUT/bench.log" | tail -n 30; cat "$OUT"/*-engine.md 2>/dev/null; }
  has_stage demo && tail -n 12 "$OUT/demo.log"
} 2>&1 | tee "$OUT/summary.txt"
finish
