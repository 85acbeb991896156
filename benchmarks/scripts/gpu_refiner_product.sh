#!/usr/bin/env bash
# Issue 40 on the GPU host: the refiner's product path, compiled and batched across videos.
#
#   bench    `terra bench --refiner` (random weights in Terra's exact shapes, bf16): s per window for
#            each VARIANT at each of WINDOWS windows per UNet call, one process (and one compile) each:
#              eager     --refiner-compile none
#              compiled  --refiner-compile default (what a GPU run gets by default)
#              graphs    --refiner-compile reduce-overhead (CUDA graphs)
#              autotune  --refiner-compile max-autotune (autotuned kernels + CUDA graphs; long compile)
#              fp8       --refiner-compile default --refiner-dtype fp8 (the UNet's transformer Linear
#                        layers in float8, torch._scaled_mm); the log's "fp8:" line and the JSON's "fp8"
#                        give the PSNR of one refined window against the same weights in bf16
#              fp8-eager --refiner-compile none --refiner-dtype fp8
#            Inductor's cache is under $TERRA_CACHE/inductor (kept in /tmp/terra-cache while the
#            machine is held): a second call of the same variant shows the cached compile time.
#   product  the product path on CUDA with a tiny world model and a tiny refiner (seconds mean
#            nothing): `terra generate --scenarios --decoder refiner --refiner-windows 2` with
#            --refiner-compile none, default and reduce-overhead (the stage compiles and captures
#            graphs in its own thread), then `terra refine`; checks that every run writes its videos,
#            that the compile line is logged, and how far the videos are from the eager ones.
#
# Usage (from the checkout, wheels /tmp/site lacks as arguments, e.g. diffusers' and its
# importlib_metadata/zipp), one device call each:
#   OUT=/tmp/out VARIANTS=eager WINDOWS="1 2 4 8" bash benchmarks/scripts/gpu_refiner_product.sh bench [WHEEL...]
#   OUT=/tmp/out VARIANTS=compiled bash benchmarks/scripts/gpu_refiner_product.sh bench [WHEEL...]
#   OUT=/tmp/out VARIANTS=graphs bash benchmarks/scripts/gpu_refiner_product.sh bench [WHEEL...]
#   OUT=/tmp/out VARIANTS="compiled fp8" WINDOWS=1 bash benchmarks/scripts/gpu_refiner_product.sh bench [WHEEL...]
#   OUT=/tmp/out bash benchmarks/scripts/gpu_refiner_product.sh product [WHEEL...]
# Each bench step has its own limit (LIMIT_S, default 240 s) and none starts after BUDGET_S (default
# 480 s), so a call ends inside the 10-minute device limit; what did not run says "skipped (time)".
# Files in $OUT: summary.txt, gpu.txt, refiner-<variant>-w<N>.json and .log; product-*.log, product.json.
set -u
cd "$(dirname "$0")/../.."
MODE=${1:-bench}
shift || true
source benchmarks/scripts/gpu_common.sh
gpu_setup "$@" || exit 1
python3 -c "import diffusers, torch; print('diffusers', diffusers.__version__, 'torch', torch.__version__)" | tee -a "$STEP_LOG" || exit 1
export TERRA_CACHE=${TERRA_CACHE:-/tmp/terra-cache}
LIMIT_S=${LIMIT_S:-240}
BUDGET_S=${BUDGET_S:-480}

bench_one() {  # VARIANT WINDOWS
  local variant=$1 windows=$2 mode t0=$SECONDS rc name dtype=auto
  case $variant in
    eager) mode=none ;; compiled) mode=default ;; graphs) mode=reduce-overhead ;; autotune) mode=max-autotune ;;
    fp8) mode=default dtype=fp8 ;; fp8-eager) mode=none dtype=fp8 ;;
    *) echo "unknown variant $variant" | tee -a "$STEP_LOG"; return ;;
  esac
  name=refiner-$variant-w$windows
  if [ "$SECONDS" -gt "$BUDGET_S" ]; then echo "== $name: skipped (time)" | tee -a "$STEP_LOG"; return; fi
  echo "== $name: terra bench --refiner --windows $windows --refiner-compile $mode --refiner-dtype $dtype" | tee -a "$STEP_LOG"
  timeout "$LIMIT_S" python3 -m terra_cli bench --refiner --windows "$windows" --refiner-compile "$mode" \
    --refiner-dtype "$dtype" --out "$OUT/$name.json" --overwrite > "$OUT/$name.log" 2>&1
  rc=$?
  grep -E "compiled|window\(s\) per call|fp8:|rror" "$OUT/$name.log" | tail -5 | tee -a "$STEP_LOG"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$STEP_LOG"
}

product() {
  local folder=/tmp/refiner-product
  rm -rf "$folder" && mkdir -p "$folder"
  python3 - "$folder" <<'EOF' || return 1
import json, sys
from pathlib import Path
import numpy as np
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.refiner.testing import write_tiny_refiner
from tokenizer_decoder import ImageTokenizer, small_config
root = Path(sys.argv[1])
write_tiny_checkpoint(root / "model", tiny_config(image_vocab=1024, layers=1, hidden_size=32, heads=1))
ImageTokenizer.from_config(small_config(ch=32, num_res_blocks=1), device="cpu").save_pretrained(root / "tok")
write_tiny_refiner(root / "refiner.pt")
np.save(root / "ctx.npy", np.random.default_rng(0).integers(0, 1024, size=(24, 576)))
lines = [{"id": f"v{i}", "context": "ctx.npy", "actions": ["left", "right"][i % 2], "frames": 47, "seed": i} for i in range(6)]
(root / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
EOF
  local mode
  for mode in none default reduce-overhead; do
    step "product-$mode" 240 generate --scenarios "$folder/s.jsonl" --out-dir "$folder/out-$mode" --model "$folder/model" \
      --tokenizer "$folder/tok" --backend hf --device cuda --decoder refiner --refiner "$folder/refiner.pt" \
      --refiner-windows 2 --refiner-compile "$mode"
  done
  step product-refine 120 refine "$folder/out-default/v0.npy" "$folder/refined-v0.mp4" --refiner "$folder/refiner.pt" \
    --tokenizer "$folder/tok" --device cuda --seed 0 --refiner-windows 2
  python3 - "$folder" "$OUT/product.json" <<'EOF' | tee -a "$STEP_LOG"
import json, sys
from pathlib import Path
import numpy as np
from terra_cli.media.frames import read_frames
root, result = Path(sys.argv[1]), {}
def frames(path):
    return np.stack(read_frames(path)).astype(int) if path.is_file() else None
for mode in ("default", "reduce-overhead"):
    diffs = []
    for i in range(6):
        a, b = frames(root / "out-none" / f"v{i}.mp4"), frames(root / f"out-{mode}" / f"v{i}.mp4")
        diffs.append(None if a is None or b is None else round(float(np.abs(a - b).mean()), 3))
    result[mode] = diffs
a, b = frames(root / "out-default" / "v0.mp4"), frames(root / "refined-v0.mp4")
result["refine_vs_scenario_v0"] = None if a is None or b is None else round(float(np.abs(a - b).mean()), 3)
print("mean |difference| per video against eager (mp4 levels):", json.dumps(result))
Path(sys.argv[2]).write_text(json.dumps(result, indent=1))
EOF
}

case $MODE in
  bench)
    for variant in ${VARIANTS:-eager compiled graphs}; do
      for windows in ${WINDOWS:-1 2 4 8}; do bench_one "$variant" "$windows"; done
    done ;;
  product) product ;;
  *) echo "usage: $0 bench|product [WHEEL...]"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/gpu.txt"
cat "$STEP_LOG"
