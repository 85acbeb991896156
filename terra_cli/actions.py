"""Action waypoints: (frames, 6, 3) arrays of (lateral y m, forward x m, time s) per frame.

Terra conditions every frame (10 Hz) on 6 waypoints: the ego vehicle's future position, in the
frame's own ego coordinates (x forward, y positive to the left), at t = 0.45, 0.95, ..., 2.95 s.
Every input `--actions` accepts becomes that array through `resolve_actions`:

* a ``.npy`` of shape (F, 6, 3) or (F*6, 3);
* ACT-Bench JSON / JSONL: ``instruction_trajs`` holds, per frame, 60 points [x, y, z] at
  0.05 s spacing (t = 0, 0.05, ..., 2.95 s); Terra keeps points 9, 19, ..., 59 and reorders them
  to (y, x, t);
* a preset name (``straight``, ``left``, ``right``, ``stop``, ``accelerate``) driven at a speed in km/h.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from terra_cli.errors import TerraError
from terra_cli.media.files import check_input_file

WAYPOINTS_PER_FRAME = 6
FRAME_DT = 0.1  # s between frames (10 Hz)

# ACT-Bench instruction trajectories: 60 points, 0.05 s apart; Terra keeps [9::10][:6].
TRAJ_POINTS = 60
TRAJ_DT = 0.05
PATH_START = 9
PATH_STEP = 10
TRAJ_TIMES = np.arange(TRAJ_POINTS) * TRAJ_DT
WAYPOINT_TIMES = TRAJ_TIMES[PATH_START::PATH_STEP][:WAYPOINTS_PER_FRAME]  # 0.45, 0.95, ..., 2.95

# Presets.
PRESETS = ("straight", "left", "right", "stop", "accelerate")
DEFAULT_SPEED_KMH = 30.0
MAX_SPEED_KMH = 200.0
MAX_ACTION_FRAMES = 10_000  # 1000 s at 10 Hz; terra generates at most 100 frames
TURN_MAX_YAW_RATE = math.radians(15.0)  # rad/s: a city turn at low speed
TURN_MAX_LATERAL_ACCEL = 2.5  # m/s^2: caps the yaw rate at higher speeds (yaw rate = a_lat / v)
STOP_DECEL = 3.0  # m/s^2: firm but comfortable braking (about 0.3 g)
ACCELERATE_ACCEL = 1.5  # m/s^2: a moderate acceleration, held for the whole clip


class ActionsError(TerraError):
    """Actions that cannot be read or have the wrong shape."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --------------------------------------------------------------------------------------------
# Entry point


def resolve_actions(spec: str, *, frames: int | None, speed_kmh: float = DEFAULT_SPEED_KMH) -> np.ndarray:
    """(F, 6, 3) float32 actions from what `--actions` was given.

    `spec` is a preset name (case-insensitive; a file that happens to have a preset's name must be
    given as ``./name``), or a file: ``.npy``, ``.json`` or ``.jsonl`` (other suffixes are sniffed).
    A preset needs `frames` (the number of frames to produce) and uses `speed_kmh`. A file gives as
    many frames as it holds; when `frames` is given and the file holds more, only the first
    `frames` are kept. Everything is validated: problems raise `ActionsError` with a one-line message.
    """
    if frames is not None and not 1 <= frames <= MAX_ACTION_FRAMES:
        raise ActionsError(f"--frames must be at least 1 and at most {MAX_ACTION_FRAMES}, got {frames}")
    spec = str(spec)
    if spec.strip().lower() in PRESETS:
        name = spec.strip().lower()
        if frames is None:
            raise ActionsError(f"preset '{name}' needs a number of frames (--frames N)")
        return preset_actions(name, frames, speed_kmh)

    path = Path(spec)
    if not spec.strip():
        raise ActionsError(f"empty actions argument; give a .npy/.json/.jsonl file or a preset ({', '.join(PRESETS)})")
    from terra_cli.media.files import path_problem, shown

    problem = path_problem(path)
    if problem:
        raise ActionsError(f"actions file {shown(path)} {problem}")
    if not os.path.lexists(path):
        raise ActionsError(f"actions file {path} does not exist (or name a preset: {', '.join(PRESETS)})")
    check_input_file(path, "actions file", error=ActionsError)
    kind = _file_kind(path)
    if kind == "npy":
        arr = load_actions(path)
    else:
        arr = load_act_bench(path)
    if frames is not None and arr.shape[0] > frames:
        arr = arr[:frames]
    return arr


def _file_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return "npy"
    if suffix in (".json", ".jsonl"):
        return "json"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise ActionsError(f"cannot read {path}: {_one_line(exc)}") from exc
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.lstrip()[:1] in (b"{", b"["):
        return "json"
    if not head:
        raise ActionsError(f"actions file {path} is empty")
    raise ActionsError(f"{path}: unknown actions format; expected .npy, ACT-Bench .json/.jsonl, or a preset")


# --------------------------------------------------------------------------------------------
# .npy


def load_actions(spec: str | Path) -> np.ndarray:
    """(F, 6, 3) float32 from a .npy of shape (F, 6, 3) or (F*6, 3)."""
    from terra_cli.media.files import read_npy

    path = Path(spec)
    arr = read_npy(path, "actions file", max_items=MAX_ACTION_FRAMES * WAYPOINTS_PER_FRAME * 3, error=ActionsError)
    return normalize_actions(arr, str(path))


def normalize_actions(arr: np.ndarray, where: str = "actions") -> np.ndarray:
    """Check and reshape to (F, 6, 3) float32: numbers, the right shape, not empty, all finite."""
    arr = np.asarray(arr)
    if not (np.issubdtype(arr.dtype, np.number) and not np.issubdtype(arr.dtype, np.complexfloating)):
        raise ActionsError(f"{where}: actions must be real numbers, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ActionsError(f"{where}: actions are empty (shape {arr.shape}); need shape (frames, 6, 3)")
    if arr.ndim == 2 and arr.shape[1] == 3 and arr.shape[0] % WAYPOINTS_PER_FRAME == 0:
        arr = arr.reshape(-1, WAYPOINTS_PER_FRAME, 3)
    if arr.ndim != 3 or arr.shape[1:] != (WAYPOINTS_PER_FRAME, 3):
        raise ActionsError(f"{where}: actions must have shape (frames, 6, 3) or (frames*6, 3), got {arr.shape}")
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32)  # what the model sees: 1e39 becomes inf here, and is refused
    if not np.isfinite(arr).all():
        raise ActionsError(f"{where}: actions contain NaN or inf (or numbers beyond float32's range, about 3.4e38)")
    return arr


# --------------------------------------------------------------------------------------------
# ACT-Bench JSON / JSONL


def load_act_bench(path: str | Path) -> np.ndarray:
    """(F, 6, 3) float32 from an ACT-Bench style JSON or JSONL file.

    Accepted: a JSON object with ``instruction_trajs`` (one ACT-Bench sample); a JSONL file with
    one such object per line, as the ACT-Bench ``act_bench.jsonl`` has; a JSON array of such
    objects; or a bare ``instruction_trajs`` list (frames x 60 points x [x, y, z]). When there are
    several samples, the FIRST one is used (split the file to pick another).
    """
    path = Path(path)
    value = _read_first_json_value(path)
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = value[0]
    if isinstance(value, dict):
        if "instruction_trajs" not in value:
            keys = ", ".join(sorted(map(str, value))[:8]) or "none"
            raise ActionsError(f"{path}: no 'instruction_trajs' in the JSON object (keys: {keys})")
        trajs = value["instruction_trajs"]
    elif isinstance(value, list):
        trajs = value
    else:
        raise ActionsError(f"{path}: expected a JSON object with 'instruction_trajs', got {type(value).__name__}")
    return instruction_trajs_to_actions(trajs, str(path))


def _read_first_json_value(path: Path):
    """The first JSON value in the file: the whole document, or the first line of a JSONL file."""
    check_input_file(path, "actions file", error=ActionsError)
    try:
        if path.suffix.lower() == ".jsonl":
            # Read only the first sample: ACT-Bench's JSONL is hundreds of MB.
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        try:
                            return json.loads(line)
                        except RecursionError as exc:
                            raise ActionsError(f"{path}: the JSON is nested too deeply to be ACT-Bench actions") from exc
                        except ValueError:  # JSONDecodeError, or a number too long to convert
                            break  # maybe one pretty-printed object: try the whole file below
                else:
                    raise ActionsError(f"actions file {path} is empty")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ActionsError(f"cannot read {path}: {_one_line(exc)}") from exc
    text = text.lstrip("\ufeff \t\r\n")
    if not text:
        raise ActionsError(f"actions file {path} is empty")
    try:
        value, _end = json.JSONDecoder().raw_decode(text)  # JSON, or the first record of JSONL
    except json.JSONDecodeError as exc:
        raise ActionsError(f"cannot read {path} as JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError as exc:
        raise ActionsError(f"{path}: the JSON is nested too deeply to be ACT-Bench actions") from exc
    except ValueError as exc:  # an integer with more digits than Python converts
        raise ActionsError(f"cannot read {path} as JSON: {_one_line(exc)}") from exc
    return value


def instruction_trajs_to_actions(trajs, where: str = "instruction_trajs") -> np.ndarray:
    """ACT-Bench ``instruction_trajs`` (per frame 60 points [x, y(, z)], 0.05 s apart) -> (F, 6, 3).

    Per frame: points [9::10][:6] (t = 0.45, 0.95, ..., 2.95 s), as (y, x, t).
    """
    if isinstance(trajs, np.ndarray):
        frames_list = list(trajs)
    elif isinstance(trajs, (list, tuple)):
        frames_list = trajs
    else:
        raise ActionsError(f"{where}: 'instruction_trajs' must be a list of per-frame trajectories, got {type(trajs).__name__}")
    if len(frames_list) == 0:
        raise ActionsError(f"{where}: 'instruction_trajs' is empty (no frames)")
    if len(frames_list) > MAX_ACTION_FRAMES:
        raise ActionsError(f"{where}: 'instruction_trajs' has {len(frames_list)} frames; at most {MAX_ACTION_FRAMES} are supported")
    out = np.empty((len(frames_list), WAYPOINTS_PER_FRAME, 3), dtype=np.float64)
    for i, frame in enumerate(frames_list):
        try:
            pts = np.asarray(frame, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ActionsError(f"{where}: frame {i} of 'instruction_trajs' is not a list of [x, y, z] numbers") from exc
        if pts.ndim != 2 or pts.shape[1] not in (2, 3):
            raise ActionsError(f"{where}: frame {i} of 'instruction_trajs' must be points [x, y, z], got shape {pts.shape}")
        if pts.shape[0] < TRAJ_POINTS:
            raise ActionsError(
                f"{where}: frame {i} of 'instruction_trajs' has {pts.shape[0]} points; need {TRAJ_POINTS} "
                f"({TRAJ_DT} s apart, 0 to {TRAJ_TIMES[-1]:.2f} s)"
            )
        picked = pts[PATH_START::PATH_STEP][:WAYPOINTS_PER_FRAME]
        out[i, :, 0] = picked[:, 1]  # lateral y
        out[i, :, 1] = picked[:, 0]  # forward x
        out[i, :, 2] = WAYPOINT_TIMES
    return normalize_actions(out, where)


def actions_to_instruction_trajs(actions: np.ndarray) -> np.ndarray:
    """(F, 6, 3) -> (F, 60, 3) ACT-Bench-style points [x, y, 0] that convert back to `actions`.

    The 6 waypoints land on points 9, 19, ..., 59; the points between are linearly interpolated
    in time from the origin (t = 0). The waypoints' own times are assumed to be 0.45 ... 2.95 s.
    """
    actions = normalize_actions(actions)
    n = actions.shape[0]
    knots_t = np.concatenate([[0.0], WAYPOINT_TIMES])
    trajs = np.zeros((n, TRAJ_POINTS, 3), dtype=np.float64)
    for k in range(n):
        xs = np.concatenate([[0.0], actions[k, :, 1]])
        ys = np.concatenate([[0.0], actions[k, :, 0]])
        trajs[k, :, 0] = np.interp(TRAJ_TIMES, knots_t, xs)
        trajs[k, :, 1] = np.interp(TRAJ_TIMES, knots_t, ys)
        trajs[k, PATH_START::PATH_STEP, 0] = actions[k, :, 1]
        trajs[k, PATH_START::PATH_STEP, 1] = actions[k, :, 0]
    return trajs


# --------------------------------------------------------------------------------------------
# Presets


def preset_trajs(name: str, frames: int, speed_kmh: float = DEFAULT_SPEED_KMH) -> np.ndarray:
    """(frames, 60, 3) ACT-Bench-style points [x, y, 0] for a preset manoeuvre.

    Frame k is at t_k = 0.1 k s; its points are the ego's future positions at t_k + 0, 0.05, ...,
    2.95 s in the ego frame at t_k (x forward, y left), along a kinematic path:

    * straight:   constant speed v.
    * left/right: constant speed v on a constant-curvature arc, yaw rate
                  min(15 deg/s, 2.5 m/s^2 / v) (left = positive y); every frame is the same.
    * stop:       braking from v at 3.0 m/s^2 from t = 0 until standing still, then standing.
    * accelerate: speeding up from v at 1.5 m/s^2 for the whole clip.
    """
    name = name.strip().lower()
    if name not in PRESETS:
        raise ActionsError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}")
    frames = int(frames)
    if frames < 1:
        raise ActionsError(f"preset '{name}' needs at least 1 frame, got {frames}")
    if not math.isfinite(speed_kmh) or not 0.0 <= speed_kmh <= MAX_SPEED_KMH:
        raise ActionsError(f"--speed must be between 0 and {MAX_SPEED_KMH:g} km/h, got {speed_kmh:g}")
    v = speed_kmh / 3.6
    tau = TRAJ_TIMES[None, :]  # (1, 60) look-ahead
    t0 = (np.arange(frames) * FRAME_DT)[:, None]  # (F, 1) frame times
    x = np.zeros((frames, TRAJ_POINTS))
    y = np.zeros((frames, TRAJ_POINTS))

    if name == "straight":
        x += v * tau
    elif name in ("left", "right"):
        yaw_rate = min(TURN_MAX_YAW_RATE, TURN_MAX_LATERAL_ACCEL / v) if v > 0 else 0.0
        sign = 1.0 if name == "left" else -1.0
        if yaw_rate > 0:
            radius = v / yaw_rate
            x += radius * np.sin(yaw_rate * tau)
            y += sign * radius * (1.0 - np.cos(yaw_rate * tau))
    elif name == "stop":
        t_stop = v / STOP_DECEL

        def travelled(t):
            tc = np.minimum(t, t_stop)
            return v * tc - 0.5 * STOP_DECEL * tc**2

        x += travelled(t0 + tau) - travelled(t0)
    else:  # accelerate

        def travelled(t):
            return v * t + 0.5 * ACCELERATE_ACCEL * t**2

        x += travelled(t0 + tau) - travelled(t0)
    return np.stack([x, y, np.zeros_like(x)], axis=-1)


def preset_actions(name: str, frames: int, speed_kmh: float = DEFAULT_SPEED_KMH) -> np.ndarray:
    """(frames, 6, 3) float32 waypoints of a preset (see `preset_trajs`)."""
    return instruction_trajs_to_actions(preset_trajs(name, frames, speed_kmh), f"preset '{name}'")


# --------------------------------------------------------------------------------------------
# Summary


@dataclass(frozen=True)
class ActionsSummary:
    frames: int
    forward_m: float  # where the trajectory ends, along the first frame's heading
    lateral_m: float  # ... and to its left (negative: right)


def summarize_actions(actions: np.ndarray) -> ActionsSummary:
    """Dead-reckon the whole clip from the per-frame waypoints, in the first frame's ego coordinates.

    Between frames (0.1 s) the ego moves as frame k's own waypoints say: a quadratic in time through
    the origin and the first two waypoints gives the position and heading 0.1 s ahead. The end point
    is the last frame's last waypoint. Exact for straight constant-acceleration paths.
    """
    actions = normalize_actions(actions).astype(np.float64)
    pos = np.zeros(2)  # (x, y) in the first frame's ego coordinates
    heading = 0.0
    for k in range(actions.shape[0] - 1):
        dx, dy, dtheta = _step_motion(actions[k])
        c, s = math.cos(heading), math.sin(heading)
        pos += (c * dx - s * dy, s * dx + c * dy)
        heading += dtheta
    last = actions[-1, -1]
    c, s = math.cos(heading), math.sin(heading)
    end = pos + (c * last[1] - s * last[0], s * last[1] + c * last[0])
    return ActionsSummary(frames=int(actions.shape[0]), forward_m=float(end[0]), lateral_m=float(end[1]))


def _step_motion(frame: np.ndarray) -> tuple[float, float, float]:
    """(dx, dy, dheading) of the ego over one frame interval, from one frame's waypoints."""
    t1, t2 = float(frame[0, 2]), float(frame[1, 2])
    if not (0.0 < t1 < t2):
        t1, t2 = float(WAYPOINT_TIMES[0]), float(WAYPOINT_TIMES[1])
    # Quadratic p(t) = a t + b t^2 through (0, 0), (t1, w1), (t2, w2), for x and y.
    w1 = frame[0, [1, 0]]
    w2 = frame[1, [1, 0]]
    det = t1 * t2**2 - t2 * t1**2
    a = (w1 * t2**2 - w2 * t1**2) / det
    b = (w2 * t1 - w1 * t2) / det
    h = FRAME_DT
    p = a * h + b * h * h
    v0, v1 = a, a + 2 * b * h
    dtheta = 0.0
    if np.hypot(*v0) > 1e-3 and np.hypot(*v1) > 1e-3:
        dtheta = math.atan2(v1[1], v1[0]) - math.atan2(v0[1], v0[0])
        dtheta = (dtheta + math.pi) % (2 * math.pi) - math.pi
    return float(p[0]), float(p[1]), dtheta
