#!/usr/bin/env bash
# Issue 37 (one pipeline): videos included against tokens only, measured in one lease of a 4-GPU host
# (nvidia-h100-x4), after `gpu_bundle.sh a1`, `a2`, `b`, `ff` and `gpu_ray.sh stage` (Ray's first part in /tmp/dl):
#   start  (carry .gpu/ray2) unpack Ray, install terra, start `runs` in the background
#   runs   (1) four engines (Ray, --data-parallel 4), fp8 KV: N4 ACT-Bench-shaped samples tokens only
#          (`bench --scenarios N4 --frames 47`), then the same with videos (`bench --act-bench N4`);
#          (2) side by side, one GPU each: GPU 0 `bench --act-bench N1`, GPU 1 its tokens-only baseline
#          (`bench --scenarios N1 --frames 47`), GPU 2 writer_parts.py (where a writer's time per video goes)
#   startfull / runsfull  (carry .gpu/ray2) the tokens-only baseline, 256 rollouts in flight per engine
#          (`bench --scenarios 1024 --frames 47 --data-parallel 4`, its first TOKENS_S=360 s: the bench logs
#          the generated frames/s every minute; TOKENS_S=0 skips it, TOKENS_AFTER_S=N runs it after), then the full ACT-Bench-shaped
#          run on four engines, videos included: `bench --act-bench 2286 --data-parallel 4` (a watcher logs
#          done videos and GPU use every 30 s; the bench logs each engine's loop every minute);
#          MAX_ROLLOUTS=even: the full run with `--max-rollouts even` (two equal waves of 286 an engine on H200s);
#          GRAPH_SIZES=sparse: both runs with TERRA_CUDA_GRAPH_SIZES=sparse (21 CUDA graphs an engine, not 51);
#          with .gpu/spy carried (py-spy's wheel, `pip download py-spy`), py-spy samples which threads of an
#          engine actor hold the interpreter lock: 30 s mid-wave (SPY_MID_S, 200 s in) and 60 s from the first
#          videos' end (a wave change: GPU 31-52% busy for ~45 s on 2026-11-28), into $OUT/spy-*.txt
#   startref / runsref  (carry .gpu/ray2; `gpu_side4.sh ref` before, for diffusers) issue 40 end to end:
#          `bench --act-bench NREF (512) --data-parallel 4 --decoder refiner --refiner-windows REF_W (4)` within
#          REF_S (900 s), then the same samples tokens only within TOKENS_AFTER_S (240 s); collect with awaits
#   await  wait up to AWAIT_S (default 540) for `runs`, then pack its folder into $OUT/pipe.tar.gz
#          (the last await of a lease: AWAIT_S at least 40 s under the budget left, or its output is lost)
# On one GPU (nvidia-h100-x1), after `gpu_bundle.sh a1`, `a2`, `b`, `ff` (no Ray):
#   start1 start `runs1` in the background: N1 ACT-Bench-shaped samples tokens only, then with videos
#          (the same GPU, one after the other, the latter within RUN_S), then `bench --env 64` (issue 42) and
#          writer_parts.py, or with ONE_AFTER=refiner (carry .gpu/ref with `b`: diffusers) issue 40's overlap
#          against two stages on NREF1 (64) samples (ONE_PAIR=0 skips the pair before it); ONE_AFTER=refinerx:
#          the refined run, then the UNet autotuned, then 2 against 4 windows a call; ONE_AFTER=next:
#          gpu_fp8_rows.py, gpu_single_stream.py's fp8 variants, one `terra serve` session on single-stream with
#          fp8 weights, gpu_vae_decode.py, then the refined run within RUN_S (~25 minutes); ONE_AFTER=serve41:
#          issue 41's fp8 weight reads at the kernel's own tiles, single-stream plain / cuBLAS logits /
#          `--quantization fp8` (SINGLE_VARIANTS, default 0,17,19-23: with one FlashAttention plan a step, with
#          k and v written in the layer function, both), and a `terra serve` session with and without it
#          (FLASH_PLAN=step, CACHE_WRITE=fused: the servers with those lab switches) (~7 minutes);
#          ONE_AFTER=next2: serve41, a third session with both switches, gpu_vae_decode.py's product, both and
#          both-bf16, then the refined run within RUN_S (~20 minutes with NREF1=32); ONE_AFTER=next3: `terra
#          serve` on vLLM at 1, 8 and 32 sessions with its logits weight-major and then as vLLM computes them,
#          the same on single-stream (its row batches), the product's row batch alone (`gpu_batched_step.py
#          --product`), and the batched step at 3, 6 and 12 frames of context (~16 minutes; lease 8, in git's
#          history since); ONE_AFTER=next4: `terra serve` on single-stream and on vLLM, 1, 8 and 32 sessions of
#          SERVE_STEPS (8) frames, the product's row batch, single-stream with fp8 weights at 1 and 32 sessions
#          (~14 minutes); ONE_AFTER=next5: `terra serve` on single-stream at 1, 8 and 32 sessions, and with fp8
#          weights at 1 and 16 (~10 minutes); ONE_AFTER=next6: 32 sessions on single-stream (~3 minutes);
#          ONE_AFTER=next7: the product's row batch alone at 8 and 32 rows, `terra serve` on single-stream at 1, 8
#          and 32 sessions (rows joining at any step, pictures compiled), vLLM at 32 sessions (~9 minutes);
#          ONE_AFTER=next8: the product's driver fed as 8 and 32 sessions without a server (30 ms and 0 ms from a
#          frame to the next one's job), then `terra serve` on single-stream at 32 sessions (~5 minutes);
#          ONE_AFTER=next9: the same at 32 sessions and 30 ms only, then `terra serve` at 32 (~4 minutes);
#          ONE_AFTER=next10: `terra serve` on single-stream at 32 sessions, cut after the load (~2 minutes);
#          ONE_AFTER=next12: `gpu_batched_step.py` at 8 and 32 rows, contexts 3/7/11 frames, the product's step
#          (decoder head), then the row batch alone (--product) at 8 and 32 (~5 minutes);
#          ONE_AFTER=next13: the row batch alone and the driver at 32 sessions with the steps' sampler compiled and
#          eager (TERRA_SINGLE_STREAM_SAMPLER), then `terra serve` on single-stream at 1 and 32 (~8 minutes);
#          ONE_AFTER=next14: `gpu_batched_step.py --profile` at 32 and 8 rows (~2 minutes); ONE_AFTER=next15: the row
#          batch alone at 8 and 16 rows, the layers through cuBLAS and through the few-rows kernel (~3 minutes);
#          ONE_AFTER=next16: the driver alone at 32 sessions with the rows' caches in fp8, then bf16 (~3 minutes);
#          ONE_AFTER=next17: 32 sessions with the fp8 cache written inside the layer functions, apart, and bf16, a
#          32-row step's kernels at 10-frame contexts in fp8 and bf16, `terra serve` at 32 in fp8 (~11 minutes);
#          ONE_AFTER=next18: `terra serve` at 32 sessions with the fp8 cache, then bf16 (~6 minutes);
#          ONE_AFTER=pictures: `terra serve` at 1 and 32 sessions, --picture-batch 8, then 1, then 32 with
#          `--quantization fp8` (PICTURES_FP8=0: not) (~10 minutes);
#          ONE_AFTER=pictures32: the same at 32 sessions only, 4 frames a session (~7 minutes);
#          ONE_AFTER=next19: a 32-row step's kernels at 10-frame contexts, fp8 cache then bf16 (~3 minutes);
#          ONE_AFTER=next20: the fp8 cache's one-query steps through terra's decode kernel against
#          FlashAttention-3 (TERRA_SINGLE_STREAM_DECODE_KERNEL, eeb88f9's; taken out after lease 11 of
#          2026-12-06 measured no gain): 32-row profiles, then 32 sessions (~4 minutes);
#          ONE_AFTER=decoder: `writer_parts.py`, the tokenizer's decoder alone on the pair's host (~2 minutes);
#          ONE_AFTER=none: nothing after the pair;
#          ONE_AFTER=drain (with ONE_PAIR=0): `gpu_drain.py`, --videos-at-end's drain alone, the old one against
#          the product's, NDRAIN (192) videos (~3 minutes);
#          ONE_AFTER=blocks (with ONE_PAIR=0): vLLM's KV-cache block size 16 / 256 / 64, terra's attention and FA3,
#          tokens only, 128 scenarios of 25 frames (~15 minutes);
#          ONE_FIRST=flash: `gpu_flash_decode.py` (its layouts: FA3 on the batch layout, pack_gqa, FA4) before the
#          pair (issue 41, ~2 minutes); ONE_WARM=1: a short
#          tokens-only run before the pair, so that neither meets a cold host; ONE_WARM=act: a short
#          `--act-bench 16 --videos-at-end` instead, which also leaves the tokenizer's decoder in Inductor's cache
#          (a user's second run on the machine: the pair's decoder child then compiles from the cache);
#   flashpage  (in the call, after start1's runs) 32 sessions, the fp8 cache in FlashAttention pages of 256 and of
#          16, then a 32-row profile in pages of 256 (~5 minutes);
#          `await` collects it
# On two GPUs (nvidia-h200-x2), after `gpu_bundle.sh a1`, `a2`, `b && gpu_side4.sh ref` (carry .gpu/ref: diffusers,
# uvicorn, h11), `ff`:
#   start2 start `runs2` in the background, one chain a GPU: GPU 0 issue 40's overlap (`--act-bench NREF1 (32)
#          --decoder refiner --refiner-windows 4`: the refiner compiled apart while vLLM generates), then `bench
#          --act-bench N2` (512: two waves of 256); GPU 1 the two stages' parts on NREF1 (tokens only, then `bench
#          --refiner --windows 4`, each refiner on its own cold Inductor cache), then the same N2 samples tokens only
#          (REF_FIRST=0: each GPU's pair run first, the refiner parts after; PAIR1=defer: GPU 1's pair run is the
#          ACT-Bench run with --videos-at-end instead of tokens only), then gpu_serve.sh
#          (issue 41's serving figures) within SERVE_S (300 s; 0 skips it); `await` collects it
# On a 4-GPU host without Ray, after `gpu_bundle.sh a1`, `a2`, `b`, `ff` (one call each: b and ff together pass
# the 64 MiB a call carries) and `gpu_side4.sh ref` (carry .gpu/ref: diffusers, for the refiner step):
#   startab  start `runsab` in the background, one GPU each, side by side (NAB samples, 256 by default):
#          GPU 0 `bench --act-bench NAB` (videos), GPU 1 `bench --scenarios NAB --frames 47` (tokens only,
#          the same shape: the 90% ratio of one engine), GPU 2 the ACT-Bench run with staggered starts
#          (TERRA_STAGGER_STARTS=1), GPU 3 gpu_single_stream.py (issue 41: plain, Jacobi K=8, K=8 with
#          weight-major or few-rows logits, plain with few-rows logits or max-autotune layers), then
#          issue 40's `bench --refiner --windows 4`; `await` collects it (SINGLE_VARIANTS: gpu_single_stream.py's
#          --variants, default 0,9,1,8,10,7; 0,9,11,8,12 compares the split-K layer projections, issue 41). GPU2=writers1: GPU 2 runs the
#          ACT-Bench run with one writer process (`--writers 1`) instead, GPU2=inflight tokens only at INFLIGHT
#          (480) rollouts in flight (`--scenarios 480 --max-rollouts 480`), GPU2=gil staggered starts with a
#          0.5 ms interpreter switch interval; GPU0_STAGGER=1: GPU 0 with staggered starts (the product's
#          default); GPU3=refiner: GPU 3 runs only the refiner (REFINER_W8=1: then 8 windows a call too);
#          GPU3=reflayout: GPU 3 runs only the refiner at 4 windows a call, once per lab switch variant (issue 40:
#          REFLAYOUT, default "nchw cl flash clflash": TERRA_REFINER_CHANNELS_LAST=1, TERRA_REFINER_ATTENTION=flash,
#          both; nchw: TERRA_REFINER_CHANNELS_LAST=0, since 2026-11-29 "default" is channels-last on a GPU),
#          into reflayout.json and reflayout.log;
#          GPU3=gil: GPU 3 runs GPU2=gil's ACT-Bench run at GIL3_S (0.0001 s; it crashed vLLM, 2026-11-27);
#          GPU2=stream: staggered starts, the engine on a high-priority CUDA stream (TERRA_ENGINE_STREAM_PRIORITY);
#          GPU2=batchN: staggered starts, the tokenizer encoding and decoding N frames a call (TERRA_TOKENIZER_BATCH);
#          GPU2=smsN: staggered starts, the decoder bounded to N SMs by a CUDA green context (TERRA_DECODE_SMS);
#          GPU2=decmax (or GPU3=decmax): staggered starts, the decoder compiled with Inductor's autotuning
#          (TERRA_DECODER_COMPILE_MODE=max-autotune-no-cudagraphs); GPU3=batchN: GPU2=batchN's run on GPU 3;
#          GPU2=refiner1 (issue 40, overlap against two stages): GPU 2 refines NREF1 (64) ACT-Bench samples beside
#          vLLM in one engine (`--act-bench NREF1 --decoder refiner --refiner-windows 4`); GPU3=twostage: GPU 3
#          runs the same samples tokens only, then `bench --refiner --windows 4` (the second stage's parts);
#          GPU3=eagerdec: staggered starts with the eager tokenizer decoder (TERRA_DECODER_COMPILE=0);
#          GPU3=engdec: staggered starts, the decoder's kernels behind the engine's (TERRA_DECODE_STREAM=engine);
#          REFINER_PROFILE=1 (with GPU3=refiner or single): then gpu_refiner_profile.py (issue 40);
#          REFINER_COMPILE: the refiner's --refiner-compile there (default; max-autotune-no-cudagraphs to compare);
#          RUN_S: the runs' time limit (600 s)
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEP_LOG=$OUT/summary.txt
source benchmarks/scripts/gpu_common.sh
export TERRA_INSTALLED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 RAY_DISABLE_USAGE_STATS=1 \
  RAY_USAGE_STATS_ENABLED=0 TERRA_CACHE=/tmp/terra-cache
N4=${N4:-512}
N1=${N1:-256}
N2=${N2:-512}  # start2: samples a run of the pair (two waves of 256 in flight)
NAB=${NAB:-256}  # startab: samples a run (one engine each; 256 fill its slots, ~470 s on an H200)
terra() { python3 -m terra_cli "$@"; }
watch_gpus() {  # FILE FIELDS: every 30 s a line of each GPU's FIELDS (nvidia-smi --query-gpu) into $OUT/FILE; run it with &
  while sleep 30; do
    echo "$(date +%s) $(nvidia-smi --query-gpu="$2" --format=csv,noheader | tr '\n' ' ')"
  done > "$OUT/$1" 2>&1
}
spy_record() {  # SPY NAME SECONDS: py-spy's samples of the threads holding the interpreter lock in an engine actor
  local pid; pid=$(pgrep -f "ray::ScenarioEngine" | head -1)
  [ -n "$pid" ] || { echo "spy $2: no engine actor found" >> "$STEP_LOG"; return; }
  timeout 20 "$1" dump --pid "$pid" --nonblocking > "$OUT/spy-$2-dump.txt" 2>&1
  timeout $(( $3 + 30 )) "$1" record --pid "$pid" --duration "$3" --rate 100 --gil --nonblocking --format raw \
    --output "$OUT/spy-$2.txt" > "$OUT/spy-$2.log" 2>&1; echo "spy $2 (pid $pid) exit $?" >> "$STEP_LOG"
}
spy_during_full() {  # (carry .gpu/spy: py-spy's wheel) 30 s mid-wave, then 60 s from the first videos' end (a wave change)
  mkdir -p /tmp/spy && python3 -m zipfile -e .gpu/spy/py_spy-*.whl /tmp/spy || return
  local spy; spy=$(ls /tmp/spy/py_spy-*.data/scripts/py-spy) && chmod +x "$spy" || return
  sleep "${SPY_MID_S:-200}"; spy_record "$spy" midwave 30
  for _ in $(seq 600); do
    [ "$(grep -c '"done"' /tmp/actfull/outputs/results.jsonl 2>/dev/null)" -gt 0 ] 2>/dev/null && break; sleep 2
  done
  spy_record "$spy" waveend 60
}
say_if_no_diffusers() {  # the refiner runs need diffusers, which `gpu_side4.sh ref` brings
  python3 -c "import diffusers" 2>/dev/null || echo "no diffusers: carry .gpu/ref (gpu_side4.sh ref)" >> "$STEP_LOG"
}
case "${1:-}" in
  start|startfull|startref)  # Ray from the two parts (gpu_ray.sh stage, this call's .gpu/ray2), terra, then the runs
    if [ ! -d /tmp/site/ray ]; then
      cat /tmp/dl/ray.tar.xz.aa .gpu/ray2/ray.tar.xz.ab | tar -C /tmp/site -xJf - || { echo "ray bundle missing"; exit 1; }
    fi
    TERRA_INSTALLED= gpu_setup || exit 1  # install terra here; the runs it starts keep TERRA_INSTALLED
    in_background top bash -c 'top -b -c -d 30 -n 80 -w 230 | grep --line-buffered -A 12 "^top -"'
    in_background pipe bash benchmarks/scripts/gpu_pipeline.sh "${1/start/runs}" ;;
  runs)
    source_stamp "$OUT/commit.txt"
    timeout 600 terra bench --scenarios "$N4" --frames 47 --data-parallel 4 --kv-cache-dtype fp8 \
      --out "$OUT/dp4-tokens.json" > "$OUT/dp4-tokens.log" 2>&1; echo "dp4-tokens exit $?" >> "$STEP_LOG"
    timeout 900 terra bench --act-bench "$N4" --data-parallel 4 --kv-cache-dtype fp8 \
      --out "$OUT/dp4-act.json" > "$OUT/dp4-act.log" 2>&1; echo "dp4-act exit $?" >> "$STEP_LOG"
    CUDA_VISIBLE_DEVICES=0 timeout 900 python3 -m terra_cli bench --act-bench "$N1" --kv-cache-dtype fp8 \
      --out "$OUT/one-act.json" > "$OUT/one-act.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 600 python3 -m terra_cli bench --scenarios "$N1" --frames 47 --kv-cache-dtype fp8 \
      --out "$OUT/one-tokens.json" > "$OUT/one-tokens.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=2 timeout 300 python3 benchmarks/scripts/writer_parts.py --out "$OUT/writer_parts.json" \
      > "$OUT/writer_parts.log" 2>&1 &
    wait
    echo "one-GPU runs done" >> "$STEP_LOG" ;;
  runsref)
    # Issue 40's end-to-end target: ACT-Bench-shaped samples refined by the video refiner on four engines
    # (random Terra-size weights for both models, built once into terra's cache), then the same samples tokens
    # only (TOKENS_AFTER_S) for the same host's rate without the refiner.
    source_stamp "$OUT/commit.txt"
    restore_warm_caches
    say_if_no_diffusers
    timeout "${REF_S:-900}" terra bench --act-bench "${NREF:-512}" --data-parallel 4 --kv-cache-dtype fp8 \
      --decoder refiner --refiner-windows "${REF_W:-4}" --out "$OUT/dp4-act-refiner.json" > "$OUT/dp4-act-refiner.log" 2>&1
    echo "dp4-act-refiner exit $?" >> "$STEP_LOG"
    # An engine that ends leaves its Python stacks (faulthandler) and tracebacks in Ray's worker logs
    for f in $(grep -l "Traceback\|Fatal Python\|RefinerStopped\|Error" /tmp/ray/session_latest/logs/worker-*.err \
               2>/dev/null | head -4); do echo "== $f"; tail -60 "$f"; done > "$OUT/worker-errors.txt" 2>&1
    save_warm_caches
    timeout "${TOKENS_AFTER_S:-240}" terra bench --scenarios "${NREF:-512}" --frames 47 --data-parallel 4 \
      --kv-cache-dtype fp8 --out "$OUT/dp4-tokens.json" > "$OUT/dp4-tokens.log" 2>&1
    echo "dp4-tokens exit $?" >> "$STEP_LOG" ;;
  runsfull)
    source_stamp "$OUT/commit.txt"
    restore_warm_caches  # (carried as .gpu/warm; a fresh host compiles everything otherwise)
    # GRAPH_SIZES=sparse: every engine of both runs captures terra's sparser CUDA-graph sizes (a local Ray
    # cluster's actors inherit this environment); the bench's JSON has each engine's graph_sizes and graph_capture_s
    if [ -n "${GRAPH_SIZES:-}" ]; then export TERRA_CUDA_GRAPH_SIZES="$GRAPH_SIZES"; fi
    # The tokens-only baseline's first wave only (TOKENS_S, default 360 s): its per-minute rate lines
    # compare with the same minutes of the full run's first wave, and the budget keeps the full run whole.
    # TOKENS_S=0 skips it: a 30-minute lease holds setup (~150 s) and the whole full run (~1,300 s) only then.
    if [ "${TOKENS_S:-360}" != 0 ]; then
      timeout "${TOKENS_S:-360}" terra bench --scenarios 1024 --frames 47 --data-parallel 4 --kv-cache-dtype fp8 \
        --out "$OUT/dp4-tokens.json" > "$OUT/dp4-tokens.log" 2>&1; echo "dp4-tokens exit $?" >> "$STEP_LOG"
    fi
    df -h /dev/shm /tmp >> "$STEP_LOG" 2>&1  # Ray's object store falls back to /tmp when /dev/shm is small
    ( while sleep 30; do
        echo "$(date +%s) done=$(grep -c '"done"' /tmp/actfull/outputs/results.jsonl 2>/dev/null)" \
          "gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr '\n' ' ')"
      done ) > "$OUT/full-watch.txt" 2>&1 &
    watch=$!
    [ -d .gpu/spy ] && spy_during_full &
    timeout 1800 terra bench --act-bench 2286 --data-parallel 4 --kv-cache-dtype fp8 --keep-outputs /tmp/actfull \
      --max-rollouts "${MAX_ROLLOUTS:-auto}" \
      --out "$OUT/dp4-act-full.json" > "$OUT/dp4-act-full.log" 2>&1; echo "dp4-act-full exit $?" >> "$STEP_LOG"
    kill $watch
    grep -i "object store\|/dev/shm\|spill" /tmp/ray/session_latest/logs/raylet.out 2>/dev/null | head -5 >> "$STEP_LOG"
    cp /tmp/actfull/outputs/results.jsonl "$OUT/full-results.jsonl" 2>/dev/null
    save_warm_caches
    # TOKENS_AFTER_S: the tokens-only baseline after the full run instead of before, so the full run is
    # whole in the lease and its ratio still comes from the same host; the last await takes what it reached.
    # With MAX_ROLLOUTS=even the baseline is the full run's first wave at its in-flight count: 1,144 scenarios,
    # 286 an engine (1,024 would be 256 an engine, another configuration than the full run's).
    if [ "${TOKENS_AFTER_S:-0}" != 0 ]; then
      tokens_n=1024; [ "${MAX_ROLLOUTS:-auto}" = even ] && tokens_n=1144
      timeout "$TOKENS_AFTER_S" terra bench --scenarios "$tokens_n" --frames 47 --data-parallel 4 --kv-cache-dtype fp8 \
        --max-rollouts "${MAX_ROLLOUTS:-auto}" --out "$OUT/dp4-tokens.json" > "$OUT/dp4-tokens.log" 2>&1
      echo "dp4-tokens exit $?" >> "$STEP_LOG"
    fi
    ;;
  start1)
    TERRA_INSTALLED= gpu_setup || exit 1  # install terra here; the runs it starts keep TERRA_INSTALLED
    in_background top bash -c 'top -b -c -d 20 -n 80 -w 230 | grep --line-buffered -A 12 "^top -"'
    in_background pipe bash benchmarks/scripts/gpu_pipeline.sh runs1 ;;
  start2)
    TERRA_INSTALLED= gpu_setup || exit 1  # install terra here; the runs it starts keep TERRA_INSTALLED
    in_background top bash -c 'top -b -c -d 30 -n 80 -w 230 | grep --line-buffered -A 12 "^top -"'
    in_background pipe bash benchmarks/scripts/gpu_pipeline.sh runs2 ;;
  runs2)
    source_stamp "$OUT/commit.txt"
    say_if_no_diffusers
    build_checkpoint
    watch_gpus two-gpu.txt memory.used,utilization.gpu &
    watch=$!
    # Each GPU's two parts: the pair (issue 37) and issue 40's refiner parts. REF_FIRST=1 (the default) runs the
    # refiner parts first: run last, they were cut off with the lease twice (2026-11-28); REF_FIRST=0 the pair first.
    pair0() {
      timeout "${RUN_S:-1020}" terra bench --act-bench "$N2" --kv-cache-dtype fp8 \
        --out "$OUT/act-gpu0.json" > "$OUT/act-gpu0.log" 2>&1; echo "act-gpu0 exit $? at $(date +%s)" >> "$STEP_LOG"
    }
    # the overlap run compiles into a cache of its own: the pair's decoder compile stays a user's first (cold)
    ref0() {
      TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu0-ref timeout 600 terra bench --act-bench "${NREF1:-32}" --decoder refiner \
        --refiner-windows 4 --kv-cache-dtype fp8 --out "$OUT/refiner1-gpu0.json" > "$OUT/refiner1-gpu0.log" 2>&1
      echo "refiner1-gpu0 exit $? at $(date +%s)" >> "$STEP_LOG"
    }
    # PAIR1=defer: GPU 1 runs the same ACT-Bench run with --videos-at-end (every video decoded once the engine
    # is done) instead of tokens only; its engine phase decodes nothing, so it is its own tokens-only baseline
    pair1() {
      if [ "${PAIR1:-tokens}" = defer ]; then
        timeout "${RUN_S:-1020}" terra bench --act-bench "$N2" --videos-at-end --kv-cache-dtype fp8 \
          --out "$OUT/defer-gpu1.json" > "$OUT/defer-gpu1.log" 2>&1; echo "defer-gpu1 exit $? at $(date +%s)" >> "$STEP_LOG"
        return
      fi
      timeout "${RUN_S:-1020}" terra bench --scenarios "$N2" --frames 47 --kv-cache-dtype fp8 \
        --out "$OUT/tokens-gpu1.json" > "$OUT/tokens-gpu1.log" 2>&1; echo "tokens-gpu1 exit $? at $(date +%s)" >> "$STEP_LOG"
    }
    # GPU 1's refiner compiles into a cache of its own too: both refiner compiles start cold, as a user's first run
    ref1() {
      timeout 400 terra bench --scenarios "${NREF1:-32}" --frames 47 --kv-cache-dtype fp8 \
        --out "$OUT/twostage-tokens-gpu1.json" > "$OUT/twostage-tokens-gpu1.log" 2>&1
      echo "twostage-tokens-gpu1 exit $? at $(date +%s)" >> "$STEP_LOG"
      TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu1 timeout 400 terra bench --refiner --windows 4 --refiner-compile default \
        --out "$OUT/twostage-refiner-gpu1.json" > "$OUT/twostage-refiner-gpu1.log" 2>&1
      echo "twostage-refiner-gpu1 exit $? at $(date +%s)" >> "$STEP_LOG"
    }
    if [ "${REF_FIRST:-1}" = 1 ]; then order=(ref pair); else order=(pair ref); fi
    ( export CUDA_VISIBLE_DEVICES=0
      "${order[0]}0"; "${order[1]}0" ) &
    chain0=$!
    ( export CUDA_VISIBLE_DEVICES=1
      "${order[0]}1"; "${order[1]}1"
      if [ "${SERVE_S:-300}" != 0 ]; then  # (timeout 0 would mean no limit)
        mkdir -p "$OUT/serve"
        OUT=$OUT/serve timeout "${SERVE_S:-300}" bash benchmarks/scripts/gpu_serve.sh > "$OUT/serve.log" 2>&1
        echo "serve exit $? at $(date +%s)" >> "$STEP_LOG"
      fi
    ) &
    wait $chain0 $!
    kill $watch ;;
  startab)
    TERRA_INSTALLED= gpu_setup || exit 1  # install terra here; the runs it starts keep TERRA_INSTALLED
    in_background pipe bash benchmarks/scripts/gpu_pipeline.sh runsab ;;
  runsab)
    source_stamp "$OUT/commit.txt"
    restore_warm_caches
    build_checkpoint
    watch_gpus ab-gpu.txt utilization.gpu &
    watch=$!
    pids=()
    gpus=$(nvidia-smi -L | wc -l)  # on a two-GPU host: GPUs 0 and 1 alone (the 90% ratio)
    runs=("0 act" "1 tokens")
    [ "$gpus" -ge 3 ] && runs+=("2 act2")
    [ "$gpus" -ge 4 ] && [ "${GPU3:-single}" = gil ] && runs+=("3 act3")  # GPU3=gil: as GPU2=gil at GIL3_S (0.0001 s)
    # GPU3=eagerdec: staggered starts with the eager decoder (TERRA_DECODER_COMPILE=0: twice the compiled one's GPU
    # time a frame); steps slower than GPU 0's say the decoder's kernels are what slows them
    # GPU3=engdec: staggered starts, the decoder's kernels queued behind the engine's (TERRA_DECODE_STREAM=engine)
    # GPU3=batchN / GPU3=decmax: GPU2's variants of those names on GPU 3, so one round measures two of them
    case "${GPU3:-single}" in gil|eagerdec|engdec|batch[0-9]*|decmax) act3=1 ;; *) act3= ;; esac
    [ "$gpus" -ge 4 ] && [ -n "$act3" ] && [ "${GPU3}" != gil ] && runs+=("3 act3")
    [ "${GPU3:-single}" = twostage ] && act3=twostage  # (started with the runs below)
    [ "$gpus" -ge 4 ] && [ -z "$act3" ] && (
    # GPU 3 (GPU3=single, the default): issue 41's one-rollout variants then issue 40's refiner at 4
    # windows a call (its compile, ~100 s cold, outran a call before: here it runs in the background
    # job); GPU3=refiner: the refiner alone, compiled, at 4 then 8 windows a call
      if [ "${GPU3:-single}" = single ]; then
        CUDA_VISIBLE_DEVICES=3 timeout 320 python3 benchmarks/scripts/gpu_single_stream.py --models terra,mini \
          --variants "${SINGLE_VARIANTS:-0,9,1,8,10,7}" --budget-s 250 --out "$OUT/single_stream.json" > "$OUT/single_stream.log" 2>&1
      fi
      say_if_no_diffusers
      # GPU3=reflayout: the compiled refiner at 4 windows a call, variant after variant (REFLAYOUT picks): as is;
      # its UNet channels-last (TERRA_REFINER_CHANNELS_LAST=1: the profile's 40 ms a window of cuDNN's layout
      # copies); its self-attention on SDPA's flash kernel (TERRA_REFINER_ATTENTION=flash; torch chose cuDNN's,
      # 313 TFLOP/s); both. Each variant compiles its own graph (~100 s cold). Two files for all of them:
      # reflayout.log (every run's log, in turn) and reflayout.json ({variant: its bench JSON, null if none})
      if [ "${GPU3:-single}" = reflayout ]; then
        variants=${REFLAYOUT:-nchw cl flash clflash}
        for v in $variants; do
          case $v in
            default) sw=() ;;
            cl) sw=(TERRA_REFINER_CHANNELS_LAST=1) ;;
            nchw) sw=(TERRA_REFINER_CHANNELS_LAST=0) ;;
            flash) sw=(TERRA_REFINER_ATTENTION=flash) ;;
            clflash) sw=(TERRA_REFINER_CHANNELS_LAST=1 TERRA_REFINER_ATTENTION=flash) ;;
            *) echo "reflayout: no variant $v (default nchw cl flash clflash)" >> "$STEP_LOG"; continue ;;
          esac
          rm -f "/tmp/reflayout-$v.json"
          echo "== reflayout $v: ${sw[*]:-no switches}" >> "$OUT/reflayout.log"
          env CUDA_VISIBLE_DEVICES=3 "${sw[@]}" timeout -k "$KILL_AFTER_S" 200 python3 -m terra_cli bench --refiner --windows 4 \
            --refiner-compile default --out "/tmp/reflayout-$v.json" --overwrite >> "$OUT/reflayout.log" 2>&1
          echo "reflayout $v exit $?" >> "$STEP_LOG"
        done
        python3 -c 'import json, os, sys
runs = {v: f"/tmp/reflayout-{v}.json" for v in sys.argv[2:]}
merged = {v: json.load(open(f)) if os.path.exists(f) else None for v, f in runs.items()}
open(sys.argv[1], "w").write(json.dumps(merged, indent=1) + "\n")' "$OUT/reflayout.json" $variants
      fi
      [ "${GPU3:-single}" = reflayout ] || for w in 4 ${REFINER_W8:+8}; do
        CUDA_VISIBLE_DEVICES=3 timeout 270 python3 -m terra_cli bench --refiner --windows $w --refiner-compile "${REFINER_COMPILE:-default}" \
          --out "$OUT/refiner-compiled-w$w.json" --overwrite > "$OUT/refiner-compiled-w$w.log" 2>&1
      done
      # REFINER_PROFILE=1: where a window's GPU time goes, by kernel group, with each group's TFLOP/s
      if [ -n "${REFINER_PROFILE:-}" ]; then
        CUDA_VISIBLE_DEVICES=3 timeout 240 python3 benchmarks/scripts/gpu_refiner_profile.py --windows 4 --compile "${REFINER_COMPILE:-default}" \
          --out "$OUT/refiner_profile.json" > "$OUT/refiner_profile.log" 2>&1
      fi ) &
    [ "$gpus" -ge 4 ] && [ -z "$act3" ] && pids+=($!)
    # GPU 2: GPU2=stagger (the default) ACT-Bench with staggered starts; GPU2=writers1 with one writer process;
    # GPU2=gil staggered starts with the interpreter's switch interval at GIL_SWITCH_S (0.0005 s, Python's
    # default is 0.005) through a sitecustomize: do the decode-ahead threads hold the engine loop's lock?
    gpu2=(TERRA_STAGGER_STARTS=1)
    extra2=()
    if [ "${GPU2:-stagger}" = writers1 ]; then gpu2=(TERRA_STAGGER_STARTS=0); extra2=(--writers 1); fi
    if [ "${GPU2:-stagger}" = gil ] || [ "${GPU3:-single}" = gil ]; then
      mkdir -p /tmp/gil-site
      printf 'import os, sys\nsys.setswitchinterval(float(os.environ.get("GIL_SWITCH_S", "0.0005")))\n' \
        > /tmp/gil-site/sitecustomize.py
    fi
    # GPU2=stream: staggered starts with the engine on the card's highest-priority stream
    # (TERRA_ENGINE_STREAM_PRIORITY=high): do the decode-ahead's kernels slow the engine's steps?
    if [ "${GPU2:-stagger}" = stream ]; then gpu2=(TERRA_STAGGER_STARTS=1 TERRA_ENGINE_STREAM_PRIORITY=high); fi
    # GPU2=batchN (batch16, batch4): staggered starts, the run's tokenizer in batches of N frames
    # (TERRA_TOKENIZER_BATCH; 16 slowed the steps more than 8, 2026-11-27 night: 4 is the next probe)
    case "${GPU2:-stagger}" in batch[0-9]*) gpu2=(TERRA_STAGGER_STARTS=1 "TERRA_TOKENIZER_BATCH=${GPU2#batch}") ;; esac
    # GPU2=smsN (sms16): staggered starts, the decoder's kernels on a green context of N SMs (TERRA_DECODE_SMS;
    # the run's engine_loop says decode_sms_error where torch or the driver has none)
    case "${GPU2:-stagger}" in sms[0-9]*) gpu2=(TERRA_STAGGER_STARTS=1 "TERRA_DECODE_SMS=${GPU2#sms}") ;; esac
    # GPU2=decmax: staggered starts, the decode-ahead's decoder compiled with Inductor's autotuning
    # (TERRA_DECODER_COMPILE_MODE=max-autotune-no-cudagraphs): a cheaper decoder a frame, less of the card held?
    if [ "${GPU2:-stagger}" = decmax ]; then gpu2=(TERRA_STAGGER_STARTS=1 TERRA_DECODER_COMPILE_MODE=max-autotune-no-cudagraphs); fi
    if [ "${GPU2:-stagger}" = gil ]; then
      gpu2=(TERRA_STAGGER_STARTS=1 "PYTHONPATH=/tmp/gil-site:$PYTHONPATH")
      echo "GPU 2: switch interval ${GIL_SWITCH_S:-0.0005} s" >> "$STEP_LOG"
    fi
    # GPU2=inflight: tokens only with INFLIGHT (480) rollouts in flight, against GPU 1's 256 (an H200's fp8 KV
    # cache holds 511 of ACT-Bench's rounds; 128 -> 256 gave 25% more frames/s on an H100, 2026-11-25)
    if [ "${GPU2:-stagger}" = inflight ] && [ "$gpus" -ge 3 ]; then
      runs=("0 act" "1 tokens" "2 tokens-inflight")
    fi
    # GPU2=refiner1 (issue 40, overlap against two stages): GPU 2 runs NREF1 (64) ACT-Bench samples refined
    # beside vLLM in one engine's process (`--decoder refiner --refiner-windows 4`, staggered starts); GPU3=twostage
    # runs the two stages' parts: the same samples tokens only (`--scenarios NREF1 --frames 47`), then the
    # refiner alone (`bench --refiner --windows 4`: s a window, the VAE a frame) for the second stage's time
    if [ "${GPU2:-stagger}" = refiner1 ] && [ "$gpus" -ge 3 ]; then
      runs=("0 act" "1 tokens" "2 refiner1")
      say_if_no_diffusers
    fi
    if [ "${GPU3:-single}" = twostage ] && [ "$gpus" -ge 4 ]; then
      ( CUDA_VISIBLE_DEVICES=3 TERRA_STAGGER_STARTS=1 timeout "${RUN_S:-600}" python3 -m terra_cli bench \
          --scenarios "${NREF1:-64}" --frames 47 --kv-cache-dtype fp8 --out "$OUT/twostage-tokens-gpu3.json" --overwrite \
          > "$OUT/twostage-tokens-gpu3.log" 2>&1; echo "twostage tokens exit $?" >> "$STEP_LOG"
        CUDA_VISIBLE_DEVICES=3 timeout 270 python3 -m terra_cli bench --refiner --windows 4 --refiner-compile default \
          --out "$OUT/twostage-refiner-gpu3.json" --overwrite > "$OUT/twostage-refiner-gpu3.log" 2>&1
        echo "twostage refiner exit $?" >> "$STEP_LOG" ) &
      pids+=($!)
    fi
    for run in "${runs[@]}"; do
      set -- $run
      what=(--act-bench "$NAB"); env=(TERRA_STAGGER_STARTS="${GPU0_STAGGER:-0}")
      if [ "$2" = tokens ]; then what=(--scenarios "$NAB" --frames 47); fi
      if [ "$2" = act2 ]; then what=(--act-bench "$NAB" "${extra2[@]}"); env=("${gpu2[@]}"); fi
      if [ "$2" = act3 ] && [ "${GPU3:-single}" = eagerdec ]; then env=(TERRA_STAGGER_STARTS=1 TERRA_DECODER_COMPILE=0)
      elif [ "$2" = act3 ] && [ "${GPU3:-single}" = engdec ]; then env=(TERRA_STAGGER_STARTS=1 TERRA_DECODE_STREAM=engine)
      elif [ "$2" = act3 ] && [ "${GPU3:-single}" = decmax ]; then
        env=(TERRA_STAGGER_STARTS=1 TERRA_DECODER_COMPILE_MODE=max-autotune-no-cudagraphs)
      elif [ "$2" = act3 ] && [[ "${GPU3:-single}" == batch[0-9]* ]]; then
        env=(TERRA_STAGGER_STARTS=1 "TERRA_TOKENIZER_BATCH=${GPU3#batch}")
      elif [ "$2" = act3 ]; then env=(TERRA_STAGGER_STARTS=1 "PYTHONPATH=/tmp/gil-site:$PYTHONPATH" "GIL_SWITCH_S=${GIL3_S:-0.0001}"); fi
      if [ "$2" = refiner1 ]; then
        what=(--act-bench "${NREF1:-64}" --decoder refiner --refiner-windows 4); env=(TERRA_STAGGER_STARTS=1)
      fi
      if [ "$2" = tokens-inflight ]; then what=(--scenarios "${INFLIGHT:-480}" --frames 47 --max-rollouts "${INFLIGHT:-480}"); fi
      env CUDA_VISIBLE_DEVICES=$1 "${env[@]}" timeout -k "$KILL_AFTER_S" "${RUN_S:-600}" python3 -m terra_cli bench "${what[@]}" \
        --kv-cache-dtype fp8 --out "$OUT/$2-gpu$1.json" --overwrite > "$OUT/$2-gpu$1.log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    kill $watch
    echo "a/b runs done" >> "$STEP_LOG"
    [ -f /tmp/bg/warm-caches.tar.xz ] || save_warm_caches ;;  # a second startab on the host: packed already
  runs1)
    source_stamp "$OUT/commit.txt"
    build_checkpoint
    watch_gpus one-gpu.txt memory.used,utilization.gpu &
    local_watch=$!
    # ONE_FIRST=flash: issue 41's FlashAttention-3 decode variants over the row batch's cache first (~2 minutes)
    if [ "${ONE_FIRST:-}" = flash ]; then
      timeout 240 python3 benchmarks/scripts/gpu_flash_decode.py --out "$OUT/flash_decode.json" \
        > "$OUT/flash_decode.log" 2>&1; echo "flash_decode exit $?" >> "$STEP_LOG"
    fi
    # ONE_WARM=1: a short tokens-only run before the pair, so that neither of the pair meets a cold host (on
    # 2026-12-06 the first run's first minute ran its steps at 25 ms against 7-10 ms after)
    if [ "${ONE_WARM:-0}" = 1 ]; then
      timeout 240 terra bench --scenarios 32 --frames 8 --kv-cache-dtype fp8 --out "$OUT/one-warm.json" \
        > "$OUT/one-warm.log" 2>&1; echo "one-warm exit $?" >> "$STEP_LOG"
    elif [ "${ONE_WARM:-0}" = act ]; then
      # the decoder's cold compile paid here (how long its child takes beside an engine: not yet measured)
      timeout 420 terra bench --act-bench 16 --videos-at-end --kv-cache-dtype fp8 --out "$OUT/one-warm-act.json" \
        > "$OUT/one-warm-act.log" 2>&1; echo "one-warm-act exit $?" >> "$STEP_LOG"
    fi
    if [ "${ONE_PAIR:-1}" != 0 ]; then  # ONE_PAIR=0: only what ONE_AFTER names (the pair takes ~16 minutes)
      timeout 540 terra bench --scenarios "$N1" --frames 47 --kv-cache-dtype fp8 \
        --out "$OUT/one-tokens.json" > "$OUT/one-tokens.log" 2>&1; echo "one-tokens exit $?" >> "$STEP_LOG"
      # ONE_ACT=defer: the videos run with --videos-at-end (every video decoded once the engine is done; the lab
      # switch TERRA_DECODE_AFTER=1 until 2026-12-06); defer16: that with the tokenizer's decoder in batches of 16
      # (TERRA_TOKENIZER_BATCH=16: nothing shares the card with it then; alone 1.82 ms a frame against 2.48 in 8)
      act_env=() act_flag=()
      [ "${ONE_ACT:-default}" = defer ] && act_flag=(--videos-at-end)
      [ "${ONE_ACT:-default}" = defer16 ] && act_flag=(--videos-at-end) && act_env=(TERRA_TOKENIZER_BATCH=16)
      env "${act_env[@]}" timeout "${RUN_S:-600}" terra bench --act-bench "$N1" "${act_flag[@]}" --kv-cache-dtype fp8 \
        --out "$OUT/one-act-${ONE_ACT:-default}.json" > "$OUT/one-act-${ONE_ACT:-default}.log" 2>&1
      echo "one-act ${ONE_ACT:-default} exit $?" >> "$STEP_LOG"
    fi
    # ONE_AFTER=refiner (issue 40 on one GPU, overlap against two stages): NREF1 (64) samples refined beside
    # vLLM in one engine; then the two stages' parts: the same samples tokens only, and the refiner alone
    # (`bench --refiner --windows 4`: s a window, the VAE a frame; Inductor's cache is warm from the first run)
    # ONE_AFTER=refinerx: the same refined run (the product's pace), then the UNet under Inductor's autotuning
    # (`--refiner-compile max-autotune-no-cudagraphs`, 4 windows, within AUTOTUNE_S, 540 s), then 2 against 4
    # windows a call in one call (`--refiner-compile default`)
    refined_run() {
      say_if_no_diffusers
      timeout "${RUN_S:-600}" terra bench --act-bench "${NREF1:-64}" --decoder refiner --refiner-windows 4 \
        --kv-cache-dtype fp8 --out "$OUT/one-refiner1.json" > "$OUT/one-refiner1.log" 2>&1
      echo "one-refiner1 exit $?" >> "$STEP_LOG"
    }
    case "${ONE_AFTER:-probes}" in refiner|refinerx) refined_run ;; esac
    # ONE_AFTER=next (2026-11-29's plan for one GPU): issue 41's fp8 weight reads, the single-stream decoder
    # with fp8 weights and a `terra serve` session on it, then issue 40's VAE decoder probe, then, with what
    # the lease has left, the same refined run (channels-last in the product now, and the parent's compile
    # from the child's cache)
    if [ "${ONE_AFTER:-probes}" = next ]; then
      timeout 330 python3 benchmarks/scripts/gpu_fp8_rows.py --out "$OUT/fp8_rows.json" \
        > "$OUT/fp8_rows.log" 2>&1; echo "fp8_rows exit $?" >> "$STEP_LOG"
      timeout 330 python3 benchmarks/scripts/gpu_single_stream.py --models terra,mini --variants 0,13,14,9,11,15 \
        --budget-s 260 --out "$OUT/single_stream.json" > "$OUT/single_stream.log" 2>&1
      echo "single_stream exit $?" >> "$STEP_LOG"
      TERRA_SINGLE_STREAM_LAYERS=few-rows-fp8 TERRA_SINGLE_STREAM_LOGITS=few-rows-fp8 timeout 200 \
        python3 benchmarks/scripts/gpu_serve.py --only terra-size --serve-args "--backend single-stream" \
        --concurrency 1 --out "$OUT/serve-fp8" > "$OUT/serve-fp8.log" 2>&1; echo "serve fp8 exit $?" >> "$STEP_LOG"
      timeout 300 python3 benchmarks/scripts/gpu_vae_decode.py --out "$OUT/vae_decode.json" \
        > "$OUT/vae_decode.log" 2>&1; echo "vae_decode exit $?" >> "$STEP_LOG"
      refined_run
    elif [ "${ONE_AFTER:-probes}" = serve41 ] || [ "${ONE_AFTER:-probes}" = next2 ]; then
      # issue 41 after 2026-11-29's sweep: the kernel's own tiles (fp8 one row as a GEMV), few-rows logits
      # as the CUDA default, `--quantization fp8` on single-stream, and a `terra serve` session on each
      timeout 120 python3 benchmarks/scripts/gpu_fp8_rows.py --no-sweep --out "$OUT/fp8_rows.json" \
        > "$OUT/fp8_rows.log" 2>&1; echo "fp8_rows exit $?" >> "$STEP_LOG"
      timeout 300 python3 benchmarks/scripts/gpu_single_stream.py --models terra --variants "${SINGLE_VARIANTS:-0,17,19,20,21,22,23}" \
        --budget-s 200 --out "$OUT/single_stream.json" > "$OUT/single_stream.log" 2>&1
      echo "single_stream exit $?" >> "$STEP_LOG"
      for quantization in fp8 none; do
        env TERRA_SINGLE_STREAM_FLASH_PLAN="${FLASH_PLAN:-}" TERRA_SINGLE_STREAM_CACHE_WRITE="${CACHE_WRITE:-}" timeout 150 python3 benchmarks/scripts/gpu_serve.py \
          --only terra-size --concurrency 1 --serve-args "--backend single-stream --quantization $quantization" \
          --out "$OUT/serve-$quantization" > "$OUT/serve-$quantization.log" 2>&1
        echo "serve $quantization exit $?" >> "$STEP_LOG"
      done
      if [ "${ONE_AFTER:-probes}" = next2 ]; then
        # the serving session again with both of issue 41's exact lab switches, then issue 40: the VAE decoder as
        # the product now runs it (centre taps, channels-last) and in bf16, and the refined run with it
        env TERRA_SINGLE_STREAM_FLASH_PLAN=step TERRA_SINGLE_STREAM_CACHE_WRITE=fused timeout 150 python3 \
          benchmarks/scripts/gpu_serve.py --only terra-size --concurrency 1 \
          --serve-args "--backend single-stream --quantization fp8" --out "$OUT/serve-fp8-lab" \
          > "$OUT/serve-fp8-lab.log" 2>&1; echo "serve fp8 lab exit $?" >> "$STEP_LOG"
        timeout 200 python3 benchmarks/scripts/gpu_vae_decode.py --variants product,both,both-bf16 \
          --out "$OUT/vae_decode.json" > "$OUT/vae_decode.log" 2>&1; echo "vae_decode exit $?" >> "$STEP_LOG"
        refined_run
      fi
    elif [ "${ONE_AFTER:-probes}" = next4 ]; then
      # issue 41 after lease 8 (next3 there: vLLM's logits weight-major against its own head, the row batches
      # going eager past dynamo's recompile limit): `terra serve` on single-stream (row batches compiled and
      # captured at start, a session's next frame from its row's cache, frame ends in one forward) and on vLLM,
      # 1, 8 and 32 sessions of SERVE_STEPS (8) frames each; then the product's row batch alone
      serve_rows 420 1,8,32
      timeout 240 python3 benchmarks/scripts/gpu_serve.py --only terra-size --concurrency 1,8,32 \
        --steps "${SERVE_STEPS:-8}" --out "$OUT/serve-vllm" > "$OUT/serve-vllm.log" 2>&1
      echo "serve vllm exit $?" >> "$STEP_LOG"
      timeout 200 python3 benchmarks/scripts/gpu_batched_step.py --product --rows 8,32 \
        --out "$OUT/row_batch.json" > "$OUT/row_batch.log" 2>&1; echo "row_batch exit $?" >> "$STEP_LOG"
      timeout 300 python3 benchmarks/scripts/gpu_serve.py --only terra-size --concurrency 1,32 \
        --steps "${SERVE_STEPS:-8}" --serve-args "--backend single-stream --quantization fp8" --out "$OUT/serve-rows-fp8" \
        > "$OUT/serve-rows-fp8.log" 2>&1; echo "serve single-stream fp8 rows exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next5 ]; then
      # issue 41 after lease 9: the server's row batches waiting on while sessions keep asking, the sessions'
      # pictures decoded together; /metrics' counts of both are in each load's "metrics"
      serve_rows 330 1,8,32
      timeout 240 python3 benchmarks/scripts/gpu_serve.py --only terra-size --concurrency 1,16 \
        --steps "${SERVE_STEPS:-8}" --serve-args "--backend single-stream --quantization fp8" --out "$OUT/serve-rows-fp8" \
        > "$OUT/serve-rows-fp8.log" 2>&1; echo "serve single-stream fp8 rows exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next6 ]; then
      # the gather through 0.3 s gaps, up to 1 s: 32 sessions on single-stream
      serve_rows 240 32
    elif [ "${ONE_AFTER:-probes}" = next7 ]; then
      # rows that join and leave at any few steps' end, the sessions' pictures through the compiled decoder
      timeout 200 python3 benchmarks/scripts/gpu_batched_step.py --product --rows 8,32 \
        --out "$OUT/row_batch.json" > "$OUT/row_batch.log" 2>&1; echo "row_batch exit $?" >> "$STEP_LOG"
      serve_rows 360 1,8,32
      timeout 200 python3 benchmarks/scripts/gpu_serve.py --only terra-size --concurrency 32 \
        --steps "${SERVE_STEPS:-8}" --out "$OUT/serve-vllm" > "$OUT/serve-vllm.log" 2>&1
      echo "serve vllm exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next8 ]; then
      timeout 240 python3 benchmarks/scripts/gpu_batched_step.py --sessions 8,32 --frames 8 --think-ms 30 \
        --out "$OUT/sessions.json" > "$OUT/sessions.log" 2>&1; echo "sessions exit $?" >> "$STEP_LOG"
      timeout 200 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 --frames 8 --think-ms 0 \
        --out "$OUT/sessions-0ms.json" > "$OUT/sessions-0ms.log" 2>&1; echo "sessions 0ms exit $?" >> "$STEP_LOG"
      serve_rows 240 32
    elif [ "${ONE_AFTER:-probes}" = next9 ]; then
      timeout 200 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30 \
        --out "$OUT/sessions.json" > "$OUT/sessions.log" 2>&1; echo "sessions exit $?" >> "$STEP_LOG"
      serve_rows 240 32
    elif [ "${ONE_AFTER:-probes}" = next10 ]; then
      serve_rows 110 32
    elif [ "${ONE_AFTER:-probes}" = next12 ]; then
      # where a 32-row step's time goes against what it reads, then the row batch alone (lockstep)
      timeout 240 python3 benchmarks/scripts/gpu_batched_step.py --rows 8,32 --contexts 3,7,11 --heads decoder \
        --out "$OUT/batched_step.json" > "$OUT/batched_step.log" 2>&1; echo "batched_step exit $?" >> "$STEP_LOG"
      timeout 150 python3 benchmarks/scripts/gpu_batched_step.py --product --rows 8,32 \
        --out "$OUT/row_batch.json" > "$OUT/row_batch.log" 2>&1; echo "row_batch exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next13 ]; then
      # the steps' sampler compiled (the default) against eager (TERRA_SINGLE_STREAM_SAMPLER=eager), same host
      for sampler in compiled eager; do
        TERRA_SINGLE_STREAM_SAMPLER=$sampler timeout 150 python3 benchmarks/scripts/gpu_batched_step.py --product \
          --rows 8,32 --out "$OUT/row_batch-$sampler.json" > "$OUT/row_batch-$sampler.log" 2>&1
        echo "row_batch $sampler exit $?" >> "$STEP_LOG"
        TERRA_SINGLE_STREAM_SAMPLER=$sampler timeout 200 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 \
          --frames 8 --think-ms 30 --out "$OUT/sessions-$sampler.json" > "$OUT/sessions-$sampler.log" 2>&1
        echo "sessions $sampler exit $?" >> "$STEP_LOG"
      done
      serve_rows 300 1,32
    elif [ "${ONE_AFTER:-probes}" = next14 ]; then
      # a 32-row and an 8-row step's kernels under torch's profiler
      for rows in 32 8; do
        timeout 150 python3 benchmarks/scripts/gpu_batched_step.py --profile $rows \
          --out "$OUT/profile-$rows.json" > "$OUT/profile-$rows.log" 2>&1; echo "profile $rows exit $?" >> "$STEP_LOG"
      done
    elif [ "${ONE_AFTER:-probes}" = next15 ]; then
      # the layers' projections through terra's few-rows kernel against cuBLAS, at 8 and 16 rows (its tile's)
      for layers in linear few-rows; do
        TERRA_SINGLE_STREAM_LAYERS=$layers timeout 150 python3 benchmarks/scripts/gpu_batched_step.py --product \
          --rows 8,16 --out "$OUT/row_batch-$layers.json" > "$OUT/row_batch-$layers.log" 2>&1
        echo "row_batch $layers exit $?" >> "$STEP_LOG"
      done
    elif [ "${ONE_AFTER:-probes}" = next16 ]; then
      # the rows' caches in fp8 (--kv-cache-dtype fp8) against bf16, the driver alone at 32 sessions
      timeout 100 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30 \
        --kv-cache-dtype fp8 --out "$OUT/sessions-fp8.json" > "$OUT/sessions-fp8.log" 2>&1
      echo "sessions fp8 exit $?" >> "$STEP_LOG"
      timeout 100 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 --frames 8 --think-ms 30 \
        --out "$OUT/sessions-bf16.json" > "$OUT/sessions-bf16.log" 2>&1; echo "sessions bf16 exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next17 ]; then
      # the rows' fp8 caches written inside the layer functions (the default), against the writes apart (the
      # form of 2026-12-06's lease 7) and bf16: the driver alone at 32 sessions, then a 32-row step's kernels at
      # a 10-frame context in fp8 and bf16, then `terra serve` at 32 sessions with the fp8 cache
      for variant in fp8 fp8-apart bf16; do
        dtype=$([ $variant = bf16 ] || echo "--kv-cache-dtype fp8")
        write=$([ $variant = fp8-apart ] && echo separate || echo fused)
        TERRA_SINGLE_STREAM_CACHE_WRITE=$write timeout 120 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 \
          --frames 8 --think-ms 30 $dtype --out "$OUT/sessions-$variant.json" > "$OUT/sessions-$variant.log" 2>&1
        echo "sessions $variant exit $?" >> "$STEP_LOG"
      done
      for variant in fp8 bf16; do
        dtype=$([ $variant = bf16 ] || echo "--kv-cache-dtype fp8")
        timeout 150 python3 benchmarks/scripts/gpu_batched_step.py --profile 32 --profile-context 10 $dtype \
          --out "$OUT/profile-$variant.json" > "$OUT/profile-$variant.log" 2>&1; echo "profile $variant exit $?" >> "$STEP_LOG"
      done
      SERVE_ARGS_EXTRA="--kv-cache-dtype fp8" serve_rows 300 32
    elif [ "${ONE_AFTER:-probes}" = next19 ]; then
      # a 32-row step's kernels at 10-frame contexts, the rows' caches in fp8 then bf16 (~3 minutes)
      for variant in fp8 bf16; do
        dtype=$([ $variant = bf16 ] || echo "--kv-cache-dtype fp8")
        timeout 110 python3 benchmarks/scripts/gpu_batched_step.py --profile 32 --profile-context 10 $dtype \
          --out "$OUT/profile-$variant.json" > "$OUT/profile-$variant.log" 2>&1; echo "profile $variant exit $?" >> "$STEP_LOG"
      done
    elif [ "${ONE_AFTER:-probes}" = next20 ]; then
      # the fp8 cache's one-query steps through terra's paged decode kernel against FlashAttention-3: a 32-row
      # step's kernels at 10-frame contexts, then the driver alone at 32 sessions (~4 minutes)
      for kernel in terra flash; do
        TERRA_SINGLE_STREAM_DECODE_KERNEL=$kernel timeout 100 python3 benchmarks/scripts/gpu_batched_step.py --profile 32 \
          --profile-context 10 --kv-cache-dtype fp8 --out "$OUT/profile-$kernel.json" > "$OUT/profile-$kernel.log" 2>&1
        echo "profile $kernel exit $?" >> "$STEP_LOG"
      done
      for kernel in terra flash; do
        TERRA_SINGLE_STREAM_DECODE_KERNEL=$kernel timeout 100 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 \
          --frames 8 --think-ms 30 --kv-cache-dtype fp8 --out "$OUT/sessions-$kernel.json" > "$OUT/sessions-$kernel.log" 2>&1
        echo "sessions $kernel exit $?" >> "$STEP_LOG"
      done
    elif [ "${ONE_AFTER:-probes}" = blocks ]; then
      # vLLM's KV-cache block size for many rollouts (issue 37's engine; 2026-12-06: FA3's fp8 decode over the
      # single-stream cache ran 17% faster in pages of 256 than of 16): tokens only, 128 scenarios of 25 frames,
      # fp8 cache, terra's kernel (the default) and FlashAttention-3, blocks of 16 (vLLM's) against 256 and 64
      # (~3 minutes each, within RUN_S; BLOCK_VARIANTS names fewer, or a variant twice for paired repeats;
      # BLOCK_FRAMES 47 is ACT-Bench's shape)
      run=0
      for variant in ${BLOCK_VARIANTS:-terra-16 terra-256 vllm-16 vllm-256 terra-64}; do
        run=$((run + 1))
        timeout "${BLOCK_RUN_S:-240}" terra bench --scenarios "${NBLOCK:-128}" --frames "${BLOCK_FRAMES:-25}" \
          --kv-cache-dtype fp8 --attention "${variant%-*}" --vllm-arg "block_size=${variant#*-}" \
          --out "$OUT/blocks-$run-$variant.json" > "$OUT/blocks-$run-$variant.log" 2>&1
        echo "blocks $run $variant exit $?" >> "$STEP_LOG"
      done
    elif [ "${ONE_AFTER:-probes}" = decoder ]; then
      # the tokenizer's decoder alone on the host of the pair (eager and compiled, batches of 8 and 16)
      timeout 200 python3 benchmarks/scripts/writer_parts.py --out "$OUT/writer_parts.json" \
        > "$OUT/writer_parts.log" 2>&1; echo "writer_parts exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = drain ]; then
      # --videos-at-end's drain alone (no engine): each batch waited for, against the product's batch kept
      # queued on the card, twice each, NDRAIN (192) videos (~3 minutes)
      timeout 480 python3 benchmarks/scripts/gpu_drain.py --videos "${NDRAIN:-192}" \
        --variants one,ahead,one,ahead --out "$OUT/drain.json" > "$OUT/drain.log" 2>&1
      echo "drain exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = next18 ]; then
      # `terra serve` on single-stream at 32 sessions, the rows' caches in fp8, then bf16 (~6 minutes)
      SERVE_ARGS_EXTRA="--kv-cache-dtype fp8" serve_rows 200 32 -fp8
      serve_rows 200 32 -bf16
    elif [ "${ONE_AFTER:-probes}" = pictures ]; then
      # `terra serve` on single-stream at 1 and 32 sessions, pictures padded to batches of 8, then one a call (~7 minutes)
      SERVE_ARGS_EXTRA="--picture-batch 8" serve_rows 230 1,32 -pic8
      serve_rows 230 1,32 -pic1
      # fp8 weights at 32 sessions in one row batch (the few-rows kernel's 32-row tile; before, batches of 16)
      [ "${PICTURES_FP8:-1}" = 0 ] || SERVE_ARGS_EXTRA="--quantization fp8" serve_rows 200 32 -fp8w
    elif [ "${ONE_AFTER:-probes}" = pictures32 ]; then
      # the same at 32 sessions only, 4 frames a session, then fp8 weights at 32 (~7 minutes: the end of a lease)
      SERVE_STEPS=4 SERVE_ARGS_EXTRA="--picture-batch 8" serve_rows 130 32 -pic8
      SERVE_STEPS=4 serve_rows 130 32 -pic1
      [ "${PICTURES_FP8:-1}" = 0 ] || SERVE_STEPS=4 SERVE_ARGS_EXTRA="--quantization fp8" serve_rows 170 32 -fp8w
    elif [ "${ONE_AFTER:-probes}" = refinerx ]; then
      timeout "${AUTOTUNE_S:-540}" terra bench --refiner --windows 4 --refiner-compile max-autotune-no-cudagraphs \
        --out "$OUT/refiner-autotune.json" > "$OUT/refiner-autotune.log" 2>&1; echo "refiner autotune exit $?" >> "$STEP_LOG"
      timeout 300 terra bench --refiner --windows 2,4 --refiner-compile default \
        --out "$OUT/refiner-windows.json" > "$OUT/refiner-windows.log" 2>&1; echo "refiner windows exit $?" >> "$STEP_LOG"
    elif [ "${ONE_AFTER:-probes}" = none ]; then
      :  # the pair (and its warm-up) alone
    elif [ "${ONE_AFTER:-probes}" = refiner ]; then
      timeout 270 terra bench --refiner --windows 4 --refiner-compile default \
        --out "$OUT/twostage-refiner.json" > "$OUT/twostage-refiner.log" 2>&1; echo "twostage refiner exit $?" >> "$STEP_LOG"
      timeout "${RUN_S:-600}" terra bench --scenarios "${NREF1:-64}" --frames 47 --kv-cache-dtype fp8 \
        --out "$OUT/twostage-tokens.json" > "$OUT/twostage-tokens.log" 2>&1; echo "twostage tokens exit $?" >> "$STEP_LOG"
    else
      timeout 300 terra bench --env 64 --steps 8 --branches 8 --fork-from 20 --kv-cache-dtype fp8 \
        --out "$OUT/env.json" > "$OUT/env.log" 2>&1; echo "env exit $?" >> "$STEP_LOG"
      timeout 150 python3 benchmarks/scripts/writer_parts.py --out "$OUT/writer_parts.json" \
        > "$OUT/writer_parts.log" 2>&1; echo "writer_parts exit $?" >> "$STEP_LOG"
    fi
    kill $local_watch ;;
  flashpage)
    # in the call (after `start1`'s runs): 32 sessions on the driver alone with the fp8 cache read in pages of
    # 256 (the default since a87ccf1) and of 16, then a 32-row step's kernels at 10-frame contexts in pages of
    # 256 (~5 minutes; logs into $OUT)
    for page in 256 16; do
      TERRA_SINGLE_STREAM_FLASH_PAGE=$page timeout 110 python3 benchmarks/scripts/gpu_batched_step.py --sessions 32 \
        --frames 8 --think-ms 30 --kv-cache-dtype fp8 --out "$OUT/sessions-page$page.json" 2>&1 | tail -4
    done
    timeout 110 python3 benchmarks/scripts/gpu_batched_step.py --profile 32 --profile-context 10 --kv-cache-dtype fp8 \
      --out "$OUT/profile-page256.json" > "$OUT/profile-page256.log" 2>&1; tail -25 "$OUT/profile-page256.log" ;;
  await)
    await_background pipe "${AWAIT_S:-540}"
    await_background top 0
    await_warm_caches ;;
  *) echo "usage: gpu_pipeline.sh start|runs|startfull|runsfull|startref|runsref|start1|runs1|start2|runs2|startab|runsab|await" >&2; exit 2 ;;
esac
