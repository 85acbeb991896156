#!/usr/bin/env bash
# The GPU-marked tests (`pytest -m gpu`: tests/test_gpu_parity.py, test_tokenizer.py) on a GPU host whose vLLM bundle is
# unpacked in /tmp/site (../shared/notes/gpu-host.md). pytest and its pure-Python dependencies come
# as wheels in .gpu/wheels (or $WHEELS), unpacked into /tmp/wheel-site and appended to sys.path after the host's
# site-packages, so the host's own packages win. The measured numbers land in $OUT/parity-*.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/wheel-site
for w in ${WHEELS:-.gpu/wheels}/*.whl; do python3 -m zipfile -e "$w" /tmp/wheel-site; done
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi -L | tee "$OUT/gpu.txt"
run_pytest='import sys; sys.path.append("/tmp/wheel-site"); import pytest; sys.exit(pytest.main(sys.argv[1:]))'
OUT=$OUT timeout 540 python3 -c "$run_pytest" -m gpu -p no:cacheprovider -p no:logging -q --tb=short tests/test_gpu_parity.py tests/test_tokenizer.py 2>&1 | grep -v "^DEBUG" | tail -60 | tee "$OUT/pytest.log"
cat "$OUT"/parity*.json 2>/dev/null
