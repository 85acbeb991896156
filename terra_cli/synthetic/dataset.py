"""Ego motion and rollouts in the synthetic world: dead reckoning from Terra's actions, rendering
of rollouts, and the random trajectories terra-mini was trained on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from terra_cli.actions import (
    FRAME_DT,
    PRESETS,
    TRAJ_DT,
    WAYPOINT_TIMES,
    _step_motion,
    normalize_actions,
    preset_actions,
)
from terra_cli.synthetic.camera import _rng
from terra_cli.synthetic.world import make_world

# --------------------------------------------------------------------------------------------
# Ego motion and rollouts


def rollout_poses(actions: np.ndarray, start_pose=(0.0, 0.0, 0.0)) -> np.ndarray:
    """(F, 3) float64 world poses (x, y, yaw) of frames 0..F-1.

    Frame 0 is at `start_pose`; frame k+1 is frame k moved by the motion over 0.1 s that frame k's
    waypoints imply (a quadratic in time through the origin and the first two waypoints gives the
    position and the heading change, as `terra_cli.actions.summarize_actions` dead-reckons).
    """
    actions = normalize_actions(actions).astype(np.float64)
    poses = np.zeros((actions.shape[0], 3))
    x, y, th = (float(v) for v in start_pose)
    for k in range(actions.shape[0]):
        poses[k] = (x, y, th)
        dx, dy, dth = _step_motion(actions[k])
        c, s = math.cos(th), math.sin(th)
        x, y, th = x + c * dx - s * dy, y + s * dx + c * dy, th + dth
    return poses


def render_rollout(
    world_seed: int,
    actions: np.ndarray,
    *,
    start_s: float = 0.0,
    lane: int | None = None,
    lateral: float = 0.0,
    heading: float = 0.0,
) -> np.ndarray:
    """(F, 288, 512, 3) uint8 frames of the ego driving `actions` in world `world_seed`.

    The ego starts at arc length `start_s` in `lane` (default: the world's ego lane; 0 = rightmost),
    offset by `lateral` m (+ left) and `heading` rad from the lane direction.
    """
    world = make_world(world_seed)
    poses = rollout_poses(actions, world.start_pose(start_s, lane, lateral, heading))
    return np.stack([world.render(p) for p in poses])


def render_frame(world_seed: int, pose) -> np.ndarray:
    """(288, 512, 3) uint8: world `world_seed` seen from world pose (x, y, yaw)."""
    return make_world(world_seed).render(pose)


def trajectory_to_actions(x: np.ndarray, y: np.ndarray, th: np.ndarray, frames: int) -> np.ndarray:
    """(frames, 6, 3) actions from a trajectory sampled every 0.05 s (at least 2 (frames - 1) + 60 samples).

    Frame k (t = 0.1 k s, sample 2k) gets the positions at samples 2k + 9, 2k + 19, ..., 2k + 59
    (t + 0.45 ... t + 2.95 s) in its own ego frame.
    """
    steps_per_frame = int(round(FRAME_DT / TRAJ_DT))
    offsets = np.rint(WAYPOINT_TIMES / TRAJ_DT).astype(int)
    out = np.empty((frames, len(offsets), 3), np.float64)
    for k in range(frames):
        i = steps_per_frame * k
        c, s = math.cos(th[i]), math.sin(th[i])
        dx, dy = x[i + offsets] - x[i], y[i + offsets] - y[i]
        out[k, :, 0] = -s * dx + c * dy
        out[k, :, 1] = c * dx + s * dy
        out[k, :, 2] = WAYPOINT_TIMES
    return out.astype(np.float32)


def random_actions(
    rng: np.random.Generator,
    frames: int,
    *,
    speed_kmh: tuple[float, float] = (10.0, 60.0),
    preset_prob: float = 0.25,
    lane_width: float = 3.5,
    curvature_fn: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Varied, plausible (frames, 6, 3) action sequences for training data.

    With probability `preset_prob` one of Terra's presets at a random speed. Otherwise a smooth
    kinematic trajectory: a random speed, a speed profile (cruise with small changes, accelerate,
    slow down, or stop), smooth random steering within lane-keeping bounds (lateral acceleration
    <= ~1 m/s^2), sometimes a lane change (one `lane_width` to the left or right over 3-5 s) or a
    turn (constant yaw rate as the presets use, ramped in). When `curvature_fn(distance from the
    start)` is given, the steering also follows the road (yaw rate += v * curvature).
    """
    frames = int(frames)
    if rng.random() < preset_prob:
        name = PRESETS[int(rng.integers(0, len(PRESETS)))]
        return preset_actions(name, frames, float(rng.uniform(*speed_kmh)))

    dt = TRAJ_DT
    n = 2 * (frames - 1) + 61
    t = np.arange(n) * dt
    T = t[-1]
    v0 = rng.uniform(*speed_kmh) / 3.6
    mode = rng.choice(["cruise", "accelerate", "slow", "stop"], p=[0.55, 0.15, 0.15, 0.15])
    acc = np.zeros(n)
    for _ in range(2):
        acc += rng.uniform(-0.3, 0.3) * np.sin(2 * np.pi * rng.uniform(0.05, 0.3) * t + rng.uniform(0, 2 * np.pi))
    t_on = rng.uniform(-2.0, max(T - 3.0, 0.0))
    if mode == "accelerate":
        acc += np.where(t >= t_on, rng.uniform(0.8, 2.0), 0.0)
    elif mode == "slow":
        acc += np.where(t >= t_on, -rng.uniform(0.8, 2.5), 0.0)
    elif mode == "stop":
        acc = np.where(t >= t_on, -rng.uniform(2.0, 4.0), acc)
    v = np.empty(n)
    v[0] = v0
    for i in range(1, n):
        v[i] = v[i - 1] + acc[i - 1] * dt
        if mode in ("slow", "stop") and v[i] <= 0:
            v[i] = 0.0
        v[i] = min(max(v[i], 0.0 if mode in ("slow", "stop") else 1.0), 70 / 3.6 + 5)
    v_safe = np.maximum(v, 1.0)

    # Steering: smooth random wiggle with |lateral acceleration| <= ~1 m/s^2.
    yaw_rate = np.zeros(n)
    for _ in range(3):
        amp = rng.uniform(0.0, 0.35) / v_safe
        yaw_rate += amp * np.sin(2 * np.pi * rng.uniform(0.05, 0.4) * t + rng.uniform(0, 2 * np.pi))
    event = rng.choice(["none", "lane_change", "turn"], p=[0.45, 0.3, 0.25])
    if event == "lane_change":
        dur = rng.uniform(3.0, 5.0)
        start = rng.uniform(-dur / 2, max(T - 1.0, 0.0))
        sign = 1.0 if rng.random() < 0.5 else -1.0
        tau = np.clip((t - start) / dur, 0, 1)
        # Lateral offset y(t) = W (1 - cos(pi tau)) / 2: heading = y'/v, yaw rate = d(heading)/dt.
        dy = sign * lane_width * np.pi / (2 * dur) * np.sin(np.pi * tau) * ((t >= start) & (t <= start + dur))
        heading = np.arctan2(dy, v_safe)
        yaw_rate += np.gradient(heading, dt)
    elif event == "turn":
        sign = 1.0 if rng.random() < 0.5 else -1.0
        strength = rng.uniform(0.3, 1.0)
        start = rng.uniform(-2.0, max(T - 1.0, 0.0))
        ramp = np.clip((t - start) / rng.uniform(0.3, 1.5), 0, 1)
        max_rate = np.minimum(math.radians(15.0), 2.5 / v_safe)
        yaw_rate += sign * strength * max_rate * ramp
    yaw_rate = yaw_rate * np.clip(v / 1.0, 0, 1)  # no turning on the spot

    x = np.zeros(n)
    y = np.zeros(n)
    th = np.zeros(n)
    dist = 0.0
    for i in range(1, n):
        rate = yaw_rate[i - 1]
        if curvature_fn is not None:
            rate += v[i - 1] * float(curvature_fn(np.array(dist)))
        th[i] = th[i - 1] + rate * dt
        mid = th[i - 1] + 0.5 * rate * dt
        step = 0.5 * (v[i - 1] + v[i]) * dt
        x[i] = x[i - 1] + math.cos(mid) * step
        y[i] = y[i - 1] + math.sin(mid) * step
        dist += step
    return trajectory_to_actions(x, y, th, frames)


@dataclass(frozen=True)
class RolloutSpec:
    world_seed: int
    start_s: float
    lane: int
    lateral: float
    heading: float


def rollout_spec(seed: int, index: int, frames: int, *, road_follow_prob: float = 0.6):
    """(RolloutSpec, actions) of rollout `index` of dataset `seed`: independent of every other rollout."""
    rng = _rng(0xDA7A, seed, index)
    world_seed = int(rng.integers(0, 2**31 - 1))
    world = make_world(world_seed)
    start_s = float(rng.uniform(0.0, 700.0))
    lane = int(rng.integers(0, world.n_lanes))
    spec = RolloutSpec(world_seed, start_s, lane, float(rng.uniform(-0.4, 0.4)), float(rng.uniform(-0.03, 0.03)))
    follow = None
    if rng.random() < road_follow_prob:
        follow = lambda d, s0=start_s, w=world: w.curvature_at(s0 + d)  # noqa: E731
    actions = random_actions(rng, frames, lane_width=world.lane_width, curvature_fn=follow)
    return spec, actions


def render_dataset_rollout(seed: int, index: int, frames: int) -> tuple[np.ndarray, np.ndarray]:
    """(frames (F, 288, 512, 3) uint8, actions (F, 6, 3) float32) of rollout `index` of dataset `seed`."""
    spec, actions = rollout_spec(seed, index, frames)
    imgs = render_rollout(spec.world_seed, actions, start_s=spec.start_s, lane=spec.lane,
                          lateral=spec.lateral, heading=spec.heading)
    return imgs, actions


def dataset_rollouts(seed: int, n_rollouts: int, frames: int, *, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields `n_rollouts` (frames, actions) pairs, seeded; rollout i is `render_dataset_rollout(seed, i, frames)`."""
    for i in range(start, start + n_rollouts):
        yield render_dataset_rollout(seed, i, frames)


