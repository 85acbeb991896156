#!/usr/bin/env bash
# Issues 40 and 41 side by side on a 4-GPU host (nvidia-h100-x4), one experiment chain per GPU, after
# `gpu_bundle.sh a1`, `a2`, `b` and `gpu_side4.sh ref` (carry .gpu/ref: diffusers and its wheels):
#   ref    unzip .gpu/ref's wheels into /tmp/site
#   start  install terra, start `chains` in the background (collect with `await`)
#   chains GPU 0 (41): gpu_single_stream.py at Terra size: plain, Jacobi K=8, K=8 with the logits
#          weight-major (W @ h.T), plain with eager layers (variants 0,1,7,4)
#          GPU 1 (40): the refiner compiled (Inductor default), W1 windows per call (default "1 2")
#          GPU 2 (40): CUDA graphs (reduce-overhead), W2 windows per call (default "2 4")
#          GPU 3 (40): V3 variants at 2 windows per call (default "fp8 autotune")
#          each chain stops after CHAIN_S seconds (default 900)
#   await  wait up to AWAIT_S (default 540), then pack /tmp/bg/side4 into $OUT/side4.tar.gz
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEP_LOG=$OUT/summary.txt
source benchmarks/scripts/gpu_common.sh
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1 TERRA_INSTALLED=1
case "${1:-}" in
  ref) for w in .gpu/ref/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; du -sh /tmp/site ;;
  start)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    nvidia-smi -L | tee -a "$STEP_LOG"
    in_background side4 bash benchmarks/scripts/gpu_side4.sh chains ;;
  chains)
    source_stamp "$OUT/commit.txt"
    CHAIN_S=${CHAIN_S:-900}  # each GPU's chain stops after this many seconds
    refiner() {  # GPU VARIANTS WINDOWS: gpu_refiner_product.sh bench into $OUT/gpuN
      mkdir -p "$OUT/gpu$1"
      CUDA_VISIBLE_DEVICES=$1 OUT=$OUT/gpu$1 VARIANTS=$2 WINDOWS=$3 LIMIT_S=$CHAIN_S BUDGET_S=$CHAIN_S \
        timeout "$CHAIN_S" bash benchmarks/scripts/gpu_refiner_product.sh bench > "$OUT/gpu$1.log" 2>&1
    }
    CUDA_VISIBLE_DEVICES=0 timeout "$CHAIN_S" python3 benchmarks/scripts/gpu_single_stream.py --models terra \
      --budget-s $((CHAIN_S - 60)) --variants 0,1,7,4 --out "$OUT/single_stream.json" > "$OUT/single_stream.log" 2>&1 &
    refiner 1 compiled "${W1:-1 2}" &
    refiner 2 graphs "${W2:-2 4}" &
    refiner 3 "${V3:-fp8 autotune}" 2 &
    wait
    echo "chains done" >> "$STEP_LOG" ;;
  await)
    await_background side4 "${AWAIT_S:-540}" ;;
  *) echo "usage: gpu_side4.sh ref|start|chains|await" >&2; exit 2 ;;
esac
