#!/usr/bin/env bash
# One lease of one H100 (nvidia-h100-x1) for the issues' GPU rows, after `gpu_bundle.sh a1`, `a2`, `b`,
# `ff`, with the wheels of .gpu/ref (diffusers, importlib_metadata, zipp, gymnasium, farama-notifications,
# cloudpickle) unzipped into /tmp/site:
#   start  runs `steps` in the background; `gpu_pipeline.sh await` style collection with `await`
#   steps  one after the other on the one GPU, each in its own time limit:
#          (42) terra bench --env 64 --steps 8 --branches 8 --fork-from 20 --kv-cache-dtype fp8
#          (41) gpu_single_stream.py: terra's single-stream decoder, plain and Jacobi, Terra size then terra-mini
#          (37) tokens only, then videos, N samples of 47 frames on one engine (same GPU, one after the other)
#          (40) terra bench --refiner, compiled (Inductor), 1 and 2 windows per call
#   startab / ab  (issue 37) `bench --act-bench N` with the decode-ahead in the engine's process
#          (`--writers 0`) and in two writer processes (`--writers 2`), one after the other
#   start4 / steps4  (37, 41; next session) writer_parts.py with the compiled decoder (warms Inductor's cache
#          for the decode-ahead batch), gpu_single_stream.py (FlashAttention varlen + fused projections),
#          then tokens only and `--act-bench N` (decoder compiled, the default) on the one engine
#   await  wait up to AWAIT_S (default 540) for `steps`, then pack its folder into $OUT/probes.tar.gz
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEP_LOG=$OUT/summary.txt
source benchmarks/scripts/gpu_common.sh
export TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=/tmp/terra-cache/inductor
N=${N:-128}
terra() { python3 -m terra_cli "$@"; }
run_step() {  # NAME LIMIT_S COMMAND...: log in $OUT/NAME.log, exit code in the summary
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $? after $((SECONDS - t0)) s" >> "$STEP_LOG"
}
case "${1:-}" in
  start)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    nvidia-smi -L | tee -a "$STEP_LOG"
    in_background top bash -c 'top -b -c -d 20 -n 80 -w 230 | grep --line-buffered -A 12 "^top -"'
    in_background probes bash benchmarks/scripts/gpu_issue_probes.sh steps ;;
  steps)
    source_stamp "$OUT/commit.txt"
    run_step env 240 terra bench --env 64 --steps 8 --branches 8 --fork-from 20 --kv-cache-dtype fp8 --out "$OUT/env.json"
    run_step single_stream 330 python3 benchmarks/scripts/gpu_single_stream.py --budget-s 240 --out "$OUT/single_stream.json"
    run_step tokens 450 terra bench --scenarios "$N" --frames 47 --kv-cache-dtype fp8 --out "$OUT/tokens.json"
    ( while sleep 15; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done ) > "$OUT/act-gpu.txt" 2>&1 &
    watch=$!
    run_step act 390 terra bench --act-bench "$N" --kv-cache-dtype fp8 --out "$OUT/act.json"
    kill $watch
    run_step refiner-w1 300 terra bench --refiner --windows 1 --refiner-compile default --out "$OUT/refiner-w1.json"
    run_step refiner-w2 150 terra bench --refiner --windows 2 --refiner-compile default --out "$OUT/refiner-w2.json" ;;
  ab)  # issue 37: where the decode-ahead runs, one after the other on the one GPU (started like `steps`)
    source_stamp "$OUT/commit.txt"
    for writers in 0 2; do
      ( while sleep 15; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done ) \
        > "$OUT/act-w$writers-gpu.txt" 2>&1 &
      watch=$!
      run_step "act-w$writers" 240 terra bench --act-bench "$N" --kv-cache-dtype fp8 --writers "$writers" \
        --out "$OUT/act-w$writers.json"
      kill $watch
    done ;;
  steps4)
    source_stamp "$OUT/commit.txt"
    run_step writer_parts 240 python3 benchmarks/scripts/writer_parts.py --device cuda --out "$OUT/writer_parts.json"
    run_step single_stream 360 python3 benchmarks/scripts/gpu_single_stream.py --budget-s 270 --variants 0,1,7,4 \
      --out "$OUT/single_stream.json"
    run_step tokens 450 terra bench --scenarios "$N" --frames 47 --kv-cache-dtype fp8 --out "$OUT/tokens.json"
    ( while sleep 15; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done ) > "$OUT/act-gpu.txt" 2>&1 &
    watch=$!
    run_step act 420 terra bench --act-bench "$N" --kv-cache-dtype fp8 --out "$OUT/act.json"
    kill $watch ;;
  start4)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    nvidia-smi -L | tee -a "$STEP_LOG"
    in_background top bash -c 'top -b -c -d 20 -n 90 -w 230 | grep --line-buffered -A 12 "^top -"'
    in_background probes bash benchmarks/scripts/gpu_issue_probes.sh steps4 ;;
  startab)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    in_background probes bash benchmarks/scripts/gpu_issue_probes.sh ab ;;
  await)
    await_background probes "${AWAIT_S:-540}"
    await_background top 0 ;;
  *) echo "usage: gpu_issue_probes.sh start|steps|start4|steps4|startab|ab|await" >&2; exit 2 ;;
esac
