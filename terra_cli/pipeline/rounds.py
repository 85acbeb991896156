"""Rounds: Terra's schedule for videos longer than one 25-frame round, over any backend.

Each round re-seeds with the last RESEED_FRAMES frames of the one before and restarts temporal
positions. Both drivers (backends/driver.py) plan a job's rounds here; `generate_tokens` runs a
lockstep request of R rollouts through the backend's driver. A round does not restart the random
stream: draws follow the frame's index in the whole video (terra_cli/seeds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """All frames' tokens (R, total_frames, T), context included, over as many rounds as needed:
    one `RolloutJob` per rollout (seeded `sampling.seed + r`) through the backend's driver, which
    plans the rounds (`plan_rounds`) and draws by terra_cli/seeds.py.

    `context_tokens` (R, K, T) or (K, T); `action_waypoints` (R, F, A, 3) or (F, A, 3) with
    F >= total_frames - 1, indexed by global frame number. `on_frame(index, tokens (R, T))`.
    """
    from terra_cli.backends.driver import rollout_jobs, run_lockstep

    actions = np.asarray(action_waypoints, dtype=np.float32)
    context = np.asarray(context_tokens)
    if actions.ndim in (3, 4) and actions.shape[-3] < total_frames - 1:
        raise InputError(
            f"{total_frames} frames need actions for at least {total_frames - 1} frames "
            f"(the last frame's is never used), got {actions.shape[-3]}"
        )
    plan_rounds(context.shape[-2], total_frames, backend.config.layout.max_frames)  # the frame limits, in one place
    jobs = rollout_jobs(context, actions, total_frames, sampling)
    return run_lockstep(backend.driver(len(jobs)), jobs, on_frame)
