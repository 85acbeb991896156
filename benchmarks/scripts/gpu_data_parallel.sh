#!/usr/bin/env bash
# Issue 16 (and 17's fp8 weights) on a GPU host whose vLLM bundle is unpacked in /tmp/site
# (../shared/notes/gpu-host.md). One step per device call, logs tee'd into $OUT:
#   warm-dp2     warm the compile cache (8 short scenarios), then 512 x 25 frames on 2 engines
#   dp1-compare  512 x 25 frames on 1 engine, then every scenario's tokens against the 2-engine run
#   fp8          1 rollout, bf16 vs fp8 weights (s/frame), and fp8 weights' teacher-forced agreement
set -uo pipefail
step=$1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
terra() { python3 -m terra_cli "$@"; }
case $step in
  warm-dp2)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    timeout 200 terra bench --scenarios 8 --frames 5 --max-rollouts 128 --out "$OUT/warm.json" 2>&1 | tee "$OUT/warm.log"
    timeout 380 terra bench --scenarios 512 --max-rollouts 128 --data-parallel 2 --keep-outputs /tmp/dp2 \
      --out "$OUT/dp2.json" 2>&1 | tee "$OUT/dp2.log" ;;
  dp1-compare)
    timeout 540 terra bench --scenarios 512 --max-rollouts 128 --data-parallel 1 --keep-outputs /tmp/dp1 \
      --out "$OUT/dp1.json" 2>&1 | tee "$OUT/dp1.log"
    python3 benchmarks/scripts/compare_scenario_tokens.py /tmp/dp1/outputs /tmp/dp2/outputs | tee "$OUT/compare.json" ;;
  fp8)
    for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
    timeout 150 terra bench --hf-vs-vllm --skip-hf --batch 1 --frames 10 --out "$OUT/one-bf16.json" 2>&1 | tee "$OUT/one-bf16.log"
    timeout 200 terra bench --hf-vs-vllm --skip-hf --batch 1 --frames 10 --vllm-arg quantization=fp8 \
      --out "$OUT/one-fp8.json" 2>&1 | tee "$OUT/one-fp8.log"
    timeout 220 python3 benchmarks/scripts/gpu_scenarios.py --scenarios 64 --max-rollouts 64 --quantization fp8 \
      --agreement --label fp8-weights 2>&1 | tee "$OUT/fp8-agreement.log" ;;
esac
