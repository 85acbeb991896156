#!/usr/bin/env bash
# The product CLI on a GPU host whose vLLM bundle is unpacked in /tmp/site (../shared/notes/gpu-host.md).
#   product  terra generate with the default model; terra bench --scenarios with an fp8 KV cache on
#            Terra-size random weights; a bad --kv-cache-dtype refused in one line
#   draft    terra-mini, greedy: the same tokens with and without --draft previous-frame, and no
#            vLLM warning about terra's model classes
# Wheels from .gpu/wheels (compressed-tensors, loguru, imageio-ffmpeg) are unpacked into /tmp/site.
# Logs tee'd into $OUT.
set -uo pipefail
what=${1:-product}
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Only what the host lacks (other wheels there, such as gpu_tests.sh's, must not shadow its packages).
for w in .gpu/wheels/{compressed_tensors,loguru,imageio_ffmpeg}-*.whl; do
  [ -e "$w" ] && python3 -m zipfile -e "$w" /tmp/site
done
chmod +x /tmp/site/imageio_ffmpeg/binaries/* 2>/dev/null  # zip extraction drops the executable bit
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi -L | tee "$OUT/gpu.txt"
step() {
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "== $name: terra $*" | tee -a "$OUT/smoke.log"
  timeout "$limit" python3 -m terra_cli "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Capturing CUDA graphs\|Loading safetensors" "$OUT/$name.log" | tail -20 | tee -a "$OUT/smoke.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/smoke.log"
}
case $what in
  product)
    step generate 200 generate "$OUT/mini.mp4" --frames 10 --actions left --seed 1 --save-tokens "$OUT/mini.npy"
    step bad-kv 60 bench --scenarios 2 --kv-cache-dtype fp9
    step scenarios-fp8 300 bench --scenarios 64 --frames 8 --max-rollouts 64 --kv-cache-dtype fp8 --out "$OUT/scenarios-fp8.json" ;;
  draft)
    common=(--frames 8 --actions left --temperature 0 --seed 1)
    step greedy 200 generate "$OUT/greedy.mp4" "${common[@]}" --save-tokens "$OUT/greedy.npy"
    step greedy-draft 200 generate "$OUT/greedy-draft.mp4" "${common[@]}" --save-tokens "$OUT/greedy-draft.npy" --draft previous-frame --draft-tokens 4
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/smoke.log"
import sys, pathlib, numpy as np
out = pathlib.Path(sys.argv[1])
a, b = np.load(out / "greedy.npy"), np.load(out / "greedy-draft.npy")
print(f"greedy tokens with and without the draft: {(a == b).mean():.4%} equal of {a.size} ({a.shape})")
warnings = [line for name in ("greedy", "greedy-draft") for line in (out / f"{name}.log").read_text().splitlines()
            if "WARNING" in line and "terra_cli" in line]
print(f"vLLM warnings naming terra's classes: {len(warnings)}", *warnings[:4], sep="\n")
PY
    ;;
esac
