"""The one small interface both world-model backends implement, and what they share.

A backend takes context frames as tokens and per-frame action waypoints and returns every
frame's tokens. It knows nothing about images, files or the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

if TYPE_CHECKING:  # annotations only: models.config imports transformers, seconds that a command's
    # input checks (which build a Sampling first) must not wait for
    from terra_cli.models.config import FrameLayout, LlamaActionConfig
from terra_cli.errors import InputError  # noqa: F401  (part of the backend interface)

MAX_TEMPERATURE = 100.0  # far above any useful value; sampling at higher ones is uniform noise
MAX_TOP_K = 2**24
from terra_cli.seeds import MAX_SEED  # noqa: E402  (the seed rule's range)

# on_frame(frame_index, frame_tokens (rollouts, image_tokens)) after each generated frame.
FrameCallback = Callable[[int, np.ndarray], None]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings. temperature 0 is greedy; top_k 0 and top_p 1.0 mean no filter."""

    temperature: float = 0.9  # Terra's default
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        # Written as `not (ok)` so that NaN, which fails every comparison, is refused too.
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise InputError(f"--temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise InputError(f"--top-k must be from 0 (off) to {MAX_TOP_K}, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InputError(f"--top-p must be in (0, 1] (1.0: off), got {self.top_p}")
        if not (0 <= self.seed <= MAX_SEED):
            raise InputError(f"--seed must be from 0 to {MAX_SEED} (2**63 - 2**16), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def same_rule(self, other: "Sampling") -> bool:
        """Whether `other` samples by the same settings, whatever its seed (rollouts that may share a batch)."""
        return (self.temperature, self.top_k, self.top_p) == (other.temperature, other.top_k, other.top_p)


class WorldModelBackend(Protocol):
    name: str
    config: LlamaActionConfig
    quantization: str | None  # fp8: weights approximated at load (`--quantization`); None: the checkpoint's own

    def driver(self, max_in_flight: int = 1, stagger_starts: bool = False):
        """The one driver interface over this backend (backends/driver.py): what every front-end runs.
        `stagger_starts`: spread the rollouts' starts over a frame's steps, so that equal-length jobs
        do not finish their frames in the same step (batch runs ask for it when
        `runtime.stagger_starts_asked()`; a server or a vector environment never does)."""
        ...

    def generate(
        self,
        context_tokens: np.ndarray,
        action_waypoints: np.ndarray,
        num_frames: int,
        sampling: Sampling,
        on_frame: FrameCallback | None = None,
    ) -> np.ndarray:
        """context_tokens (R, K, 576) int, action_waypoints (R, >= num_frames - 1, 6, 3) float
        -> all frames' tokens, context included, (R, num_frames, 576) int64: one round in lockstep,
        the primitive under the drivers and the benches."""
        ...

    def close(self) -> None: ...


def weights_note(quantization: str | None) -> str:
    """What a run's lines add when the weights are not the checkpoint's own (a backend's `quantization`)."""
    return f", {quantization} weights (an approximation of the model)" if quantization else ""


def check_generation_inputs(
    layout: FrameLayout, context_tokens: np.ndarray, action_waypoints: np.ndarray, num_frames: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise the inputs of `generate` (one round: at most `layout.max_frames`).

    Returns (context int64 (R, K, T), actions float32 (R, num_frames - 1, A, 3)).
    """
    context = np.asarray(context_tokens)
    if context.ndim == 2:
        context = context[None]
    if context.ndim != 3 or context.shape[2] != layout.image_tokens:
        raise InputError(f"context tokens must have shape (frames, {layout.image_tokens}), got {np.shape(context_tokens)}")
    if not np.issubdtype(context.dtype, np.integer):
        raise InputError(f"context tokens must be integers, got {context.dtype}")
    if context.size and (context.min() < 0 or context.max() >= layout.image_vocab_size):
        raise InputError(
            f"context tokens must be image codes in [0, {layout.image_vocab_size - 1}], "
            f"found {int(context.min())}..{int(context.max())}"
        )
    rollouts, k = context.shape[:2]
    if k < 1:
        raise InputError("at least one context frame is needed")
    if not k < num_frames <= layout.max_frames:
        raise InputError(
            f"a round must have more frames than its {k} context frame(s) and at most {layout.max_frames}, got {num_frames}"
        )
    actions = np.asarray(action_waypoints, dtype=np.float32)
    if actions.ndim == 3:
        actions = actions[None]
    if actions.ndim != 4 or actions.shape[2:] != (layout.action_tokens, 3):
        raise InputError(f"actions must have shape (frames, {layout.action_tokens}, 3), got {np.shape(action_waypoints)}")
    if actions.shape[0] == 1 and rollouts > 1:
        actions = np.broadcast_to(actions, (rollouts, *actions.shape[1:]))
    if context.shape[0] == 1 and actions.shape[0] > 1:
        context = np.broadcast_to(context, (actions.shape[0], *context.shape[1:]))
    if actions.shape[0] != context.shape[0]:
        raise InputError(f"{context.shape[0]} context rollouts but {actions.shape[0]} action rollouts")
    if actions.shape[1] < num_frames - 1:
        raise InputError(
            f"{num_frames} frames need actions for at least {num_frames - 1} frames (the last frame's is never used), "
            f"got {actions.shape[1]}"
        )
    if not np.isfinite(actions).all():
        raise InputError("actions contain NaN or inf")
    return np.ascontiguousarray(context, dtype=np.int64), np.ascontiguousarray(actions[:, : num_frames - 1])
