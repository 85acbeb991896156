#!/usr/bin/env bash
# Issue 17 on a GPU host whose vLLM bundle is unpacked in /tmp/site (../shared/notes/gpu-host.md).
# One step per device call, rows appended to $OUT/draft.jsonl, logs tee'd into $OUT:
#   mini    terra-mini, 1 rollout: no draft vs previous-frame drafts (K=4, 8) at T=0.9, and K=4 greedy
#   terra   Terra-size random weights, 1 rollout: no draft vs K=4 (bf16 and fp8 weights); 64 rollouts
set -uo pipefail
step=$1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
run() { timeout "$1" python3 benchmarks/scripts/gpu_draft.py "${@:2}" 2>&1 | tee -a "$OUT/$step.log" | grep '^{' ; }
case $step in
  mini)
    nvidia-smi -L | tee "$OUT/gpu.txt"
    run 200 mini-k0 --checkpoint mini
    run 150 mini-k4 --checkpoint mini --draft-tokens 4
    run 150 mini-k0-again --checkpoint mini
    run 150 mini-k8 --checkpoint mini --draft-tokens 8
    run 150 mini-k4-greedy --checkpoint mini --draft-tokens 4 --temperature 0
    run 150 mini-k0-greedy --checkpoint mini --temperature 0 ;;
  debug)
    run 150 mini-k4-no-async --checkpoint mini --draft-tokens 4 --vllm-arg async_scheduling=false
    run 150 mini-k4-piecewise --checkpoint mini --draft-tokens 4 --vllm-arg 'compilation_config={"cudagraph_mode": "PIECEWISE"}'
    CUDA_LAUNCH_BLOCKING=1 run 200 mini-k4-blocking --checkpoint mini --draft-tokens 4
    grep -n "Error\|error" "$OUT/$step.log" | grep -v Tokenizer | head -40 ;;
  terra)
    for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
    run 200 terra-k0 --checkpoint random --frames 9
    run 150 terra-k4 --checkpoint random --frames 9 --draft-tokens 4
    run 150 terra-fp8-k0 --checkpoint random --frames 9 --quantization fp8
    run 150 terra-fp8-k4 --checkpoint random --frames 9 --quantization fp8 --draft-tokens 4
    run 150 terra-x64-k0 --checkpoint random --frames 6 --rollouts 64
    run 150 terra-x64-k4 --checkpoint random --frames 6 --rollouts 64 --draft-tokens 4 ;;
esac
