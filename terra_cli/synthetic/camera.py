"""The synthetic world's camera: a pinhole 1.5 m above flat ground, looking along the ego heading
(zero pitch and roll, horizontal FOV 80 degrees), and the per-pixel ground rays the renderer reuses."""

from __future__ import annotations

import math

import numpy as np

# --------------------------------------------------------------------------------------------
# Camera

HEIGHT, WIDTH = 288, 512
HFOV_DEG = 80.0
FOCAL = (WIDTH / 2) / math.tan(math.radians(HFOV_DEG / 2))  # px (about 305)
CX = WIDTH / 2
HORIZON_ROW = 126.0  # CY: the image row of the horizon (the middle is 144)
CAM_HEIGHT = 1.5  # m
MAX_DIST = 320.0  # m: ground drawn up to here, haze beyond
FIRST_GROUND_ROW = int(math.floor(HORIZON_ROW + 0.5)) + 1  # first row whose centre is below the horizon
PANO_COLUMNS = 4096  # azimuth resolution of the sky/hills panorama

_ROWS = np.arange(FIRST_GROUND_ROW, HEIGHT, dtype=np.float64)
_ROW_DEPTH = (FOCAL * CAM_HEIGHT / (_ROWS + 0.5 - HORIZON_ROW)).astype(np.float32)  # forward distance per row
_COL_RAY = ((CX - (np.arange(WIDTH) + 0.5)) / FOCAL).astype(np.float32)  # lateral m per forward m, + left
_GROUND_D = np.repeat(_ROW_DEPTH[:, None], WIDTH, axis=1)  # (rows, W) forward distance
_GROUND_L = _ROW_DEPTH[:, None] * _COL_RAY[None, :]  # (rows, W) lateral offset, + left
_COL_AZ = np.arctan(_COL_RAY.astype(np.float64))  # azimuth of each column relative to the heading, + left


def _rng(*keys) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in keys])


def _wrap(a):
    return (a + np.pi) % (2 * np.pi) - np.pi

