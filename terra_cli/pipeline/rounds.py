"""Rounds: Terra's schedule for videos longer than one 25-frame round, over any backend.

Each round re-seeds with the last RESEED_FRAMES frames of the one before and restarts temporal
positions; `generate_tokens` runs the rounds and is the only caller of `backend.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from terra_cli.backends.base import FrameCallback, InputError, Sampling, WorldModelBackend

# Terra's long-video schedule: each new round re-seeds with this many frames of the last one.
RESEED_FRAMES = 3
MAX_TOTAL_FRAMES = 100


@dataclass(frozen=True)
class Round:
    first_frame: int  # global index of the round's first (context) frame
    context_frames: int
    num_frames: int  # context included

    @property
    def end(self) -> int:
        return self.first_frame + self.num_frames


def plan_rounds(context_frames: int, total_frames: int, frames_per_round: int) -> list[Round]:
    """Rounds of at most `frames_per_round` frames; temporal positions restart every round."""
    if total_frames > MAX_TOTAL_FRAMES:
        raise InputError(f"--frames {total_frames} is above the supported maximum of {MAX_TOTAL_FRAMES}")
    if total_frames <= context_frames:
        raise InputError(f"--frames ({total_frames}) must be more than the {context_frames} context frame(s)")
    if context_frames >= frames_per_round:
        raise InputError(f"{context_frames} context frames leave no room in a {frames_per_round}-frame round")
    rounds = [Round(0, context_frames, min(total_frames, frames_per_round))]
    reseed = min(RESEED_FRAMES, frames_per_round - 1)
    while rounds[-1].end < total_frames:
        start = rounds[-1].end - reseed
        rounds.append(Round(start, reseed, min(total_frames - start, frames_per_round)))
    return rounds


def generate_tokens(
    backend: WorldModelBackend,
    context_tokens: np.ndarray,
    action_waypoints: np.ndarray,
    total_frames: int,
    sampling: Sampling,
    on_frame: FrameCallback | None = None,
) -> np.ndarray:
    """All frames' tokens (R, total_frames, T), context included, over as many rounds as needed.

    `context_tokens` (R, K, T) or (K, T); `action_waypoints` (R, F, A, 3) or (F, A, 3) with
    F >= total_frames - 1, indexed by global frame number.
    """
    layout = backend.config.layout
    context = np.asarray(context_tokens)
    if context.ndim == 2:
        context = context[None]
    actions = np.asarray(action_waypoints, dtype=np.float32)
    if actions.ndim == 3:
        actions = actions[None]
    if actions.ndim == 4 and actions.shape[1] < total_frames - 1:
        raise InputError(
            f"{total_frames} frames need actions for at least {total_frames - 1} frames "
            f"(the last frame's is never used), got {actions.shape[1]}"
        )
    rollouts = max(context.shape[0], actions.shape[0] if actions.ndim == 4 else 1)
    frames = np.zeros((rollouts, total_frames, layout.image_tokens), dtype=np.int64)
    k = context.shape[1]
    frames[:, :k] = context
    for round_index, rnd in enumerate(plan_rounds(k, total_frames, layout.max_frames)):
        round_context = frames[:, rnd.first_frame : rnd.first_frame + rnd.context_frames] if rnd.first_frame else context
        round_actions = actions[:, rnd.first_frame : rnd.end - 1] if actions.ndim == 4 else actions

        def forward_frame(local_index: int, tokens: np.ndarray, _offset=rnd.first_frame) -> None:
            if on_frame is not None:
                on_frame(_offset + local_index, tokens)

        # A fresh random stream per round, still fully determined by --seed.
        round_sampling = replace(sampling, seed=sampling.seed + 100_003 * round_index)
        out = backend.generate(round_context, round_actions, rnd.num_frames, round_sampling, on_frame=forward_frame)
        frames[:, rnd.first_frame : rnd.end] = out
    return frames
