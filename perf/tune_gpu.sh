#!/usr/bin/env bash
# Every operator tuned for hybrid-27b on the GPU machine through `specpilot tune`, in one device call of
# at most ~7 minutes, then the lookup-cost benchmark and the report's figure.
#
#   bash perf/tune_gpu.sh                  (OUT defaults to perf/out; carry [".whl"]: optuna and its wheels)
#   OPS="gdn lmhead" bash perf/tune_gpu.sh (a subset, in this order)
#
# Stages (OPS, default "lookup gdn w12 w12cuda attn lmhead"), each its own process under its own timeout, so a
# failing or hanging operator costs its own stage only; every stage's limit is also cut to what is left
# of WALL (default 490 s) minus RESERVE (30 s) for the report:
#   lookup  python -m specpilot.bench.lookup: get_config / PlanCache ns per call, an eager call with its
#           config looked up vs pre-resolved, and both as CUDA-graph replays.
#   gdn     gdn.tree_verify, variants cuda (the default on sm_90) and wy, at B1-N32 and B24-N8 (GDN_VARIANT,
#           GDN_ONLY: others, e.g. GDN_VARIANT=cuda GDN_ONLY=B1-N1, the engine's one-token step).
#   w12     w12.matmul, variant tc (the Triton kernel) at M=64 on the six hybrid-27b linears (the verify pass's
#           rows, where "tc" is the default on sm_90). W12_VARIANT=mma (or tma) W12_ONLY='*-M32' tunes the CUDA
#           kernels (w12.space.MMA_SPACE / TMA_SPACE, the default at M <= 32) instead.
#   w12cuda w12.matmul, variants mma and tma (the CUDA C++ kernels, the default at M <= 32), at M=1 on the three
#           largest decode-step linears (W12C_ONLY, W12C_S 80 s).
#   attn    tree_attn.tree_attention, variant wgmma, one 32-node tree over 32k keys (key D256-G6).
#   attnws  the same op and tree, variant ws (the warp-specialised CUDA C++ kernel, sm_90; key C2-D256-G6);
#           not in the default OPS (OPS=attnws bash perf/tune_gpu.sh).
#   lmhead  lmhead.argmax, variant triton, M=32 (key K5120-V248320).
# Each study: TRIALS trials (default 24) within the stage's --time-budget (GDN_S 65, W12_S 70, ATTN_S 35,
# HEAD_S 40 seconds); the heuristic or stored config first, then 8 valid configs compiled on 16 threads,
# then TPE. A/B: 60 interleaved CUDA-graph rounds of the current config against the study's best; a winner
# is written (--ship) into autotune/configs/<gpu>.json only when the promotion rule promotes it.
# Files in $OUT (8): summary.txt tune.log tune-decisions.json tune-before-after.md tune-studies.db
# <gpu>.json (the shipped store after the run: copy it back to ship it) tuned-configs.png lookup.json
cd "$(dirname "$0")/.."
. perf/gpu_env.sh
OPS=${OPS:-lookup gdn w12 w12cuda attn lmhead}
WALL=${WALL:-490}
RESERVE=${RESERVE:-30}
TRIALS=${TRIALS:-24}
SCRATCH=$(mktemp -d)
export SPECPILOT_CACHE_DIR=$SCRATCH/cache   # no stale user entries: the baseline is the shipped store or the heuristic
LOG=$OUT/tune.log
: >"$LOG"
declare -A RC
START=$SECONDS

say() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
# limit CAP: CAP seconds, or what is left of WALL after the reserve (at least 10)
limit() { local left=$((WALL - RESERVE - (SECONDS - START))); [ "$left" -lt "$1" ] && echo $((left > 10 ? left : 10)) || echo "$1"; }

TUNE=(python3 -m specpilot tune --shapes hybrid-27b --trials "$TRIALS" --ship
      --storage "sqlite:///$OUT/tune-studies.db" --out "$OUT")
# stage NAME CAP CMD...: run CMD under min(CAP, time left), its output appended to the log
stage() {
  local name=$1 cap=$2
  shift 2
  local lim
  lim=$(limit "$cap")
  say "== $name (limit ${lim}s): $*"
  timeout -k 5 "$lim" "$@" >>"$LOG" 2>&1
  RC[$name]=$?
  say "== $name rc=${RC[$name]}"
}

say "wheels: $WHEELS"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import importlib
for m in ("torch", "triton", "optuna", "sqlalchemy", "tqdm", "matplotlib"):
    try:
        print(f"{m:<11}", getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(f"{m:<11} MISSING ({type(e).__name__}: {e})" + ("  <- specpilot tune needs it: carry its wheel in .whl/"
              if m in ("optuna", "sqlalchemy") else ""))
import torch
print("device     ", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "| cores", __import__("os").cpu_count())
PY

for s in $OPS; do
  case $s in
    lookup) stage lookup 45 python3 -m specpilot.bench.lookup --out "$OUT" ;;
    gdn) stage gdn 120 "${TUNE[@]}" --op gdn.tree_verify --variant "${GDN_VARIANT:-cuda,wy}" \
           --only "${GDN_ONLY:-B1-N32,B24-N8}" --time-budget "${GDN_S:-65}" ;;
    w12) stage w12 125 "${TUNE[@]}" --op w12.matmul --variant "${W12_VARIANT:-tc}" \
           --only "${W12_ONLY:-gdn.in_proj-M64,gdn.out_proj-M64,attn.qkv_proj-M64,attn.o_proj-M64,mlp.gate_up_proj-M64,mlp.down_proj-M64}" \
           --time-budget "${W12_S:-70}" ;;
    attn) stage attn 80 "${TUNE[@]}" --op tree_attn.tree_attention --variant wgmma --time-budget "${ATTN_S:-35}" ;;
    attnws) stage attnws 160 "${TUNE[@]}" --op tree_attn.tree_attention --variant ws --time-budget "${ATTNWS_S:-120}" ;;
    w12cuda) stage w12cuda 110 "${TUNE[@]}" --op w12.matmul --variant mma,tma \
           --only "${W12C_ONLY:-gdn.in_proj-M1,mlp.gate_up_proj-M1,mlp.down_proj-M1}" --time-budget "${W12C_S:-80}" ;;
    lmhead) stage lmhead 90 "${TUNE[@]}" --op lmhead.argmax --time-budget "${HEAD_S:-40}" ;;
    *) say "unknown stage $s (known: lookup gdn w12 w12cuda attn attnws lmhead)"; RC[$s]=2 ;;
  esac
done

# the report: every stored entry, and the figure of time over floor
timeout 60 python3 -m specpilot tune --report --out "$OUT" >>"$LOG" 2>&1
RC[report]=$?
cp autotune/configs/*.json "$OUT/" 2>/dev/null

{
  echo "wheels : $WHEELS"
  for s in $OPS report; do echo "$s rc=${RC[$s]:-?}"; done
  echo "wall   : $((SECONDS - START)) s"
  echo
  [ -f "$OUT/tune-before-after.md" ] && cat "$OUT/tune-before-after.md"
  echo
  grep -E "FAILED|Traceback|Error" "$LOG" | grep -v "^\[" | head -n 20
  sed -n '/^config lookup cost/,/== lookup rc/p' "$LOG" | grep -v "== lookup rc"
} 2>&1 | tee "$OUT/summary.txt"
rm -rf "$SCRATCH"
for s in $OPS report; do [ "${RC[$s]:-1}" -eq 0 ] || exit 1; done
exit 0
