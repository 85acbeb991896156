#!/usr/bin/env bash
# Issue 41's single-stream rows in two device calls instead of five. terra's single-stream backend uses
# FlashAttention-3 from vLLM's part b (vllm/vllm_flash_attn) and nothing of part a (vLLM's CUDA ops), and
# `terra serve --backend single-stream` starts no vLLM engine; so when starts are refused often, one call
# carrying .gpu/vllm-b (24 MB beside the ~35 MB tree) does what `gpu_bundle.sh a1`, `a2`, `b` did.
#   driver    (carry .gpu/vllm-b) unpack part b, install terra, check FlashAttention-3 loads, build the random
#             Terra checkpoint, then the driver alone at 32 sessions with fp8 weights and with bf16
#             (gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30; ~6 minutes); with .gpu/serve carried
#             too (uvicorn and h11's wheels, 125 kB), then `terra serve` at 32 sessions with fp8 weights in
#             what is left of CALL_S (540) seconds, if 150 are
#   pictures  (carry .gpu/ref, the same machine: uvicorn for the server) `terra serve` at 32 sessions, 4
#             frames a session: pictures in batches of 8 (TERRA_PICTURE_BATCH=8), one a call, then fp8
#             weights (~8 minutes)
set -uo pipefail
source benchmarks/scripts/gpu_common.sh
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1
serve() {  # LIMIT_S SUFFIX ENV...: gpu_serve.py at 32 sessions, 4 frames each
  local limit=$1 suffix=$2; shift 2
  env "$@" timeout -k "$KILL_AFTER_S" "$limit" python3 benchmarks/scripts/gpu_serve.py --only terra-size \
    --concurrency 32 --steps 4 --serve-args "--backend single-stream ${SERVE_ARGS_EXTRA:-}" \
    --out "$OUT/serve-rows$suffix" > "$OUT/serve-rows$suffix.log" 2>&1
  echo "serve rows$suffix exit $?" | tee -a "$STEP_LOG"
  tail -4 "$OUT/serve-rows$suffix.log" | tee -a "$STEP_LOG"
}
case "${1:-}" in
  driver)
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/vllm-b/part.tar.xz || { echo "part b did not unpack"; exit 1; }
    gpu_setup || exit 1
    source_stamp "$OUT/code.txt"
    python3 -c "from vllm.vllm_flash_attn import flash_attn_varlen_func; print('FlashAttention-3 loads')" \
      2>&1 | tail -3 | tee -a "$STEP_LOG"
    timeout 150 python3 -c "from terra_cli.bench.cache import random_terra_checkpoint as r; r('cuda', 0)" \
      > "$OUT/build.log" 2>&1; echo "checkpoint exit $?" | tee -a "$STEP_LOG"
    for weights in fp8 bf16; do
      quantization=$([ "$weights" = fp8 ] && echo "--quantization fp8")
      timeout "${SESSIONS_S:-170}" python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 --frames 8 \
        --think-ms 30 $quantization --out "$OUT/sessions-$weights.json" > "$OUT/sessions-$weights.log" 2>&1
      echo "sessions $weights exit $?" | tee -a "$STEP_LOG"
      tail -4 "$OUT/sessions-$weights.log" | tee -a "$STEP_LOG"
    done
    left=$(( ${CALL_S:-540} - SECONDS ))
    if compgen -G ".gpu/serve/*.whl" >/dev/null && [ "$left" -ge 150 ]; then
      for wheel in .gpu/serve/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site >/dev/null; done
      SERVE_ARGS_EXTRA="--quantization fp8" serve "$left" -fp8w TERRA_PICTURE_BATCH=1
    fi ;;
  pictures)
    for wheel in .gpu/ref/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site >/dev/null; done
    source_stamp "$OUT/code.txt"
    serve 150 -pic8 TERRA_PICTURE_BATCH=8
    serve 150 -pic1 TERRA_PICTURE_BATCH=1
    SERVE_ARGS_EXTRA="--quantization fp8" serve 190 -fp8w TERRA_PICTURE_BATCH=1 ;;
  *) echo "usage: gpu_lean41.sh driver|pictures" >&2; exit 2 ;;
esac
