#!/usr/bin/env bash
# Brings vLLM 0.25 and the wheels the GPU host lacks onto it, one part per device call (one call
# carries at most 64 MiB with the checkout): ../shared/notes/gpu-host.md says how .gpu/ is built.
#   a1   (carry .gpu/a1: vLLM part a, first half, + small pure-Python wheels such as diffusers)
#   a2   (carry .gpu/a2: part a, second half; unpacks part a)
#   b    (carry .gpu/vllm-b: the rest of vLLM; installs terra from this checkout)
#   ff   (carry .gpu/ff: imageio-ffmpeg's wheel, for mp4 writing; for `bench --env`, the env extra: `pip download
#        --no-deps -d .gpu/ff gymnasium farama-notifications cloudpickle`)
#   ray  (carry .gpu/ray: ray-site.tar.xz, Ray and its dependencies unpacked, into /tmp/raysite)
# /tmp survives between calls while the machine is held: make the calls back to back.
set -euo pipefail
shopt -s nullglob  # a part folder may hold no wheels
mkdir -p /tmp/dl /tmp/site
case "$1" in
  a1) cp .gpu/a1/a-part.aa /tmp/dl/
      for w in .gpu/a1/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done ;;
  a2) cat /tmp/dl/a-part.aa .gpu/a2/a-part.ab | tar -C /tmp/site -xJf - && rm /tmp/dl/a-part.aa ;;
  b)  tar -C /tmp/site -xJf .gpu/vllm-b/part.tar.xz
      PYTHONPATH=/tmp/site python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . ;;
  ff) for w in .gpu/ff/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
      chmod +x /tmp/site/imageio_ffmpeg/binaries/* ;;
  ray) mkdir -p /tmp/raysite && tar -C /tmp/raysite -xJf .gpu/ray/ray-site.tar.xz ;;
  *) echo "usage: gpu_bundle.sh a1|a2|b|ff|ray" >&2; exit 2 ;;
esac
du -sh /tmp/site /tmp/raysite 2>/dev/null || true; nvidia-smi -L
