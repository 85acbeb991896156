#!/usr/bin/env bash
# The product CLI on a GPU host whose vLLM bundle is unpacked in /tmp/site (../shared/notes/gpu-host.md).
#   product  terra generate with the default model; terra bench --scenarios with an fp8 KV cache on
#            Terra-size random weights; a bad --kv-cache-dtype refused in one line
#   draft    terra-mini, greedy: the same tokens with and without --draft previous-frame, and no
#            vLLM warning about terra's model classes
# Wheels from .gpu/wheels (compressed-tensors, loguru, imageio-ffmpeg) are unpacked into /tmp/site.
# Logs tee'd into $OUT.
set -uo pipefail
what=${1:-product}
STEP_LOG=${OUT:-/tmp/out}/smoke.log
source benchmarks/scripts/gpu_common.sh
# Only what the host lacks (other wheels there, such as gpu_tests.sh's, must not shadow its packages).
gpu_setup .gpu/wheels/{compressed_tensors,loguru,imageio_ffmpeg}-*.whl || exit 1
case $what in
  product)
    step generate 200 generate "$OUT/mini.mp4" --frames 10 --actions left --seed 1 --save-tokens "$OUT/mini.npy"
    step bad-kv 60 bench --scenarios 2 --kv-cache-dtype fp9
    step scenarios-fp8 300 bench --scenarios 64 --frames 8 --max-rollouts 64 --kv-cache-dtype fp8 --out "$OUT/scenarios-fp8.json" ;;
  draft)
    common=(--frames 8 --actions left --temperature 0 --seed 1)
    step greedy 200 generate "$OUT/greedy.mp4" "${common[@]}" --save-tokens "$OUT/greedy.npy"
    step greedy-draft 200 generate "$OUT/greedy-draft.mp4" "${common[@]}" --save-tokens "$OUT/greedy-draft.npy" --draft previous-frame --draft-tokens 4
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/smoke.log"
import sys, pathlib, numpy as np
out = pathlib.Path(sys.argv[1])
a, b = np.load(out / "greedy.npy"), np.load(out / "greedy-draft.npy")
print(f"greedy tokens with and without the draft: {(a == b).mean():.4%} equal of {a.size} ({a.shape})")
warnings = [line for name in ("greedy", "greedy-draft") for line in (out / f"{name}.log").read_text().splitlines()
            if "WARNING" in line and "terra_cli" in line]
print(f"vLLM warnings naming terra's classes: {len(warnings)}", *warnings[:4], sep="\n")
PY
    ;;
esac
