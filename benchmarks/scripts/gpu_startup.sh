#!/usr/bin/env bash
# Start-up phases and end-to-end time of `terra generate` on one GPU (issue 18). Lab probe, not the
# product. Run on the GPU host once vLLM's bundle is unpacked into /tmp/site
# (../shared/notes/gpu-host.md); logs and JSON go to $OUT.
#   [FRAMES=13] bash benchmarks/scripts/gpu_startup.sh startup   # cold, warm, warm engine starts, same model dir
# On a fresh machine the first run is cold: no vLLM, Triton or inductor caches.
#   bash benchmarks/scripts/gpu_startup.sh e2e       # terra generate, vLLM twice and the reference once
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
export TERRA_CACHE=/tmp/terra-cache VLLM_CACHE_ROOT=/tmp/vllm-cache HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install failed"; exit 1; }
terra() { python3 -m terra_cli "$@"; }
stamp() { date +%s.%N; }

case "${1:-}" in
startup)
  rm -rf "$VLLM_CACHE_ROOT"
  for run in cold warm1 warm2; do
    t0=$(stamp)
    timeout 280 terra bench --hf-vs-vllm --skip-hf --batch 1 --frames "${FRAMES:-25}" --out "$OUT/startup-$run.json" 2>&1 | tee "$OUT/startup-$run.log" | grep -v "frame [0-9]*/"
    echo "RUN $run wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$OUT/summary.txt"
  done
  ;;
e2e)
  model=$TERRA_CACHE/random-terra-seed0 tok=$TERRA_CACHE/random-tokenizer
  [ -d "$tok" ] || python3 -c "from tokenizer_decoder import ImageTokenizer, TERRA_TOKENIZER_CONFIG as C; ImageTokenizer.from_config(C, device='cuda').save_pretrained('$tok')"
  # The host has no ffmpeg, so no mp4: tokens only, then the 25 frames decoded on the GPU apart.
  for run in 1 2; do
    rm -f /tmp/e2e-$run.npy; t0=$(stamp)
    timeout 200 terra --verbose generate --model "$model" --tokenizer "$tok" --frames 25 --actions left --backend vllm \
      --no-decode --save-tokens /tmp/e2e-$run.npy 2>&1 | tee "$OUT/e2e-vllm-$run.log" | grep -v "^INFO\|^(EngineCore"
    echo "E2E vllm run $run: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s command to file (25 frames, no decode)" | tee -a "$OUT/summary.txt"
  done
  t0=$(stamp)
  python3 - "$tok" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import sys, time, numpy as np, torch
from tokenizer_decoder import ImageTokenizer
t0 = time.perf_counter(); tok = ImageTokenizer.from_pretrained(sys.argv[1], device="cuda"); t1 = time.perf_counter()
frames = tok.decode_tokens(np.load("/tmp/e2e-1.npy")); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"DECODE tokenizer load {t1 - t0:.1f} s, 25 frames decoded in {t2 - t1:.1f} s ({len(frames)} frames)")
PY
  t0=$(stamp)
  timeout 200 terra generate --model "$model" --tokenizer "$tok" --frames 5 --actions left --backend hf \
    --no-decode --save-tokens /tmp/e2e-hf.npy 2>&1 | tee "$OUT/e2e-hf.log"
  echo "E2E hf: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s command to file (5 frames = 2 generated, no decode)" | tee -a "$OUT/summary.txt"
  ;;
*) echo "usage: $0 startup|e2e"; exit 2 ;;
esac
