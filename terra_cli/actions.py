"""Action waypoints: (frames, 6, 3) arrays of (lateral y m, forward x m, time s) per frame."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import TerraError

WAYPOINTS_PER_FRAME = 6


class ActionsError(TerraError):
    """Actions that cannot be read or have the wrong shape."""


def load_actions(spec: str | Path) -> np.ndarray:
    """(F, 6, 3) float32 from a .npy of shape (F, 6, 3) or (F*6, 3)."""
    path = Path(spec)
    if not path.is_file():
        raise ActionsError(f"actions file {path} does not exist")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ActionsError(f"cannot read {path} as a .npy array: {exc}") from exc
    return normalize_actions(arr, str(path))


def normalize_actions(arr: np.ndarray, where: str = "actions") -> np.ndarray:
    arr = np.asarray(arr)
    if not np.issubdtype(arr.dtype, np.number):
        raise ActionsError(f"{where}: actions must be numbers, got dtype {arr.dtype}")
    if arr.ndim == 2 and arr.shape[1] == 3 and arr.shape[0] % WAYPOINTS_PER_FRAME == 0 and arr.shape[0]:
        arr = arr.reshape(-1, WAYPOINTS_PER_FRAME, 3)
    if arr.ndim != 3 or arr.shape[1:] != (WAYPOINTS_PER_FRAME, 3) or arr.shape[0] == 0:
        raise ActionsError(f"{where}: actions must have shape (frames, 6, 3) or (frames*6, 3), got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ActionsError(f"{where}: actions contain NaN or inf")
    return arr.astype(np.float32)
