"""Waypoints no car can drive: warnings, not errors.

The world model takes any finite numbers, and probing it with trajectories outside its training
distribution is a legitimate experiment; but hundreds of km/h or lateral jumps usually mean a unit
or column mix-up (metres vs centimetres, x and y swapped, time in frames instead of seconds), so the
user hears about the first frame that shows it. NaN and inf stay errors (`actions.normalize_actions`).
"""

from __future__ import annotations

import numpy as np

MAX_PLAUSIBLE_SPEED_KMH = 250.0  # above any road vehicle in driving data
MAX_PLAUSIBLE_LATERAL_ACCEL = 20.0  # m/s^2, about 2 g: beyond tyre grip


def implausible_actions(actions: np.ndarray) -> list[str]:
    """(F, 6, 3) waypoints (lateral y m, forward x m, time s) -> one message per kind of problem,
    naming the first frame that shows it and how many frames do."""
    actions = np.asarray(actions, dtype=np.float64)
    y, x, t = actions[..., 0], actions[..., 1], actions[..., 2]
    messages = []
    bad_time = (t <= 0).any(axis=1) | (np.diff(t, axis=1) <= 0).any(axis=1)
    if bad_time.any():
        first = int(np.argmax(bad_time))
        messages.append(f"frame {first}: waypoint times {np.round(t[first], 3).tolist()} s do not increase from "
                        f"above 0 ({int(bad_time.sum())} frame(s)); the third column is time in seconds")
    with np.errstate(divide="ignore", invalid="ignore"):
        positive = t > 0
        speed_kmh = np.where(positive, np.hypot(x, y) / np.where(positive, t, 1) * 3.6, 0.0)
        lateral = np.where(positive, 2 * np.abs(y) / np.where(positive, t, 1) ** 2, 0.0)
    for values, limit, what in ((speed_kmh, MAX_PLAUSIBLE_SPEED_KMH, "km/h"),
                                (lateral, MAX_PLAUSIBLE_LATERAL_ACCEL, "m/s^2 sideways")):
        over = (values > limit).any(axis=1)
        if over.any():
            first = int(np.argmax(over))
            point = int(np.argmax(values[first]))
            messages.append(
                f"frame {first}: the waypoint at t={t[first, point]:.2f} s (y={y[first, point]:.1f} m, "
                f"x={x[first, point]:.1f} m) needs {values[first, point]:,.0f} {what}, above {limit:,.0f} "
                f"({int(over.sum())} frame(s)); check the units (metres, seconds) and the column order (y, x, t)")
    return messages
