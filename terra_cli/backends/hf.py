"""The transformers reference backend: a plain KV-cached token loop over `modeling_hf`, and its
driver (`ReferenceDriver`: the one driver interface of backends/driver.py, a lockstep batch of
compatible jobs at a time).

Readable rather than fast; it is what the vLLM backend is checked and benchmarked against.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from terra_cli.models.config import FrameLayout
from terra_cli.models.modeling_hf import LlamaActionForCausalLM, load_model
from terra_cli.backends.base import FrameCallback, Sampling, check_generation_inputs
from terra_cli.backends.device_sampling import filtered_probabilities, greedy_codes
from terra_cli.backends.batch_driver import BatchAtATimeDriver
from terra_cli.backends.driver import take_cancelled
from terra_cli.seeds import draw_seed, rollout_seed


def sample_next(logits: torch.Tensor, layout: FrameLayout, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """Next image code per row of logits (R, V). The special id and anything above is never drawn."""
    if sampling.greedy:
        return greedy_codes(logits, layout)
    probs = filtered_probabilities(logits, layout, sampling)
    # Exponential race (argmax of p / Exp(1) draws a code with probability p): one kernel per
    # row, where torch.multinomial over 2^18 codes is slow on GPU. One generator per rollout,
    # so a rollout's tokens do not depend on what it is batched with (terra_cli/seeds.py).
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
    *,
    seeds: list[int] | None = None,
    first_frame: int = 0,
) -> np.ndarray:
    """One round in lockstep: (R, num_frames, T) tokens, context included. Row r draws frame f
    (within the round) with the generator seeded `draw_seed(seeds[r], first_frame + f)`: `seeds`
    are the rollouts' own seeds (default `sampling.seed + r`), `first_frame` the round's first frame
    in the whole video."""
    layout = model.layout
    context, actions = check_generation_inputs(layout, context_tokens, action_waypoints, num_frames)
    device = model.lm_head.weight.device
    rollouts, k = context.shape[:2]
    seeds = [rollout_seed(sampling.seed, r) for r in range(rollouts)] if seeds is None else list(seeds)
    if len(seeds) != rollouts:
        raise ValueError(f"{len(seeds)} seeds for {rollouts} rollouts")
    generators = [torch.Generator(device=device) for _ in range(rollouts)]
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
            for generator, seed in zip(generators, seeds):
                generator.manual_seed(draw_seed(seed, first_frame + f))
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
    quantization = None  # the checkpoint's own weights, always

    def __init__(self, checkpoint_dir=None, *, device: str | None = None, dtype: str | None = None, model=None):
        from terra_cli.runtime import resolve_device, resolve_dtype

        self.device = resolve_device(device)
        self.model = model if model is not None else load_model(checkpoint_dir, self.device, resolve_dtype(dtype, self.device))
        self.config = self.model.config

    def generate(self, context_tokens, action_waypoints, num_frames, sampling, on_frame=None, *,
                 first_frame: int = 0) -> np.ndarray:
        return generate_frames(self.model, context_tokens, action_waypoints, num_frames, sampling, on_frame,
                               first_frame=first_frame)

    def driver(self, max_in_flight: int = 1, stagger_starts: bool = False) -> "ReferenceDriver":
        return ReferenceDriver(self, max_in_flight)  # its batches advance frame by frame together anyway

    def auto_in_flight(self, longest_frames: int, cap: int) -> tuple[int, str]:
        """Rollouts at once when none is asked for: one (a lockstep batch only pays on a GPU, where
        --max-rollouts N asks for it)."""
        return 1, "the reference backend runs one rollout at a time unless --max-rollouts says more"

    def close(self) -> None:
        self.model = None


class _BatchCancelled(Exception):
    pass


class ReferenceDriver(BatchAtATimeDriver):
    """The reference backend behind the driver interface (backends/driver.py): takes a job, then
    up to `max_in_flight - 1` more waiting jobs of the same shape and sampling, and generates them
    together in lockstep, round by round. A cancelled job is reported at once and its row is
    dropped from what is reported; the batch stops early when every job of it is cancelled."""

    def _run_batch(self, batch, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        import time

        from terra_cli.pipeline.rounds import plan_rounds

        clock = time.perf_counter
        lead = batch[0]
        k, total = lead.context.shape[0], lead.total_frames
        frames = np.zeros((len(batch), total, self.layout.image_tokens), dtype=np.int64)
        frames[:, :k] = np.stack([job.context for job in batch])
        actions = np.stack([np.asarray(job.actions[: total - 1], dtype=np.float32) for job in batch])
        seeds = [job.sampling.seed for job in batch]
        live = list(range(len(batch)))
        handling = [0.0]

        def frame_done(offset: int, local: int, tokens: np.ndarray) -> None:
            began = clock()
            index = offset + local
            frames[:, index] = tokens
            self.loop.steps += self.layout.image_tokens  # the token steps of this frame, all rows at once
            for row in list(live):
                if take_cancelled(feed, batch[row], on_cancelled):
                    live.remove(row)
                elif on_frame is not None:
                    on_frame(batch[row], index, frames[row, index])
            handling[0] += clock() - began
            if not live:
                raise _BatchCancelled

        started = clock()
        try:
            for rnd in plan_rounds(k, total, self.layout.max_frames):
                context = frames[:, rnd.first_frame : rnd.first_frame + rnd.context_frames]
                generate_frames(self.backend.model, context, actions[:, rnd.first_frame : rnd.end - 1], rnd.num_frames,
                                lead.sampling, lambda local, tokens, _o=rnd.first_frame: frame_done(_o, local, tokens),
                                seeds=seeds, first_frame=lead.frame_offset + rnd.first_frame)
        except _BatchCancelled:
            return
        except Exception as exc:  # these jobs failed alone (a bad job); the engine goes on
            if on_error is None:
                raise
            for row in live:
                on_error(batch[row], exc)
            return
        finally:
            self.loop.frames_s += handling[0]
            self.loop.step_s += clock() - started - handling[0]
        for row in live:
            if on_done is not None:
                on_done(batch[row], frames[row])
