#!/usr/bin/env bash
# Issue 29 on a two-GPU host (nvidia-h100-x2), through the product CLI; one step per device call,
# back to back on one warm machine. Before them: gpu_bundle.sh a1, a2, b, ff and gpu_ray.sh stage
# (carrying .gpu/ray1); `one` carries .gpu/ray2 and unpacks Ray. Logs and JSON go to $OUT; the
# 2-engine JSON is also kept in /tmp for `kill`.
#   one    terra bench --scenarios 256 on ONE Ray engine actor (CUDA_VISIBLE_DEVICES=0)
#   two    terra bench --scenarios 512 on two engine actors (--data-parallel 2)
#   kill   the same 512 on two engines, engine 1 SIGKILLed halfway (gpu_ray_kill.py); its time lost
#          is against `two`'s JSON in /tmp, so run `two` first on the same machine
#   act    terra bench --act-bench $ACT_SAMPLES (default 256: 128 per engine; 512 fills both batches
#          but needs about 480 s) on two engines, videos included
# fp8 KV cache, 256 rollouts in flight per engine, --attention auto (terra's kernel on Hopper).
set -uo pipefail
what=${1:?usage: gpu_ray_scaling.sh one|two|kill|act}
OUT=${OUT:-/tmp/out}
STEP_LOG=$OUT/summary.txt
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: never multicast
export RAY_DISABLE_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0
source benchmarks/scripts/gpu_common.sh
if [ ! -d /tmp/site/ray ]; then
  cat /tmp/dl/ray.tar.xz.aa .gpu/ray2/ray.tar.xz.ab | tar -C /tmp/site -xJf - || { echo "ray bundle missing"; exit 1; }
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import ray; print('ray', ray.__version__)" | tee -a "$STEP_LOG"
common=(--kv-cache-dtype fp8 --max-rollouts 256)
case $what in
  one) export CUDA_VISIBLE_DEVICES=0; step ray-one 420 bench --scenarios 256 --ray local "${common[@]}" --out "$OUT/ray-one.json" ;;
  two) step ray-two 450 bench --scenarios 512 --data-parallel 2 "${common[@]}" --out "$OUT/ray-two.json"
       cp "$OUT/ray-two.json" /tmp/ray-two.json ;;
  kill) timeout 560 python3 benchmarks/scripts/gpu_ray_kill.py --scenarios 512 --engines 2 --max-rollouts 256 \
          --kv-cache-dtype fp8 --baseline /tmp/ray-two.json --out "$OUT/ray-kill.json" > "$OUT/ray-kill.log" 2>&1
        echo "kill: exit $?" | tee -a "$STEP_LOG"; tail -40 "$OUT/ray-kill.log" | tee -a "$STEP_LOG" ;;
  act) watch_gpu_memory act-two
       step act-two 560 bench --act-bench "${ACT_SAMPLES:-256}" --data-parallel 2 --kv-cache-dtype fp8 \
         --out "$OUT/act-two.json"
       stop_gpu_memory ;;
  *) echo "usage: gpu_ray_scaling.sh one|two|kill|act"; exit 2 ;;
esac
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv | tee -a "$STEP_LOG"
