"""The transformers reference backend: a plain KV-cached token loop over `modeling_hf`.

Readable rather than fast; it is what the vLLM backend is checked and benchmarked against.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from terra_cli.models.config import FrameLayout
from terra_cli.models.modeling_hf import LlamaActionForCausalLM, load_model
from terra_cli.backends.base import FrameCallback, Sampling, check_generation_inputs


def sample_next(logits: torch.Tensor, layout: FrameLayout, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """Next image code per row of logits (R, V). The special id and anything above is never drawn."""
    logits = logits[:, : layout.image_vocab_size].float()
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    # Exponential race (argmax of p / Exp(1) draws a code with probability p): one kernel per
    # row, where torch.multinomial over 2^18 codes is slow on GPU. One generator per rollout,
    # so a rollout's tokens do not depend on what it is batched with.
    race = torch.stack([torch.empty_like(p).exponential_(generator=g) for p, g in zip(probs, generators)])
    return (probs / race).argmax(dim=-1)


def _attention_backends(device: torch.device):
    """SDPA kernels for the token loop.

    On an H100, torch's default choice is cuDNN attention, which builds an execution plan for
    every key length it has not seen, i.e. for every decode step of a new frame: measured 76.7
    ms/step on fresh lengths against 14.0 once planned, and 19.6 / 14.7 with flash or
    memory-efficient attention (benchmarks/scripts/gpu_profile.py hf, benchmarks/README.md).
    """
    from contextlib import nullcontext

    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.inference_mode()
def generate_frames(
    model: LlamaActionForCausalLM,
    context_tokens: np.ndarray,
    action_waypoints: np.ndarray,
    num_frames: int,
    sampling: Sampling,
    on_frame: FrameCallback | None = None,
) -> np.ndarray:
    layout = model.layout
    context, actions = check_generation_inputs(layout, context_tokens, action_waypoints, num_frames)
    device = model.lm_head.weight.device
    rollouts, k = context.shape[:2]
    generators = [torch.Generator(device=device).manual_seed(sampling.rollout_seed(r)) for r in range(rollouts)]
    frames = torch.empty((rollouts, num_frames, layout.image_tokens), dtype=torch.long, device=device)
    frames[:, :k] = torch.tensor(context, device=device)
    actions_t = torch.tensor(actions, device=device)
    placeholders = torch.full((rollouts, layout.action_tokens), layout.action_placeholder_id, device=device)

    # Prefill: every context frame followed by its action slots.
    prompt = torch.cat([frames[:, :k], placeholders.unsqueeze(1).expand(-1, k, -1)], dim=2).reshape(rollouts, -1)
    positions = torch.arange(prompt.shape[1], device=device).expand(rollouts, -1)
    with _attention_backends(device):
        cache = DynamicCache(config=model.config)
        logits, cache = model(prompt, positions, actions_t[:, :k].reshape(rollouts, -1, 3), cache, use_cache=True, logits_to_keep=1)
        next_position = prompt.shape[1]

        for f in range(k, num_frames):
            for i in range(layout.image_tokens):
                token = sample_next(logits[:, -1], layout, sampling, generators)
                frames[:, f, i] = token
                step_ids, step_actions = token[:, None], None
                if i == layout.image_tokens - 1:
                    if f == num_frames - 1:
                        break
                    # The frame's last code and its action slots go in together; the last slot
                    # predicts the first code of the next frame.
                    step_ids = torch.cat([step_ids, placeholders], dim=1)
                    step_actions = actions_t[:, f]
                n = step_ids.shape[1]
                positions = torch.arange(next_position, next_position + n, device=device).expand(rollouts, -1)
                logits, cache = model(step_ids, positions, step_actions, cache, use_cache=True, logits_to_keep=1)
                next_position += n
            if on_frame is not None:
                on_frame(f, frames[:, f].cpu().numpy())
    return frames.cpu().numpy()


class HfBackend:
    name = "hf"

    def __init__(self, checkpoint_dir=None, *, device: str | None = None, dtype: str | None = None, model=None):
        from terra_cli.runtime import resolve_device, resolve_dtype

        self.device = resolve_device(device)
        self.model = model if model is not None else load_model(checkpoint_dir, self.device, resolve_dtype(dtype, self.device))
        self.config = self.model.config

    def generate(self, context_tokens, action_waypoints, num_frames, sampling, on_frame=None) -> np.ndarray:
        return generate_frames(self.model, context_tokens, action_waypoints, num_frames, sampling, on_frame)

    def close(self) -> None:
        self.model = None
