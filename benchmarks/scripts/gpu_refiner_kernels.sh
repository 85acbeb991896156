#!/usr/bin/env bash
# Issue 40: the refiner UNet's parts beside faster equivalents, then whole windows with them, one GPU,
# after `gpu_bundle.sh a1`, `a2`, `b` and `gpu_side4.sh ref` (vLLM for FlashAttention-3, diffusers):
#   start  in the background: the parts one shape at a time (gpu_refiner_ops.py), then
#          gpu_refiner_profile.py --windows 4 for each of VARIANTS (default "base plane fa3 fused all"),
#          compiled side by side and timed one at a time (a lock), REPEAT (3) timed calls each;
#          `cudnn`: the product's UNet with torch.backends.cudnn.benchmark on; `base2`: the product again;
#          `fp8`: --refiner-dtype fp8 (the transformer blocks' Linears in float8, per-token activation scales);
#          `fp8cb`: the same for the Linears whose bf16 GEMM is compute-bound only (TERRA_REFINER_FP8_LAYERS);
#          NO_OPS=1 leaves out the parts
#   await  wait up to AWAIT_S (default 540), then pack /tmp/bg/kernels into $OUT/kernels.tar.gz
set -uo pipefail
OUT=${OUT:-/tmp/out}
source benchmarks/scripts/gpu_common.sh
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1
variant_env() {  # NAME -> the switches it sets (the product's defaults otherwise)
  case $1 in
    base) echo "" ;;
    plane) echo "TERRA_REFINER_TIME_CONV=plane" ;;
    fa3) echo "TERRA_REFINER_ATTENTION=fa3" ;;
    fused) echo "TERRA_REFINER_GEGLU=fused" ;;
    all) echo "TERRA_REFINER_TIME_CONV=plane TERRA_REFINER_ATTENTION=fa3 TERRA_REFINER_GEGLU=fused" ;;
    cudnn|base2|fp8) echo "" ;;
    fp8cb) echo "TERRA_REFINER_FP8_LAYERS=compute-bound" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}
case "${1:-}" in
  start)
    source_stamp "$OUT/code.txt"
    nvidia-smi -L | tee "$OUT/gpu.txt"
    in_background kernels bash benchmarks/scripts/gpu_refiner_kernels.sh runs ;;
  runs)
    source_stamp "$OUT/code.txt"
    lock=/tmp/refiner-kernels.lock
    # the parts first, holding the lock, while the variants compile beside them
    [ -n "${NO_OPS:-}" ] || flock "$lock" timeout 300 python3 benchmarks/scripts/gpu_refiner_ops.py --out "$OUT/ops.json" > "$OUT/ops.log" 2>&1 &
    sleep 2
    for v in ${VARIANTS:-base plane fa3 fused all}; do
      extra=""; [ "$v" = cudnn ] && extra=--cudnn-benchmark; [ "${v#fp8}" != "$v" ] && extra="--refiner-dtype fp8"
      env $(variant_env "$v") timeout "${RUN_S:-900}" python3 benchmarks/scripts/gpu_refiner_profile.py --windows 4 \
        --compile default --repeat "${REPEAT:-3}" $extra --lock "$lock" --out "$OUT/window-$v.json" > "$OUT/window-$v.log" 2>&1 &
    done
    wait
    for v in ${VARIANTS:-base plane fa3 fused all}; do echo "$v: $(tail -1 "$OUT/window-$v.log")"; done | tee -a "$STEP_LOG" ;;
  await)
    await_background kernels "${AWAIT_S:-540}" ;;
  *) echo "usage: gpu_refiner_kernels.sh start|runs|await" >&2; exit 2 ;;
esac
