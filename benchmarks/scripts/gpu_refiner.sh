#!/usr/bin/env bash
# Terra's video refiner on the GPU host: `terra bench --refiner` (random weights in Terra's exact
# shapes, bf16, SDPA) in the variants worth comparing, each a separate process, into $OUT:
#   eager       windows per UNet call 1 and 2, one UNet call per step (Terra's uc == c)
#   full_cfg    the guidance pair batched into one call (what Terra's script computes)
#   plain_xattn cross-attention computed instead of its one-token closed form
#   compiled    torch.compile (default mode) of the UNet, 1 window per call
#   graphs      torch.compile reduce-overhead (CUDA graphs), 1 window per call, if time is left
# Usage (from the checkout, wheels that /tmp/site lacks as arguments, e.g. diffusers' and its
# importlib_metadata/zipp):  OUT=/tmp/out bash benchmarks/scripts/gpu_refiner.sh [WHEEL...]
# Expected: about 4-5 minutes; every step has its own time limit and no step starts after 300 s
# (6 minutes at worst; graphs reuses the compiled step's Inductor cache).
# Files in $OUT: summary.txt, gpu.txt, refiner.log, refiner_<variant>.json.
set -u
cd "$(dirname "$0")/../.."
source benchmarks/scripts/gpu_common.sh
gpu_setup "$@" || exit 1
python3 -c "import diffusers; print('diffusers', diffusers.__version__)" | tee -a "$STEP_LOG" || exit 1
LOG=$OUT/refiner.log

variant() {  # NAME LIMIT_S BENCH_ARGS...; VARIANTS="eager compiled" runs only those
  local name=$1 limit=$2 t0=$SECONDS rc start
  shift 2
  case " ${VARIANTS:-$name} " in *" $name "*) ;; *) return ;; esac
  start=$(wc -l < "$LOG" 2>/dev/null || echo 0)
  if [ "$SECONDS" -gt 300 ]; then echo "== $name: skipped (time)" | tee -a "$STEP_LOG"; return; fi
  echo "== $name: terra bench --refiner $*" | tee -a "$STEP_LOG" "$LOG" >/dev/null
  timeout "$limit" python3 -m terra_cli bench --refiner "$@" --out "$OUT/refiner_$name.json" --overwrite >> "$LOG" 2>&1
  rc=$?
  tail -n +"$((start + 1))" "$LOG" | grep -E "counted|window\(s\) per call|VAE per frame|ACT-Bench|rror" | tail -8 >> "$STEP_LOG"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$STEP_LOG"
}

variant eager 90 --windows 1,2
variant full_cfg 70 --windows 1 --full-cfg
variant plain_xattn 60 --windows 1 --plain-cross-attention
variant compiled 120 --windows 1 --refiner-compile default
variant graphs 60 --windows 1 --refiner-compile reduce-overhead
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/gpu.txt"
cat "$STEP_LOG"
