"""`TerraEnv`: one closed-loop driving environment, a `gymnasium.Env` over a one-environment
`TerraVectorEnv` (the same engine, jobs, seeds and options; observations without the batch axis)."""

from __future__ import annotations

import gymnasium

from terra_cli.env.vector import TerraVectorEnv


class TerraEnv(gymnasium.Env):
    """`TerraEnv(backend=..., tokenizer=..., observation=..., max_frames=...)` takes
    TerraVectorEnv's arguments; `TerraEnv.load(...)` loads a model (default: terra-mini). reset's
    seed s draws as `terra generate --seed s`; its options are TerraVectorEnv.reset's."""

    metadata = {"render_modes": []}

    def __init__(self, *, vector: TerraVectorEnv | None = None, **kwargs):
        self.vector = vector if vector is not None else TerraVectorEnv(1, **kwargs)
        if self.vector.num_envs != 1:
            raise ValueError("TerraEnv wraps a one-environment TerraVectorEnv")
        self.observation_space = self.vector.single_observation_space
        self.action_space = self.vector.single_action_space

    @classmethod
    def load(cls, **kwargs) -> "TerraEnv":
        return cls(vector=TerraVectorEnv.load(1, **kwargs))

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:  # draw the base seed here, so that reset() after reset(seed=s) repeats
            seed = int(self.np_random.integers(0, 2**62))
        observation, info = self.vector.reset(seed=seed, options=options)
        return self._one(observation), self._one_info(info)

    def step(self, action):
        import numpy as np

        from terra_cli.errors import InputError

        expected = (self.vector.layout.action_tokens, 3)
        try:
            waypoints = np.asarray(action, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputError(f"the action must be numbers of shape {expected}: {exc}") from None
        if waypoints.shape != expected:
            raise InputError(f"the action must have shape {expected} ((y, x, t) waypoints), got {waypoints.shape}")
        observation, reward, terminated, truncated, info = self.vector.step(waypoints[None])
        return self._one(observation), float(reward[0]), bool(terminated[0]), bool(truncated[0]), self._one_info(info)

    def tokens(self):
        """Every frame so far, context included: (frames, T) int64."""
        return self.vector.tokens(0)

    def close(self):
        self.vector.close()

    @staticmethod
    def _one(observation):
        if isinstance(observation, dict):
            return {key: value[0] for key, value in observation.items()}
        return observation[0]

    @staticmethod
    def _one_info(info: dict) -> dict:
        return {key: (value[0].item() if hasattr(value, "shape") and value.shape else value)
                for key, value in info.items() if not key.startswith("_")}
