#!/usr/bin/env bash
# Issue 28's one-GPU runs on a two-GPU host (nvidia-h100-x2), in two device calls back to back
# (after gpu_bundle.sh a1, a2, b, ff): GPU 0 runs the ACT-Bench end-to-end bench, which outlasts one
# call, while GPU 1 runs the shorter benches of gpu_decode_attention.sh. Each process sees one GPU
# and has its own TERRA_CACHE; both share the host's 32 cores (the rows say so).
#   start    carry .gpu/ray2 when Ray's first part is in /tmp/dl (unpacked for gpu_ray_scaling.sh);
#            GPU 0: `act` in the background (ACT_SAMPLES, default 256); GPU 1: `scenarios` with
#            terra's attention (fp8, 256 in flight, tokens only: the act run's same-host baseline)
#   collect  GPU 1: `single` with AND_SINGLE=1, `bf16` with AND_BF16=1 (else GPU 1 stays idle, so the act
#            run's rate timeline shows it beside GPU 1's work, then alone); then wait up to AWAIT_S
#            (default 400) for GPU 0's act run and pack it into $OUT/act.tar.gz, with the host's
#            `top` snapshots (every 15 s from `start`) in $OUT/cpu.tar.gz
#   await    wait up to AWAIT_S more for the act run (about 1,000 s in all for 256 samples on an H100)
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEP_LOG=$OUT/summary.txt
source benchmarks/scripts/gpu_common.sh
export TERRA_INSTALLED=1
case "${1:-}" in
  start)
    if [ ! -d /tmp/site/ray ] && [ -e /tmp/dl/ray.tar.xz.aa ] && [ -e .gpu/ray2/ray.tar.xz.ab ]; then
      cat /tmp/dl/ray.tar.xz.aa .gpu/ray2/ray.tar.xz.ab | tar -C /tmp/site -xJf - && echo "ray unpacked" | tee -a "$STEP_LOG"
    fi
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    in_background cpu bash -c 'top -b -c -d 15 -n 100 -w 230 | grep --line-buffered -A 16 "^top -"'
    CUDA_VISIBLE_DEVICES=0 TERRA_CACHE=/tmp/terra-cache-0 ACT_LIMIT_S=${ACT_LIMIT_S:-1150} \
      in_background act bash benchmarks/scripts/gpu_decode_attention.sh act
    CUDA_VISIBLE_DEVICES=1 TERRA_CACHE=/tmp/terra-cache-1 ATTENTIONS=terra bash benchmarks/scripts/gpu_decode_attention.sh scenarios ;;
  collect)
    [ -n "${AND_SINGLE:-}" ] && CUDA_VISIBLE_DEVICES=1 TERRA_CACHE=/tmp/terra-cache-1 bash benchmarks/scripts/gpu_decode_attention.sh single
    [ -n "${AND_BF16:-}" ] && CUDA_VISIBLE_DEVICES=1 TERRA_CACHE=/tmp/terra-cache-1 bash benchmarks/scripts/gpu_decode_attention.sh bf16
    await_background act "${AWAIT_S:-400}"; await_background cpu 0 ;;
  await) await_background act "${AWAIT_S:-540}"; await_background cpu 0 ;;
  *) echo "usage: gpu_pair.sh start|collect|await" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv | tee -a "$STEP_LOG"
