#!/usr/bin/env bash
# Issue 28: where a decode step's time goes at 256 rollouts (fp8 and bf16 KV), one rollout early vs
# late in a video, and a short list of vLLM options for the fp8 path (gpu_attention_profile.py says
# what each case measures). Run on the GPU host once vLLM's bundle is unpacked into /tmp/site
# (../shared/notes/gpu-host.md); needs no wheel beyond the bundle. About 6 minutes; the tables go to
# $OUT/attention-profile.md, every row to $OUT/rows.jsonl.
#   bash benchmarks/scripts/gpu_attention_profile.sh                       # all cases, in priority order
#   bash benchmarks/scripts/gpu_attention_profile.sh --only profile-fp8    # one case
set -uo pipefail
export TERRA_CACHE=${TERRA_CACHE:-/tmp/terra-cache} HF_HUB_OFFLINE=1
source benchmarks/scripts/gpu_common.sh
gpu_setup || exit 1
timeout 560 python3 benchmarks/scripts/gpu_attention_profile.py "$@" 2>&1 |
  grep -v "^INFO\|^(EngineCore\|Capturing CUDA graphs\|Loading safetensors" > "$OUT/log.txt"
echo "exit ${PIPESTATUS[0]}" >> "$OUT/log.txt"
cat "$OUT/attention-profile.md" 2>/dev/null || tail -40 "$OUT/log.txt"
