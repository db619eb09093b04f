#!/usr/bin/env bash
# Tensor parallelism of the SGLang integration's code on two GPUs (NCCL), in one device call: the W12 N/K sharding
# (specpilot/sglang/sharding.py) and the certified head's cross-rank argmax (specpilot/sglang/head.py), run
# directly with torch.distributed. SGLang itself is not needed (nor carried: its CUDA dependencies, sglang-kernel
# alone, are hundreds of MB, over what travels to the machine).
#
#   bash perf/sglang_tp2.sh            (on a machine with two GPUs; OUT defaults to perf/out)
#
# Stages (STAGES, default "env tp tests"):
#   env    GPUs, torch, NCCL versions (nvidia-smi -L, torch.cuda.nccl.version())
#   tp     python3 -m tests_sglang.tp_workers --backend nccl: both checks, JSON on stdout (TP_TIMEOUT 240 s)
#   tests  pytest tests_sglang/gpu -m gpu (the same checks as tests; TEST_TIMEOUT 240 s)
# Files in $OUT: summary.txt env.log tp.json tp.log pytest.log
cd "$(dirname "$0")/.."
STAGES=${STAGES:-env tp tests}
TEST_WORKERS=0
. perf/gpu_env.sh
SCRATCH=$(mktemp -d)
declare -A RC

if has_stage env; then
  { nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus',
torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"; } \
    >"$OUT/env.log" 2>&1
  RC[env]=$?
fi
if has_stage tp; then
  timeout "${TP_TIMEOUT:-240}" python3 -m tests_sglang.tp_workers --backend nccl --world 2 >"$OUT/tp.json" \
    2>"$OUT/tp.log"
  RC[tp]=$?
fi
if has_stage tests; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest --confcutdir=tests_sglang/gpu tests_sglang/gpu -m gpu -v -s \
    "${PYTEST_OPTS[@]}" >"$OUT/pytest.log" 2>&1
  RC[tests]=$?
fi

{
  echo "wheels  : $WHEELS"
  for s in $STAGES; do echo "$s rc=${RC[$s]:-?}"; done
  has_stage env && cat "$OUT/env.log"
  has_stage tp && { cat "$OUT/tp.json"; grep -v -i warn "$OUT/tp.log" | tail -n 20; }
  has_stage tests && { echo "tests: $(tests_line "$OUT/pytest.log")"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -n 10; }
} 2>&1 | tee "$OUT/summary.txt"
finish
