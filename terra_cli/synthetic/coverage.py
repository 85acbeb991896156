"""Anti-aliased coverage for the ground's rendering: what fraction of a pixel's footprint, measured in
road coordinates, falls inside a band or a periodic pattern (lane lines, dashes, crop rows), so that
thin markings far away fade instead of flickering from frame to frame."""

from __future__ import annotations

import numpy as np


def footprint(a: np.ndarray) -> np.ndarray:
    """Per pixel, how much `a` changes to the next pixel (rows or columns), for anti-aliasing."""
    du = np.abs(np.diff(a, axis=1, append=a[:, -1:]))
    du[:, -1] = du[:, -2]
    dv = np.abs(np.diff(a, axis=0, append=a[-1:, :]))
    dv[-1] = dv[-2]
    return np.clip(np.maximum(du, dv), np.float32(1e-3), np.float32(50.0))


def band_cover(x, m, a, b):
    """Fraction of the pixel footprint [x - m/2, x + m/2] inside [a, b]."""
    half = m * np.float32(0.5)
    return np.clip((np.minimum(x + half, np.float32(b)) - np.maximum(x - half, np.float32(a))) / m, 0, 1)


def periodic_cover(x, m, period, on):
    """Fraction of [x - m/2, x + m/2] inside the periodic pattern [0, on) + k * period."""
    period, on = np.float32(period), np.float32(on)

    def integral(t):
        return np.floor(t / period) * on + np.minimum(np.mod(t, period), on)

    half = m * np.float32(0.5)
    return np.clip((integral(x + half) - integral(x - half)) / m, 0, 1)


def blend(col, rgb, alpha):
    a = alpha[..., None]
    return col * (1 - a) + np.asarray(rgb, np.float32) * a
