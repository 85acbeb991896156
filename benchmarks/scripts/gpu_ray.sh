#!/usr/bin/env bash
# One Ray engine actor on the single-GPU host, through the product CLI (issue 26), < 4 minutes:
#   stage  (a call carrying .gpu/ray1): keep its Ray part in /tmp/dl for the next call
#   run    (a call carrying .gpu/ray2, after the vLLM bundle is in /tmp/site): unpack Ray into
#          /tmp/site, then `terra generate --scenarios ... --ray local` with the embedded terra-mini:
#          the reference backend (2 scenarios), then vLLM (32 scenarios, --max-rollouts 16, videos
#          decoded on the actor and written by the driver), then the same command again (resume:
#          nothing to run). Logs, results.jsonl lines and the per-engine summary go to $OUT.
# Ray: /tmp/raysite from `gpu_bundle.sh ray`, or the two parts of benchmarks/scripts/gpu_ray_bundle.sh
# (`stage`, then `run` carrying .gpu/ray2). vLLM: /tmp/site as gpu_bundle.sh a1, a2, b, ff leave it.
set -uo pipefail
what=${1:-run}
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/dl /tmp/site "$OUT"
case $what in
  stage)
    cp .gpu/ray1/ray.tar.xz.aa /tmp/dl/ && ls -la /tmp/dl | tee "$OUT/stage.txt"
    exit 0 ;;
  run) ;;
  *) echo "usage: gpu_ray.sh stage|run"; exit 2 ;;
esac
STEP_LOG=$OUT/ray.log
source benchmarks/scripts/gpu_common.sh
if [ -d /tmp/raysite/ray ]; then  # brought by `gpu_bundle.sh ray` (.gpu/ray/ray-site.tar.xz)
  export PYTHONPATH=$PYTHONPATH:/tmp/raysite
elif [ ! -d /tmp/site/ray ]; then  # or by `gpu_ray.sh stage` and this call (gpu_ray_bundle.sh's two parts)
  cat /tmp/dl/ray.tar.xz.aa .gpu/ray2/ray.tar.xz.ab | tar -C /tmp/site -xJf - || { echo "ray bundle missing"; exit 1; }
fi
gpu_setup .gpu/wheels/{compressed_tensors,loguru,imageio_ffmpeg}-*.whl || exit 1
python3 -c "import ray; print('ray', ray.__version__)" 2>&1 | tee -a "$STEP_LOG"
export RAY_DISABLE_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0
python3 - <<'PY'
import json
presets = ["left", "right", "straight", "stop", "accelerate"]
with open("/tmp/ray_scenarios.jsonl", "w") as f:
    for i in range(32):
        f.write(json.dumps({"id": f"r{i:02d}", "actions": presets[i % 5], "frames": 10, "seed": i}) + "\n")
with open("/tmp/ray_hf.jsonl", "w") as f:
    for i in range(2):
        f.write(json.dumps({"id": f"h{i}", "actions": presets[i], "frames": 5, "seed": i}) + "\n")
PY
step ray-hf 80 generate --scenarios /tmp/ray_hf.jsonl --out-dir /tmp/ray_hf --ray local --backend hf
step ray-vllm 150 generate --scenarios /tmp/ray_scenarios.jsonl --out-dir /tmp/ray_vllm --ray local --backend vllm --max-rollouts 16
step ray-resume 60 generate --scenarios /tmp/ray_scenarios.jsonl --out-dir /tmp/ray_vllm --ray local --backend vllm --max-rollouts 16
for d in ray_hf ray_vllm; do
  cp "/tmp/$d/results.jsonl" "$OUT/$d-results.jsonl" 2>/dev/null
  echo "$d: $(ls /tmp/$d/*.mp4 2>/dev/null | wc -l) mp4, $(ls /tmp/$d/*.npy 2>/dev/null | wc -l) npy, $(grep -c '"done"' /tmp/$d/results.jsonl 2>/dev/null) done lines" | tee -a "$STEP_LOG"
done
