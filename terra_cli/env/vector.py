"""`TerraVectorEnv`: N closed-loop driving environments on one loaded world model.

Each `step(actions (N, 6, 3))` makes one `RolloutJob` per environment (its next frame, built as a
server session's step: the frames of the Terra round it falls in, `frame_offset` that round's
first frame, affinity the environment) and runs the N jobs through the backend's one driver
(backends/driver.py) together: one lockstep batch on the reference, one continuous batch on vLLM.
Environment i reset with seed s draws with seed s + i (terra_cli/seeds.py), so a fixed action
sequence gives the tokens of `terra generate --seed s+i` with those actions.

Branches (`fork`, `select`): a branch copies an environment's frames and action rows and draws
with its own seed, `seeds.branch_seed(root, c)` = root + 2**20 * c for the c-th branch forked in
the lineage of the environment reset with seed `root` (never an environment's seed: seeds.py).

What a branch shares on vLLM: StreamDriver gives each job with a new affinity its own slot, whose
prompts carry the cache salt of the rows they use; a branch's jobs name their parent
(`RolloutJob.prefix_of`), so its first frame borrows the parent's salt and action ids for the rows
they share and is served the state's prefix from the parent's cached blocks
(backends/vllm_slots.py); every later frame of the branch reuses its own prefix: only the new
frame's 582 tokens are computed. `info["cached_tokens"]` and `info["prompt_tokens"]` (vLLM only)
count, for the step's requests, the prompt tokens served from the prefix cache and all prompt
tokens. On the reference backend nothing is cached: every step recomputes its round's prompt.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from terra_cli.backends.base import Sampling
from terra_cli.env.contexts import context_actions, context_tokens
from terra_cli.env.engine import EnvEngine
from terra_cli.env.state import EnvState
from terra_cli.errors import InputError
from terra_cli.pipeline.rounds import MAX_TOTAL_FRAMES
from terra_cli.seeds import MAX_ENVIRONMENTS, MAX_SEED, Lineage, branch_seed, check_seed_range

OBSERVATIONS = ("pixels", "tokens", "both")
FRAME_SECONDS = 0.1  # Terra's 10 Hz
WAYPOINT_LOW = np.tile(np.array([-250.0, -250.0, 0.0], dtype=np.float32), (6, 1))  # (y m, x m, t s)
WAYPOINT_HIGH = np.tile(np.array([250.0, 250.0, 10.0], dtype=np.float32), (6, 1))
_ids = itertools.count()


def single_spaces(layout, image_size, observation: str):
    tokens = spaces.Box(0, layout.image_vocab_size - 1, (layout.image_tokens,), np.int64)
    pixels = spaces.Box(0, 255, (*image_size, 3), np.uint8)
    obs = {"pixels": pixels, "tokens": tokens, "both": spaces.Dict({"pixels": pixels, "tokens": tokens})}[observation]
    return obs, spaces.Box(WAYPOINT_LOW, WAYPOINT_HIGH, (layout.action_tokens, 3), np.float32)


class TerraVectorEnv(VectorEnv):
    """N environments on one backend (+ an image tokenizer for pixels and image contexts).

    `observation`: "pixels" ((H, W, 3) uint8 per environment, decoded in one batch), "tokens"
    ((576,) int64 codes, nothing decoded) or "both" (a Dict). `max_frames`: an environment is
    truncated once it holds that many frames, context included (at most 100); stepping it again
    needs a reset (autoreset is off). Sampling: `sampling`'s temperature, top-k and top-p; the
    seeds come from `reset`. Rewards are 0 and nothing terminates: add reward wrappers.
    """

    metadata = {"autoreset_mode": AutoresetMode.DISABLED, "render_modes": []}

    def __init__(self, num_envs: int = 1, *, backend, tokenizer=None, observation: str = "pixels",
                 max_frames: int = MAX_TOTAL_FRAMES, sampling: Sampling | None = None,
                 max_in_flight: int | None = None, speed_kmh: float = 30.0, owns_backend: bool = False):
        if observation not in OBSERVATIONS:
            raise InputError(f"observation must be one of {', '.join(OBSERVATIONS)}, got {observation!r}")
        if not 1 <= num_envs <= MAX_ENVIRONMENTS:
            raise InputError(f"num_envs must be from 1 to {MAX_ENVIRONMENTS}, got {num_envs}")
        if not 2 <= max_frames <= MAX_TOTAL_FRAMES:
            raise InputError(f"max_frames must be from 2 to {MAX_TOTAL_FRAMES}, got {max_frames}")
        if observation != "tokens" and tokenizer is None:
            raise InputError(f"observation={observation!r} needs an image tokenizer (tokenizer=)")
        self.layout = backend.config.layout
        self.tokenizer, self.observation, self.max_frames = tokenizer, observation, max_frames
        self.sampling = sampling or Sampling()
        self.speed_kmh = speed_kmh
        self.engine = EnvEngine(backend, max_in_flight or max(num_envs, 64), owns_backend=owns_backend)
        image_size = tuple(tokenizer.image_size) if tokenizer is not None else (288, 512)
        self.single_observation_space, self.single_action_space = single_spaces(self.layout, image_size, observation)
        self.states: list[EnvState] = []
        self._resize(num_envs)
        self._context_cache: dict = {}
        self._steps = 0
        self.last_step_seconds = 0.0  # wall time of the last step (generation and decoding)

    @classmethod
    def load(cls, num_envs: int = 1, *, model: str | None = None, tokenizer: str | None = None,
             backend: str = "auto", device: str = "auto", dtype: str = "auto", threads: int = 0,
             max_in_flight: int | None = None, engine_options: dict | None = None, **kwargs) -> "TerraVectorEnv":
        """Load a world model (default: the embedded terra-mini) and its tokenizer, and build the env."""
        from terra_cli.models.resolve import resolve_model
        from terra_cli.pipeline.world_model import Engine, load_world_model
        from terra_cli.runtime import configure_vllm_env

        # Before vLLM is imported, as the CLI and a Ray engine do (settings the caller made stay; the
        # reference backend reads none of them).
        configure_vllm_env()
        choice = resolve_model(model, "world_model", tokenizer)
        in_flight = max_in_flight or max(num_envs, 64)
        world = load_world_model(choice, Engine(backend, device, dtype, threads, dict(engine_options or {})),
                                 needs_tokenizer=choice.tokenizer is not None, max_rollouts=in_flight)
        return cls(num_envs, backend=world.backend, tokenizer=world.tokenizer, max_in_flight=in_flight,
                   owns_backend=True, **kwargs)

    def _resize(self, num_envs: int) -> None:
        from gymnasium.vector.utils import batch_space

        self.num_envs = num_envs
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)

    # -- reset ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Environment i starts from its context and draws with seed `seed + i` (None: a base seed
        from `np_random`, itself seeded by the last explicit seed). Options:
        `context` (one for all; terra_cli/env/contexts.py says what it may be) or `contexts` (one
        per environment); `context_frames` (how many frames of a video or the sample road; 3);
        `context_actions`: the waypoints between the context frames, (K - 1, 6, 3), one per
        environment (N, K - 1, 6, 3), or a preset name; default: the first step's action."""
        if self.engine.closed:  # else reset would encode and answer, and the next step fail
            raise InputError("the environment is closed")
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = set(options) - {"context", "contexts", "context_frames", "context_actions"}
        if unknown:
            raise InputError(f"unknown reset option(s) {sorted(unknown)}: context, contexts, context_frames, "
                             "context_actions")
        if seed is None:
            seed = int(self.np_random.integers(0, MAX_SEED - MAX_ENVIRONMENTS))
        check_seed_range(seed, self.num_envs, "seed")
        if "contexts" in options and "context" in options:
            raise InputError("give context (one for all) or contexts (one per environment), not both")
        contexts = options.get("contexts", [options.get("context")] * self.num_envs)
        if isinstance(contexts, (str, bytes, Path, dict)):  # a sequence of contexts, not one split into parts
            raise InputError("contexts is a list of one context per environment; for one for all, give context")
        if len(contexts) != self.num_envs:
            raise InputError(f"contexts holds {len(contexts)} contexts for {self.num_envs} environments")
        count = options.get("context_frames")
        if count is not None and (isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1):
            raise InputError(f"context_frames must be a whole number of at least 1, got {count!r}")
        actions = options.get("context_actions")
        per_env = not isinstance(actions, str) and actions is not None and np.asarray(actions).ndim == 4
        states = []
        for i, context in enumerate(contexts):
            tokens = context_tokens(context, count, self.tokenizer, self.layout, self._context_cache)
            if tokens.shape[0] >= self.max_frames:
                raise InputError(f"environment {i}: {tokens.shape[0]} context frames leave no frame below "
                                 f"max_frames={self.max_frames}")
            rows = context_actions(actions[i] if per_env else actions, tokens.shape[0], self.speed_kmh)
            root = seed + i
            states.append(EnvState(f"env{next(_ids)}", replace(self.sampling, seed=root), Lineage(root),
                                   tokens.shape[0], list(tokens), list(rows) if rows is not None else []))
        self.states = states
        return self._observe([s.tokens[-1] for s in states]), self._info()

    # -- step -------------------------------------------------------------------------------

    def check_actions(self, actions) -> np.ndarray:
        """(N, 6, 3) finite float32 waypoints, or one InputError; nothing is submitted before."""
        try:
            array = np.asarray(actions)
            if array.dtype.kind not in "iuf":  # bool, complex, strings, or ints past int64 (object)
                raise TypeError(f"got {array.dtype} values")
            array = array.astype(np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InputError(f"actions must be real numbers of shape ({self.num_envs}, 6, 3): {exc}") from None
        expected = (self.num_envs, self.layout.action_tokens, 3)
        if array.shape != expected:
            raise InputError(f"actions must have shape {expected} (one (y, x, t) waypoint row per environment), "
                             f"got {array.shape}")
        with np.errstate(over="ignore"):
            array = array.astype(np.float32)
        bad = sorted({int(i) for i in np.nonzero(~np.isfinite(array).reshape(self.num_envs, -1).all(axis=1))[0]})
        if bad:
            raise InputError(f"actions of environment(s) {bad} contain NaN or inf (or numbers beyond float32)")
        return array

    def step(self, actions):
        if not self.states:
            raise InputError("call reset() before step()")
        waypoints = self.check_actions(actions)
        full = [i for i, s in enumerate(self.states) if s.frames >= self.max_frames]
        if full:
            raise InputError(f"environment(s) {full} hold max_frames={self.max_frames} frames (truncated): reset first")
        began = time.perf_counter()
        self._steps += 1
        planned = [state.next_job(waypoints[i], self.layout, self._steps) for i, state in enumerate(self.states)]
        cache_before = self.engine.prefix_cache
        frames = self.engine.run([job for job, _ in planned])
        for state, (_, rows), frame in zip(self.states, planned, frames):
            state.tokens.append(np.asarray(frame, dtype=np.int64))
            state.rows = rows
        observation = self._observe(frames)
        self.last_step_seconds = time.perf_counter() - began
        info = self._info()
        cache_after = self.engine.prefix_cache
        if cache_before is not None and cache_after is not None:
            info["cached_tokens"] = cache_after[0] - cache_before[0]
            info["prompt_tokens"] = cache_after[1] - cache_before[1]
        truncated = np.array([s.frames >= self.max_frames for s in self.states])
        return (observation, np.zeros(self.num_envs), np.zeros(self.num_envs, dtype=bool), truncated, info)

    def _observe(self, frames: list[np.ndarray]):
        tokens = np.stack([np.asarray(f, dtype=np.int64) for f in frames])
        if self.observation == "tokens":
            return tokens
        pixels = self.tokenizer.decode_tokens(tokens)
        return pixels if self.observation == "pixels" else {"pixels": pixels, "tokens": tokens}

    def _info(self) -> dict:
        frame = np.array([s.frames - 1 for s in self.states], dtype=np.int64)  # the newest frame's index
        mask = np.ones(self.num_envs, dtype=bool)
        return {"frame": frame, "_frame": mask, "seconds": frame * FRAME_SECONDS, "_seconds": mask.copy(),
                "seed": np.array([s.sampling.seed for s in self.states], dtype=np.int64), "_seed": mask.copy()}

    # -- branches ---------------------------------------------------------------------------

    def fork(self, index: int, branches: int) -> list[int]:
        """Append `branches` copies of environment `index` (its frames and action rows); each
        draws with its lineage's next branch seed (module docstring). Returns their indices."""
        if not self.states:
            raise InputError("call reset() before fork()")
        if not 0 <= index < self.num_envs:
            raise InputError(f"fork: index must be from 0 to {self.num_envs - 1}, got {index}")
        if not 1 <= branches <= MAX_ENVIRONMENTS - self.num_envs:
            raise InputError(f"fork: branches must be from 1 to {MAX_ENVIRONMENTS - self.num_envs}, got {branches}")
        parent = self.states[index]
        branch_seed(parent.lineage.root_seed, parent.lineage.branches + branches, "fork: the last branch's seed")
        new = [parent.branch(f"env{next(_ids)}") for _ in range(branches)]
        first = self.num_envs
        self.states.extend(new)
        self._resize(len(self.states))
        return list(range(first, self.num_envs))

    def select(self, indices) -> None:
        """Keep only the environments `indices` (distinct), in that order, or those where a boolean
        mask of num_envs entries is True."""
        array = np.asarray(indices)
        if array.dtype == bool and array.shape == (self.num_envs,):
            array = np.flatnonzero(array)
        elif array.size and array.dtype.kind not in "iu":  # a float index or a mask of another length: no guess
            raise InputError(f"select: indices must be integers (or a boolean mask of {self.num_envs}), "
                             f"got {array.dtype} {array.tolist()}")
        chosen = [int(i) for i in array.reshape(-1)]
        if not chosen or any(not 0 <= i < self.num_envs for i in chosen) or len(set(chosen)) != len(chosen):
            raise InputError(f"select: indices must be distinct, from 0 to {self.num_envs - 1}, at least one; "
                             f"got {chosen}")
        self.states = [self.states[i] for i in chosen]
        self._resize(len(self.states))

    def tokens(self, index: int) -> np.ndarray:
        """Every frame of environment `index` so far, context included: (frames, T) int64."""
        return np.stack(self.states[index].tokens)

    def close_extras(self, **kwargs) -> None:
        self.engine.close()
