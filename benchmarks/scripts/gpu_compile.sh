#!/usr/bin/env bash
# vLLM with and without torch.compile, CUDA graphs kept (lab probe, not the product). Run on the GPU
# host once vLLM's bundle is unpacked into /tmp/site (../shared/notes/gpu-host.md); logs and JSON go
# to $OUT. Each configuration has its own vLLM, Triton and Inductor caches, so its first start is
# cold as on a fresh machine.
#   bash benchmarks/scripts/gpu_compile.sh startup     # per config: 1 rollout cold and warm, then 64 rollouts x 25 frames
#   bash benchmarks/scripts/gpu_compile.sh product     # per config: scenario bench (fp8 KV), terra-mini greedy tokens
#   bash benchmarks/scripts/gpu_compile.sh defaults    # no flag: the bench's start-up, terra-mini greedy with and without --draft
#   bash benchmarks/scripts/gpu_compile.sh scenarios25 128   # the default, fp8 KV: 256 scenarios x 25 frames, N in flight
#   bash benchmarks/scripts/gpu_compile.sh inflight [fp8|auto]   # the default: 256 x 13 frames, 128 then 256 in flight
# Configs: compiled = --torch-compile (vLLM's own default: VLLM_COMPILE, FULL_AND_PIECEWISE graphs);
#          eager-graphs = --no-torch-compile (mode 0, FULL CUDA graphs for decode and mixed batches;
#          terra's default on a GPU since 2026-11-25).
# The recorded startup run (benchmarks/h100-compile-2026-11-25) predates the flags: it passed the same
# engine arguments as `--vllm-arg 'compilation_config={"mode": 0, "cudagraph_mode": "FULL"}'`.
set -uo pipefail
what=${1:-startup}
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1
source benchmarks/scripts/gpu_common.sh
gpu_setup .gpu/wheels-small/*.whl || exit 1
caches() {  # one configuration's caches, cold on its first use
  export VLLM_CACHE_ROOT=/tmp/c-$1/vllm TRITON_CACHE_DIR=/tmp/c-$1/triton TORCHINDUCTOR_CACHE_DIR=/tmp/c-$1/inductor
}
case $what in
startup)
  # The random Terra-size checkpoint is written once, before any timed start.
  python3 -c "from terra_cli.bench.cache import random_terra_checkpoint as r; print(r('cuda', 0))"
  for cfg in eager-graphs compiled; do
    caches "$cfg"
    extra=(--torch-compile); [ "$cfg" = eager-graphs ] && extra=(--no-torch-compile)
    for start in cold warm; do
      step "$cfg-1-$start" 200 bench --hf-vs-vllm --skip-hf --batch 1 --frames 13 "${extra[@]}" --out "$OUT/$cfg-1-$start.json"
    done
    step "$cfg-64" 260 bench --hf-vs-vllm --skip-hf --batch 64 --frames 25 "${extra[@]}" --out "$OUT/$cfg-64.json"
  done
  ;;
product)
  for cfg in eager-graphs compiled; do
    caches "$cfg"
    flag=(--torch-compile); [ "$cfg" = eager-graphs ] && flag=(--no-torch-compile)
    step "$cfg-scenarios-fp8" 200 bench --scenarios 64 --frames 8 --max-rollouts 64 --kv-cache-dtype fp8 "${flag[@]}" --out "$OUT/$cfg-scenarios-fp8.json"
    step "$cfg-mini-greedy" 150 generate --frames 8 --actions left --temperature 0 --seed 1 --no-decode "${flag[@]}" --save-tokens "$OUT/$cfg-mini-greedy.npy"
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import sys, pathlib, numpy as np
out = pathlib.Path(sys.argv[1])
a, b = np.load(out / "compiled-mini-greedy.npy"), np.load(out / "eager-graphs-mini-greedy.npy")
gen = slice(3, None)
print(f"terra-mini greedy, compiled vs eager-graphs: {(a[gen] == b[gen]).mean():.4%} of {a[gen].size} generated codes equal; "
      f"per generated frame {[round(float((x == y).mean()), 4) for x, y in zip(a[gen], b[gen])]}")
PY
  ;;
defaults)
  caches defaults
  step default-bench 200 bench --hf-vs-vllm --skip-hf --batch 1 --frames 7 --out "$OUT/default-bench.json"
  common=(generate --frames 8 --actions left --temperature 0 --seed 1 --no-decode)
  step default-mini 150 "${common[@]}" --save-tokens "$OUT/default-mini.npy"
  step default-mini-draft 150 "${common[@]}" --draft previous-frame --draft-tokens 4 --save-tokens "$OUT/default-mini-draft.npy"
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys, pathlib, numpy as np
out = pathlib.Path(sys.argv[1])
startup = json.loads((out / "default-bench.json").read_text())["vllm_startup"]
print("bench start-up:", {k: v for k, v in startup.items() if k != "timeline"})
a, b = np.load(out / "default-mini.npy")[3:], np.load(out / "default-mini-draft.npy")[3:]
print(f"terra-mini greedy with and without --draft: {(a == b).mean():.4%} of {a.size} generated codes equal")
PY
  ;;
scenarios25)
  caches defaults
  n=${2:-128}
  step "scenarios25-fp8-$n" 420 bench --scenarios 256 --frames 25 --max-rollouts "$n" --kv-cache-dtype fp8 --out "$OUT/scenarios25-fp8-$n.json"
  ;;
inflight)
  caches defaults
  for n in 128 256; do
    kv=${2:-fp8}
    step "scenarios13-$kv-$n" 280 bench --scenarios 256 --frames 13 --max-rollouts "$n" --kv-cache-dtype "$kv" --out "$OUT/scenarios13-$kv-$n.json"
  done
  ;;
*) echo "usage: $0 startup|product|defaults|scenarios25 [N]|inflight [fp8|auto]"; exit 2 ;;
esac
# One archive, so that every log comes back (the device returns at most 8 files).
(cd "$OUT" && tar czf "/tmp/results-$what${2:-}.tgz" . && mv "/tmp/results-$what${2:-}.tgz" . && find . -type f ! -name "results-*.tgz" ! -name summary.txt -delete)
