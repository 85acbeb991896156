#!/usr/bin/env bash
# Issue 41's single-stream rows with the fewest device calls: after `gpu_bundle.sh a1` and `a2` (vLLM's part a:
# FlashAttention-3's import loads vLLM's CUDA ops, so single-stream needs it too; a call carrying part b alone
# found that out on 2026-12-07), then on the same machine:
#   driver    (carry .gpu/vllm-b) unpack part b, install terra, build the random Terra checkpoint,
#             then the driver alone at 32 sessions (gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30,
#             ~50 s each once built) for each of WEIGHTS: fp8 (--quantization fp8), fp8-bytes (the same with
#             TERRA_FEW_ROWS_SPLITS=bytes: the kernel's split-K partials capped to a quarter of the weights'
#             bytes), bf16; -kv8 in a name adds --kv-cache-dtype fp8 (fp8-bytes-kv8, bf16-kv8), one with
#             -unroll TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=32 (the split-K sums fused; the few-rows kernel's
#             default since 2026-12-07c), -unroll8 =8 (Inductor's own: the default before), -tile128 --tile
#             128,128,4,4 (the 32-row fp8 tile before 2026-12-07c; fp8-kv8-tile128), -streams4
#             TERRA_NOISE_STREAMS=4 (the rows' noise drawn on 4 streams; codes_sha256 must match), -chunks64
#             TERRA_SAMPLER_CHUNKS=64 (the race's argmax over 64 slices a row; codes_sha256 must match), -pdl
#             TORCHINDUCTOR_ENABLE_PDL=1 (Inductor's kernels launched as programmatic dependent launches: each may
#             start while the one before ends, inside the step's CUDA graph; the JSON says whether torch knew it), -fewpdl
#             TERRA_FEW_ROWS_PDL=1 (the few-rows kernel launched so too, its weights read before the wait),
#             -fewwait TERRA_FEW_ROWS_PDL=wait (launched so, waiting at its start: no early read),
#             -rotstep TERRA_SINGLE_STREAM_ROTARY=step (rotary's cos and sin computed each step, as before
#             2026-12-07d, instead of rows of a table; codes_sha256 of one rollout must match), bf16-fewrows
#             TERRA_SINGLE_STREAM_LAYERS=few-rows (bf16 layers by terra's few-rows kernel, launched early, not
#             cuBLAS's: no faster on 2026-11-28, before the kernel's programmatic launch); default
#             "fp8 fp8-bytes bf16"
#   one       (carry .gpu/vllm-b) the same setup, then one session alone (--sessions 1 --frames 6 --think-ms 0:
#             one rollout through the driver) for each of WEIGHTS
#   profile   (carry .gpu/vllm-b) the same setup, then a 32-row step's kernels at 10-frame contexts for each of
#             WEIGHTS (gpu_batched_step.py --profile 32 --profile-context 10 [--quantization fp8])
#   bench     (carry .gpu/vllm-b) the same setup, then `terra bench --hf-vs-vllm --skip-hf --batch 1 --frames
#             BENCH_FRAMES` (7) on the random Terra checkpoint: vLLM's row and the single-stream rows (plain, and
#             with --draft), each with its GPU busy share; BENCH_ARGS adds options (e.g. --vllm-arg quantization=fp8)
#   pictures  (carry .gpu/serve: uvicorn and h11's wheels, 125 kB, beside .gpu/vllm-b) `terra serve` at 32
#             sessions, PICTURE_STEPS frames a session (4; 8 is the driver's, so the first frame, a prompt,
#             weighs as much in both), one ~90 s run for each of PICTURE_ROWS (default "pic8 pic1"): pic8
#             pictures in batches of 8 (--picture-batch 8), pic1 one a call, tokens the sessions' steps ask
#             for tokens, no picture ("format": "tokens"; server as pic8); -normal or -shared after a row's name
#             TERRA_PICTURE_STREAM=normal|shared (the pictures' CUDA stream), -graphs TERRA_DECODER_COMPILE_MODE=
#             reduce-overhead (the decoder as CUDA graphs), -vllm the server on vLLM instead of single-stream
#             (tokens-vllm: the two backends in one call); SERVE_ARGS_EXTRA adds server options to every row
#             (e.g. --kv-cache-dtype fp8); PICTURE_SESSIONS the sessions at once (32; comma-separated: 1,32),
#             PICTURE_S each row's limit (160 s); each row's `generate --server` part writes an mp4, so it
#             needs imageio-ffmpeg (`gpu_bundle.sh ff`, a call of its own) and exits 2 without it
# Subcommands chain, as device time is scarce (a session of 2026-12-07 lost all of it to machines that did not
# start): `gpu_lean41.sh one profile bench` sets up once (~35 s each saved) and packs each one's files into a
# tarball of its own; with pictures in the chain carry .gpu/serve beside .gpu/vllm-b (23 MB: both fit a call).
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
variant() {  # NAME: a WEIGHTS name's parts -> V_FLAGS (gpu_batched_step.py's) and V_SPLITS, V_UNROLL, V_STREAMS,
  # V_CHUNKS, V_PDL, V_FEWPDL, V_ROTARY, V_PROLOGUE, V_LAYERS (lab switches; empty: unset). fp8 or bf16 first, then any of the suffixes above; anything else stops the
  # script before a run (a part the old suffix matching missed ran a row with the bf16 cache, 2026-12-07)
  local part parts
  IFS=- read -r -a parts <<< "$1"
  V_FLAGS="" V_SPLITS=programs V_UNROLL="" V_STREAMS="" V_CHUNKS="" V_PDL="" V_FEWPDL="" V_ROTARY="" V_PROLOGUE="" V_LAYERS=""
  case "${parts[0]}" in fp8) V_FLAGS="--quantization fp8" ;; bf16) ;; *) return 1 ;; esac
  for part in "${parts[@]:1}"; do
    case "$part" in
      kv8) V_FLAGS="$V_FLAGS --kv-cache-dtype fp8" ;;
      bytes) V_SPLITS=bytes ;;
      unroll) V_UNROLL=32 ;;
      unroll8) V_UNROLL=8 ;;
      tile128) V_FLAGS="$V_FLAGS --tile 128,128,4,4" ;;
      streams4) V_STREAMS=4 ;;
      chunks64) V_CHUNKS=64 ;;
      pdl) V_PDL=1 ;;
      fewpdl) V_FEWPDL=1 ;;
      fewwait) V_FEWPDL=wait ;;
      rotstep) V_ROTARY=step ;;
      nopdl) V_PDL=0 V_FEWPDL=0 ;;  # plain launches (programmatic ones are the default since 2026-12-07e)
      proleager) V_PROLOGUE=eager ;;
      eagernorm) V_PROLOGUE=inputs ;;  # the final norm eager (compiled by default since 2026-12-07e)
      fewrows) [ "${parts[0]}" = bf16 ] || return 1; V_LAYERS=few-rows ;;  # bf16 layers by terra's kernel, not cuBLAS
      *) return 1 ;;
    esac
  done
}
check_weights() {  # every WEIGHTS name parses, before minutes of setup
  local weights
  for weights in ${WEIGHTS:-fp8 fp8-bytes bf16}; do
    variant "$weights" || { echo "WEIGHTS: $weights is not fp8 or bf16 followed by -kv8, -bytes, -unroll, -unroll8," \
      "-tile128, -streams4, -chunks64, -pdl, -fewpdl, -fewwait, -nopdl, -rotstep, -proleager, -eagernorm or (bf16) -fewrows" >&2; exit 2; }
  done
}
each_weights() {  # KIND LIMIT_S ARGS...: gpu_batched_step.py ARGS for each of WEIGHTS, its switches set by the name
  local kind=$1 limit=$2 weights
  shift 2
  for weights in ${WEIGHTS:-fp8 fp8-bytes bf16}; do
    variant "$weights"
    TERRA_FEW_ROWS_SPLITS=$V_SPLITS TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=$V_UNROLL TERRA_NOISE_STREAMS=$V_STREAMS \
      TERRA_SAMPLER_CHUNKS=$V_CHUNKS TORCHINDUCTOR_ENABLE_PDL=$V_PDL TERRA_FEW_ROWS_PDL=$V_FEWPDL \
      TERRA_SINGLE_STREAM_ROTARY=$V_ROTARY TERRA_STEP_PROLOGUE=$V_PROLOGUE TERRA_SINGLE_STREAM_LAYERS=$V_LAYERS \
      timeout "$limit" python3 benchmarks/scripts/gpu_batched_step.py "$@" $V_FLAGS \
      --out "$OUT/$kind-$weights.json" > "$OUT/$kind-$weights.log" 2>&1
    echo "$kind $weights exit $?" | tee -a "$STEP_LOG"
  done
}
picture_row() {  # NAME: a PICTURE_ROWS name -> P_OPTIONS (server options), P_FORMAT (a step's answer), P_STREAM,
  # P_MODE (lab switches; empty: unset)
  local part parts
  IFS=- read -r -a parts <<< "$1"
  P_STREAM="" P_MODE=""
  case "${parts[0]}" in
    pic1) P_OPTIONS="" P_FORMAT=jpeg ;;
    pic2|pic4|pic8|pic16) P_OPTIONS="--picture-batch ${parts[0]#pic}" P_FORMAT=jpeg ;;
    tokens) P_OPTIONS="--picture-batch 8" P_FORMAT=tokens ;;
    *) return 1 ;;
  esac
  for part in "${parts[@]:1}"; do
    case "$part" in
      normal|high|shared) P_STREAM=$part ;;
      graphs) P_MODE=reduce-overhead ;;
      vllm) P_OPTIONS="$P_OPTIONS --backend vllm" ;;  # the server on vLLM (the last --backend wins)
      *) return 1 ;;
    esac
  done
}
usage() { echo "usage: gpu_lean41.sh SUBCOMMAND... (driver, one, profile, bench, pictures)" >&2; exit 2; }
[ $# -gt 0 ] || usage
set_up=""
for sub in "$@"; do  # every subcommand known and every WEIGHTS name parsed, before minutes of setup
  case "$sub" in
    driver|one|profile) check_weights ;;
    bench) ;;
    pictures)
      for row in ${PICTURE_ROWS:-pic8 pic1}; do
        picture_row "$row" || { echo "PICTURE_ROWS: $row is not pic1, pic2, pic4, pic8, pic16 or tokens followed by -normal," \
          "-high, -shared, -graphs or -vllm" >&2; exit 2; }
      done ;;
    *) usage ;;
  esac
done
for sub in "$@"; do
  case "$sub" in
    driver|one|profile|bench|pictures) [ -n "$set_up" ] || setup; set_up=1 ;;  # pictures on a fresh machine too
  esac
  case "$sub" in
    driver) each_weights sessions "${SESSIONS_S:-120}" --sessions 32 --frames 8 --think-ms 30 ;;
    one) each_weights one "${SESSIONS_S:-120}" --sessions 1 --frames 6 --think-ms 0 ;;
    profile) each_weights profile "${PROFILE_S:-150}" --profile "${PROFILE_ROWS:-32}" --profile-context 10 ;;
    bench)
      timeout "${BENCH_S:-420}" python3 -m terra_cli bench --hf-vs-vllm --skip-hf --batch 1 --frames "${BENCH_FRAMES:-7}" \
        ${BENCH_ARGS:-} --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      echo "bench exit $?" | tee -a "$STEP_LOG" ;;
    pictures)
      for wheel in .gpu/serve/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site >/dev/null; done
      source_stamp "$OUT/code.txt"
      extra=${SERVE_ARGS_EXTRA:-}
      for row in ${PICTURE_ROWS:-pic8 pic1}; do
        picture_row "$row"
        TERRA_PICTURE_STREAM=$P_STREAM TERRA_DECODER_COMPILE_MODE=$P_MODE SERVE_STEPS=${PICTURE_STEPS:-4} \
          SERVE_STEP_FORMAT=$P_FORMAT SERVE_ARGS_EXTRA="$extra $P_OPTIONS" serve_rows "${PICTURE_S:-160}" "${PICTURE_SESSIONS:-32}" "-$row"
      done ;;
  esac
  pack_out "lean41-$sub"
done
