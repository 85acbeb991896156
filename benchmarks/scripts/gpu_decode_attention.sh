#!/usr/bin/env bash
# Issue 28: terra's paged decode kernel (--attention terra) against vLLM's FlashAttention-3, one
# phase per device call, on the GPU host once vLLM's bundle is in /tmp/site (gpu_bundle.sh a1, a2, b;
# ff too for act). Logs and JSON go to $OUT.
#   kernel     the kernel alone vs FA3 and the copy rate (gpu_paged_attention.py), ~1 min
#   parity     tests/test_gpu_parity.py -k terra_attention: both attentions against the reference
#   profile    decode steps at 256 rollouts and at one rollout, both attentions, fp8 and bf16 KV
#   scenarios  terra bench --scenarios 256 (25 frames, 256 in flight, fp8 KV): vllm, then terra ($ATTENTIONS)
#   single     terra bench --hf-vs-vllm --skip-hf --batch 1 --frames 25 (bf16): one rollout, both attentions
#   bf16       terra bench --scenarios 128 --max-rollouts 128 (bf16 KV): both attentions
#   writer     writer_parts.py: one ACT-Bench video's writer parts (decoder, uint8, H.264, read-back), ~1 min
#   act        terra bench --act-bench $ACT_SAMPLES (256) --kv-cache-dtype fp8 (auto: terra), end to end, within
#              $ACT_LIMIT_S (570; longer than a device call: start it with gpu_common.sh's in_background)
set -uo pipefail
export TERRA_CACHE=${TERRA_CACHE:-/tmp/terra-cache} HF_HUB_OFFLINE=1
source benchmarks/scripts/gpu_common.sh
gpu_setup || exit 1
case "$1" in
  kernel) timeout 300 python3 benchmarks/scripts/gpu_paged_attention.py --out "$OUT/paged_attention.json" ${KERNEL_ARGS:-} \
            > "$OUT/paged_attention.log" 2>&1; grep -v '^{' "$OUT/paged_attention.log" | tail -20 ;;
  parity) timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_parity.py -k terra_attention \
            > "$OUT/parity.log" 2>&1; tail -5 "$OUT/parity.log"
          for f in "$OUT"/parity-*.json; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); \
            print(sys.argv[1].split('/')[-1], r['attention'], r['teacher_forced_reference_argmax_equals_vllm_code'], \
            r['teacher_forced_reference_argmax_equals_frame_loop_code'], r['teacher_forced_max_abs_logit_diff'])" "$f"; done ;;
  profile) timeout 560 python3 benchmarks/scripts/gpu_attention_profile.py --budget-s 420 \
             --only "${2:-profile-fp8,profile-fp8-terra,profile-bf16,profile-bf16-terra}" 2>&1 |
             grep -v "^INFO\|^(EngineCore\|Capturing CUDA graphs\|Loading safetensors" > "$OUT/log.txt"
           cat "$OUT/attention-profile.md" 2>/dev/null || tail -40 "$OUT/log.txt" ;;
  scenarios) for attention in ${ATTENTIONS:-vllm terra}; do
               step "scenarios-fp8-$attention" ${SCENARIO_LIMIT_S:-300} bench --scenarios 256 --max-rollouts 256 --kv-cache-dtype fp8 \
                 --attention "$attention" --out "$OUT/scenarios-fp8-$attention.json"
             done ;;
  single) for attention in vllm terra; do
            step "single-$attention" 140 bench --hf-vs-vllm --skip-hf --batch 1 --frames 25 --attention "$attention" \
              --out "$OUT/single-$attention.json"
          done ;;
  bf16) for attention in vllm terra; do
            step "scenarios-bf16-$attention" "${BF16_LIMIT_S:-230}" bench --scenarios 128 --max-rollouts 128 --attention "$attention" \
              --out "$OUT/scenarios-bf16-$attention.json"
          done ;;
  writer) timeout 300 python3 benchmarks/scripts/writer_parts.py --out "$OUT/writer_parts.json" 2>&1 | tee "$OUT/writer_parts.log" ;;
  act) watch_gpu_memory act
       step act "${ACT_LIMIT_S:-570}" bench --act-bench "${ACT_SAMPLES:-256}" --kv-cache-dtype fp8 --out "$OUT/act.json"
       stop_gpu_memory ;;
  *) echo "usage: gpu_decode_attention.sh kernel|parity|profile|scenarios|single|bf16|act|writer" >&2; exit 2 ;;
esac
