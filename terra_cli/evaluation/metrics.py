"""The numbers `terra eval` reports, each over a rollout's frames: PSNR and SSIM against the true frames,
the copy baseline, the apparent and the commanded lateral motion, sign accuracy, NaN-safe means, and the
JSON-safe copy of the results (terra_cli/evaluation/run.py says what each measures)."""

from __future__ import annotations

import math

import numpy as np


def per_frame_psnr(frames: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(F,) PSNR of frames[i] vs truth[i]."""
    from tokenizer_decoder import psnr

    return np.array([psnr(a, b) for a, b in zip(frames, truth)], np.float64)


def per_frame_ssim(frames: np.ndarray, truth: np.ndarray) -> np.ndarray:
    from terra_cli.synthetic.metrics import ssim

    return np.array([ssim(a, b) for a, b in zip(frames, truth)], np.float64)


def copy_baseline(last_context: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(F, H, W, 3): the "nothing changes" prediction, the last context frame repeated for every frame."""
    return np.broadcast_to(last_context, truth.shape)


def lateral_from_last_context(last_context: np.ndarray, frames: np.ndarray) -> float:
    """Apparent lateral motion (m, + left) from `last_context` to the last of `frames`, summed frame to frame."""
    return float(_lateral_motion(np.concatenate([last_context[None], frames]))[-1])


def _lateral_motion(frames: np.ndarray) -> np.ndarray:
    from terra_cli.synthetic.metrics import estimate_lateral_motion

    return estimate_lateral_motion(frames)


def commanded_lateral(actions: np.ndarray, context_frames: int, frames: int) -> float:
    """Lateral offset (m, + left) of the ego at frame `frames - 1` in the ego frame of frame `context_frames - 1`."""
    from terra_cli.synthetic.dataset import rollout_poses

    poses = rollout_poses(np.asarray(actions)[:frames])
    x0, y0, th0 = poses[context_frames - 1]
    x1, y1, _ = poses[frames - 1]
    return float(-math.sin(th0) * (x1 - x0) + math.cos(th0) * (y1 - y0))


def sign_accuracy(values, expected_sign: float) -> float:
    """Fraction of `values` whose sign is `expected_sign` (+1 or -1); zero counts as wrong."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return float("nan")
    return float(np.mean(np.sign(values) == np.sign(expected_sign)))


def finite_mean(values) -> float:
    arr = np.asarray(values, np.float64)
    arr = arr[np.isfinite(arr)]
    return float(arr.mean()) if arr.size else float("nan")


def clean(obj):
    """JSON-safe copy: numpy scalars/arrays to Python, NaN/inf to None (JSON has neither)."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return round(v, 5) if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
