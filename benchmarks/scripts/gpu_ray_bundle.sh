#!/usr/bin/env bash
# Build Ray for the offline GPU host (Python 3.12, manylinux x86_64), on a machine with PyPI access:
#   bash benchmarks/scripts/gpu_ray_bundle.sh [.gpu]
# ray 2.60.0 and what the host lacks of its dependencies (jsonschema, jsonschema-specifications,
# referencing, rpds-py; click, filelock, msgpack, packaging, protobuf, pyyaml, requests and attrs are
# there), installed for cp312 into a staging folder, without the Java worker (ray/jars, 32 MB) and the
# dashboard's web build (terra starts Ray without a dashboard), then tar.xz (~38 MB; the wheel is 79 MB)
# split in two parts of at most 27 MB: DIR/ray1/ray.tar.xz.aa and DIR/ray2/ray.tar.xz.ab, each carried
# by its own device call (benchmarks/scripts/gpu_ray.sh says how).
set -euo pipefail
dest=${1:-.gpu}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
python3 -m pip install -q --target "$stage/site" --no-deps --platform manylinux2014_x86_64 --python-version 3.12 \
  --implementation cp --only-binary=:all: ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1
rm -rf "$stage/site/bin" "$stage/site/ray/jars" "$stage/site/ray/dashboard/client/build"
mkdir -p "$dest/ray1" "$dest/ray2"
tar -C "$stage/site" -cf - . | xz -T0 -6 > "$stage/ray.tar.xz"
split -b 27000000 "$stage/ray.tar.xz" "$stage/ray.tar.xz."
mv "$stage/ray.tar.xz.aa" "$dest/ray1/"
mv "$stage/ray.tar.xz.ab" "$dest/ray2/"
ls -la "$dest/ray1" "$dest/ray2"
