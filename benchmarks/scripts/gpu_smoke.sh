#!/usr/bin/env bash
# The product path on a GPU host whose vLLM bundle is unpacked in /tmp/site (../shared/notes/gpu-host.md):
# terra generate with the default model, terra bench --scenarios with an fp8 KV cache on Terra-size
# random weights, and a bad --kv-cache-dtype refused in one line. Logs tee'd into $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi -L | tee "$OUT/gpu.txt"
step() {
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "== $name: terra $*" | tee -a "$OUT/smoke.log"
  timeout "$limit" python3 -m terra_cli "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -20 "$OUT/$name.log" | tee -a "$OUT/smoke.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/smoke.log"
}
step generate 200 generate "$OUT/mini.mp4" --frames 10 --actions left --seed 1 --save-tokens "$OUT/mini.npy"
step bad-kv 60 bench --scenarios 2 --kv-cache-dtype fp9
step scenarios-fp8 300 bench --scenarios 64 --frames 8 --max-rollouts 64 --kv-cache-dtype fp8 --out "$OUT/scenarios-fp8.json"
