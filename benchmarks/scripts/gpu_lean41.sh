#!/usr/bin/env bash
# Issue 41's single-stream rows with the fewest device calls: after `gpu_bundle.sh a1` and `a2` (vLLM's part a:
# FlashAttention-3's import loads vLLM's CUDA ops, so single-stream needs it too; a call carrying part b alone
# found that out on 2026-12-07), then on the same machine:
#   driver    (carry .gpu/vllm-b) unpack part b, install terra, build the random Terra checkpoint,
#             then the driver alone at 32 sessions (gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30,
#             ~50 s each once built) for each of WEIGHTS: fp8 (--quantization fp8), fp8-bytes (the same with
#             TERRA_FEW_ROWS_SPLITS=bytes: the kernel's split-K partials capped to a quarter of the weights'
#             bytes), bf16; a name ending -kv8 adds --kv-cache-dtype fp8 (fp8-bytes-kv8, bf16-kv8), one with
#             -unroll TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=32 (the split-K sums fused; the few-rows kernel's
#             default since 2026-12-07c), -unroll8 =8 (Inductor's own: the default before), -tile128 --tile
#             128,128,4,4 (the 32-row fp8 tile before 2026-12-07c; fp8-kv8-tile128), -streams4
#             TERRA_NOISE_STREAMS=4 (the rows' noise drawn on 4 streams; codes_sha256 must match); default
#             "fp8 fp8-bytes bf16"
#   one       (carry .gpu/vllm-b) the same setup, then one session alone (--sessions 1 --frames 6 --think-ms 0:
#             one rollout through the driver) for each of WEIGHTS
#   profile   (carry .gpu/vllm-b) the same setup, then a 32-row step's kernels at 10-frame contexts for each of
#             WEIGHTS (gpu_batched_step.py --profile 32 --profile-context 10 [--quantization fp8])
#   pictures  (carry .gpu/serve: uvicorn and h11's wheels, 125 kB; after driver or profile) `terra serve` at 32
#             sessions, PICTURE_STEPS frames a session (4; 8 is the driver's, so the first frame, a prompt,
#             weighs as much in both), one ~90 s run for each of PICTURE_ROWS (default "pic8 pic1"): pic8
#             pictures in batches of 8 (--picture-batch 8), pic1 one a call, tokens the sessions' steps ask
#             for tokens, no picture ("format": "tokens"; server as pic8); SERVE_ARGS_EXTRA adds server options
#             to every row (e.g. --kv-cache-dtype fp8)
set -uo pipefail
source benchmarks/scripts/gpu_common.sh
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1
setup() {  # part b unpacked, terra installed, FlashAttention-3 loads, the checkpoint built once
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/vllm-b/part.tar.xz || { echo "part b did not unpack"; exit 1; }
  gpu_setup || exit 1
  source_stamp "$OUT/code.txt"
  python3 -c "from vllm.vllm_flash_attn import flash_attn_varlen_func" > "$OUT/flash.log" 2>&1 ||
    { tail -3 "$OUT/flash.log"; echo "FlashAttention-3 does not load: gpu_bundle.sh a1 and a2 first"; exit 1; }
  build_checkpoint
}
weights_flag() {  # a WEIGHTS name -> gpu_batched_step.py's flags: fp8* (fp8 weights), *-kv8 (the rows' caches in fp8)
  case "$1" in fp8*) echo -n "--quantization fp8 " ;; esac
  case "$1" in *-kv8*) echo "--kv-cache-dtype fp8" ;; esac  # anywhere in the name (fp8-kv8-tile128 ran without it)
}
splits_mode() { case "$1" in *-bytes*) echo bytes ;; *) echo programs ;; esac; }
unroll_for() { case "$1" in *-unroll8*) echo 8 ;; *-unroll*) echo 32 ;; esac; }  # TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS (empty: unset)
tile_flag() { case "$1" in *-tile128*) echo "--tile 128,128,4,4" ;; esac; }
streams_for() { case "$1" in *-streams4*) echo 4 ;; esac; }  # TERRA_NOISE_STREAMS (empty: unset)
each_weights() {  # KIND LIMIT_S ARGS...: gpu_batched_step.py ARGS for each of WEIGHTS, its switches set by the name
  local kind=$1 limit=$2 weights
  shift 2
  for weights in ${WEIGHTS:-fp8 fp8-bytes bf16}; do
    TERRA_FEW_ROWS_SPLITS=$(splits_mode "$weights") TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=$(unroll_for "$weights") \
      TERRA_NOISE_STREAMS=$(streams_for "$weights") \
      timeout "$limit" python3 benchmarks/scripts/gpu_batched_step.py "$@" $(weights_flag "$weights") $(tile_flag "$weights") \
      --out "$OUT/$kind-$weights.json" > "$OUT/$kind-$weights.log" 2>&1
    echo "$kind $weights exit $?" | tee -a "$STEP_LOG"
  done
}
case "${1:-}" in
  driver)
    setup
    each_weights sessions "${SESSIONS_S:-120}" --sessions 32 --frames 8 --think-ms 30 ;;
  one)
    setup
    each_weights one "${SESSIONS_S:-120}" --sessions 1 --frames 6 --think-ms 0 ;;
  profile)
    setup
    each_weights profile "${PROFILE_S:-150}" --profile 32 --profile-context 10 ;;
  pictures)
    for wheel in .gpu/serve/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site >/dev/null; done
    source_stamp "$OUT/code.txt"
    extra=${SERVE_ARGS_EXTRA:-}
    for row in ${PICTURE_ROWS:-pic8 pic1}; do
      case "$row" in
        pic8) options="--picture-batch 8" format=jpeg ;;
        pic1) options="" format=jpeg ;;
        tokens) options="--picture-batch 8" format=tokens ;;
        *) echo "PICTURE_ROWS takes pic8, pic1 and tokens, not $row" >&2; exit 2 ;;
      esac
      SERVE_STEPS=${PICTURE_STEPS:-4} SERVE_STEP_FORMAT=$format SERVE_ARGS_EXTRA="$extra $options" \
        serve_rows 160 32 "-$row"
    done ;;
  *) echo "usage: gpu_lean41.sh driver|one|profile|pictures" >&2; exit 2 ;;
esac
pack_out "lean41-$1"
