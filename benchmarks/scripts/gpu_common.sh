# Sourced by the GPU lab scripts (gpu_smoke.sh, gpu_compile.sh): the environment every command on
# the GPU host needs (../shared/notes/gpu-host.md), terra installed from this checkout, and `step`,
# which runs one terra command under a time limit with its log in $OUT.
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEP_LOG=${STEP_LOG:-$OUT/summary.txt}  # where every step's command, tail and exit code go

# Every `timeout` of the scripts that source this: at its limit a run gets SIGTERM, which terra takes as Ctrl-C,
# writing what finished first; with the refiner that ran ~60 s past a limit (2026-11-29), device time no one
# asked for. KILL_AFTER_S (30) later it is killed (`env ... timeout` calls the binary: pass -k "$KILL_AFTER_S").
KILL_AFTER_S=${KILL_AFTER_S:-30}
timeout() { command timeout -k "$KILL_AFTER_S" "$@"; }

gpu_setup() {  # WHEEL...: unpack these into /tmp/site (what the host lacks), install terra, name the GPU
  local wheel
  for wheel in "$@"; do
    [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" /tmp/site
  done
  chmod +x /tmp/site/imageio_ffmpeg/binaries/* 2>/dev/null  # zip extraction drops the executable bit
  # TERRA_INSTALLED: a caller that installed terra already and starts two scripts at once (one pip each would race)
  [ -n "${TERRA_INSTALLED:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 ||
    { echo "pip install -e . failed"; return 1; }
  nvidia-smi -L | tee "$OUT/gpu.txt"
}

RUN_MARK=$(mktemp /tmp/terra-run-mark.XXXXXX)  # files in $OUT newer than this are this run's (pack_out)
touch -d "@$(($(date +%s) - 1))" "$RUN_MARK"  # a second back: a file written within the clock's tick is not newer

pack_out() {  # NAME: the files this run wrote in $OUT as $OUT/NAME.tgz (NAME-2.tgz, ... where an earlier run's
  # tarball holds the name), beside summary.txt: the device returns at most 8 files (a 2026-12-07 call lost two
  # runs' results to that limit); older files stay as they are, and so do this run's earlier tarballs (a chain of
  # subcommands packs once each)
  local list packed target=$OUT/$1.tgz n=1
  while [ -e "$target" ]; do n=$((n + 1)); target=$OUT/$1-$n.tgz; done
  list=$(mktemp) packed=$(mktemp)
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name '*.tgz' -newer "$RUN_MARK" > "$list")
  tar czf "$packed" -C "$OUT" -T "$list" && (cd "$OUT" && xargs -d '\n' -r rm -f < "$list") &&
    find "$OUT" -mindepth 1 -type d -empty -newer "$RUN_MARK" -delete && chmod 644 "$packed" && mv -n "$packed" "$target"
  rm -f "$list" "$packed"
}

build_checkpoint() {  # the random Terra checkpoint built once, before runs that would race to build it
  python3 -c "from terra_cli.bench.cache import random_terra_checkpoint as r; r('cuda', 0)" \
    > "$OUT/build.log" 2>&1; echo "checkpoint exit $?" >> "$STEP_LOG"
}

serve_rows() {  # LIMIT_S SESSIONS [SUFFIX]: `terra serve` on single-stream, SERVE_STEPS frames a session (8), at the
  # sessions of SESSIONS (comma-separated), SERVE_ARGS_EXTRA more server options, SERVE_STEP_FORMAT what a step
  # answers (jpeg, or tokens: no picture); logs as $OUT/serve-rowsSUFFIX
  timeout "$1" python3 benchmarks/scripts/gpu_serve.py --only terra-size --concurrency "$2" \
    --step-format "${SERVE_STEP_FORMAT:-jpeg}" --steps "${SERVE_STEPS:-8}" --serve-args "--backend single-stream ${SERVE_ARGS_EXTRA:-}" --out "$OUT/serve-rows${3:-}" \
    > "$OUT/serve-rows${3:-}.log" 2>&1; echo "serve single-stream rows${3:-} exit $?" >> "$STEP_LOG"
}

step() {  # NAME LIMIT_S TERRA_ARGS...: the log in $OUT/NAME.log; command, tail and exit code in $STEP_LOG
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name: terra $*" | tee -a "$STEP_LOG"
  timeout "$limit" python3 -m terra_cli "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  grep -v "^INFO\|^(EngineCore\|Capturing CUDA graphs\|Loading safetensors\|frame [0-9]*/" "$OUT/$name.log" |
    tail -20 | tee -a "$STEP_LOG"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$STEP_LOG"
}

watch_gpu_memory() {  # NAME: sample every GPU's used memory each second into $OUT/NAME-memory.csv until stop_gpu_memory
  nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,nounits -lms 1000 \
    > "$OUT/$1-memory.csv" 2>/dev/null &
  GPU_MEMORY_PID=$!
  GPU_MEMORY_NAME=$1
}

stop_gpu_memory() {  # the peak per GPU into $STEP_LOG (writer processes beside vLLM's 85%: how close to the card's limit)
  kill "$GPU_MEMORY_PID" 2>/dev/null
  awk -F', ' '{if ($3 > peak[$2]) peak[$2] = $3; total[$2] = $4} END {for (g in peak) printf "GPU %s peak %d of %d MiB\n", g, peak[g], total[g]}' \
    "$OUT/$GPU_MEMORY_NAME-memory.csv" | tee -a "$STEP_LOG"
}

# A run longer than one device call (10 minutes): start it in its own process session, which
# outlives the call while the machine stays held, and collect it in a later call. Its log, exit
# code and files live in /tmp/bg/NAME (each call empties $OUT).
in_background() {  # NAME COMMAND...: COMMAND runs with OUT=/tmp/bg/NAME; returns at once
  local name=$1
  shift
  # A second run of NAME on the same host (a second round): the first one's folder, rc included, moves
  # aside, or the await would find the old rc at once and pack the old files.
  if [ -d "/tmp/bg/$name" ]; then
    [ -e "/tmp/bg/$name/rc" ] || { echo "== $name: still running, not started again" | tee -a "$STEP_LOG"; return 1; }
    mv "/tmp/bg/$name" "/tmp/bg/$name.$(date +%s)"
  fi
  mkdir -p "/tmp/bg/$name"
  OUT=/tmp/bg/$name STEP_LOG=/tmp/bg/$name/summary.txt setsid bash -c '"$@" > "$OUT/background.log" 2>&1; echo $? > "$OUT/rc"' \
    background "$@" < /dev/null > /dev/null 2>&1 &
  echo "== $name: started in the background: $*" | tee -a "$STEP_LOG"
}

# The device tool returns what is under $OUT even when a call outruns its limit, and a call's limit can
# be lower than asked (the lease's budget counts while a reply is read): an await that packed only at its
# end lost a whole run's results (2026-11-28, afternoon). So the pack is refreshed every minute meanwhile,
# written under another name and renamed, so a call ended mid-pack leaves the last whole one.
pack_background() {  # NAME: /tmp/bg/NAME into $OUT/NAME.tar.gz, replaced whole
  tar -C /tmp/bg -czf "$OUT/$1.partial" "$1" && mv "$OUT/$1.partial" "$OUT/$1.tar.gz"
}

await_background() {  # NAME LIMIT_S: wait up to LIMIT_S for NAME, then pack /tmp/bg/NAME into $OUT/NAME.tar.gz
  local name=$1 limit=$2 t0=$SECONDS packed=$SECONDS
  while [ ! -e "/tmp/bg/$name/rc" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do
    sleep 5
    if [ $((SECONDS - packed)) -ge 60 ]; then pack_background "$name"; packed=$SECONDS; fi
  done
  if [ -e "/tmp/bg/$name/rc" ]; then
    echo "== $name: finished, exit $(cat "/tmp/bg/$name/rc")" | tee -a "$STEP_LOG"
  else
    echo "== $name: still running after $limit s more" | tee -a "$STEP_LOG"
  fi
  tail -25 "/tmp/bg/$name/summary.txt" 2>/dev/null | tee -a "$STEP_LOG"
  pack_background "$name"
}

# Compile caches across leases (each lease is a fresh host): Triton's (terra's attention kernel, vLLM's
# sampler) and Inductor's under TERRA_CACHE (the tokenizer's decoder). `save_warm_caches` packs them
# into /tmp/bg/warm-caches.tar.xz (outside any run's folder, so a large pack never costs a run's
# results) and `await_warm_caches` hands it back in $OUT when it is under the 16 MiB a file may
# have; kept here as .gpu/warm/, a later lease carrying .gpu/warm runs `restore_warm_caches` first.
# A run on restored caches is what a second run on the same machine sees: say which one a number is.
save_warm_caches() {
  local parts=()
  [ -d "$HOME/.triton/cache" ] && parts+=("$HOME/.triton/cache")
  [ -n "${TERRA_CACHE:-}" ] && [ -d "$TERRA_CACHE/inductor" ] && parts+=("$TERRA_CACHE/inductor")
  [ ${#parts[@]} -gt 0 ] || return 0
  # packed under another name and renamed when whole: an `await` that ends while the pack is being
  # written must find none, not a truncated one (the sixth lease's came back cut off)
  tar -cJPf /tmp/bg/warm-caches.partial "${parts[@]}" 2>/dev/null && mv /tmp/bg/warm-caches.partial /tmp/bg/warm-caches.tar.xz
  echo "warm caches packed: $(du -h /tmp/bg/warm-caches.tar.xz | cut -f1) (${parts[*]})" >> "$STEP_LOG"
}

await_warm_caches() {
  local pack=/tmp/bg/warm-caches.tar.xz
  [ -f "$pack" ] || return 0
  if [ "$(stat -c %s "$pack")" -lt $((16 * 1024 * 1024)) ]; then
    cp "$pack" "$OUT/warm-caches.tar.xz"
  else
    echo "warm caches: $(du -h "$pack" | cut -f1), over the 16 MiB a file may have: not returned" | tee -a "$STEP_LOG"
  fi
}

restore_warm_caches() {
  if [ -f .gpu/warm/warm-caches.tar.xz ]; then
    tar --skip-old-files -xJPf .gpu/warm/warm-caches.tar.xz && echo "warm caches restored from an earlier lease" >> "$STEP_LOG"
  fi
}


source_stamp() {  # FILE: what code ran. The host's .git can lag the tree a call carries (its HEAD then names an
  # older commit than the files), so beside HEAD goes a hash of the Python sources as they are on disk; here,
  # `bash -c 'source benchmarks/scripts/gpu_common.sh; source_stamp /dev/stdout'` at a commit gives the same hash.
  { git log --oneline -1 2>/dev/null || echo "no git"
    echo "sources $(find terra_cli tokenizer_decoder -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 cat | sha1sum | cut -c1-12)"
  } > "$1"
}
