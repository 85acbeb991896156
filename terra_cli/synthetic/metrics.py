"""Metrics for generated frames of the synthetic world: `ssim`, and lane-marking based
`lane_offset` / `estimate_lateral_shift` / `estimate_lateral_motion`, which read the lateral
position of the bright lane markings in a band of rows near the bottom of the image through an
inverse perspective mapping. PSNR is `tokenizer_decoder.psnr`."""

from __future__ import annotations

import numpy as np

from terra_cli.synthetic.camera import CAM_HEIGHT, CX, FOCAL, HORIZON_ROW, WIDTH

# --------------------------------------------------------------------------------------------
# Metrics


def _gray(img: np.ndarray) -> np.ndarray:
    img = np.asarray(img, np.float64)
    if img.ndim == 3 and img.shape[-1] == 3:
        return img @ np.array([0.299, 0.587, 0.114])
    return img


def _gauss_filter(x: np.ndarray, sigma: float = 1.5, radius: int = 5) -> np.ndarray:
    k = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    k /= k.sum()
    out = np.zeros((x.shape[0] - 2 * radius, x.shape[1]))
    for i, w in enumerate(k):
        out += w * x[i:i + out.shape[0]]
    res = np.zeros((out.shape[0], out.shape[1] - 2 * radius))
    for i, w in enumerate(k):
        res += w * out[:, i:i + res.shape[1]]
    return res


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM (Gaussian window, sigma 1.5, 11x11, valid region) of two uint8 images on luma."""
    x, y = _gray(a), _gray(b)
    if x.shape != y.shape:
        raise ValueError(f"ssim needs images of the same shape, got {x.shape} and {y.shape}")
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = _gauss_filter(x), _gauss_filter(y)
    sxx = _gauss_filter(x * x) - mx * mx
    syy = _gauss_filter(y * y) - my * my
    sxy = _gauss_filter(x * y) - mx * my
    m = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(m.mean())


# Lane markings: bright, near-white or yellow pixels in a band of rows near the bottom, resampled to
# a bird's-eye lateral grid (inverse perspective mapping with the renderer's camera).
BAND_ROWS = (196, 284)  # image rows used (forward distance ~6.5 m .. ~2.9 m)
LANE_ROWS = (150, 284)  # taller band for `lane_offset` (~19 m .. ~2.9 m): sees at least one dash
IPM_HALF_WIDTH = 6.0  # m
IPM_STEP = 0.02  # m
_IPM_GRID = np.arange(-IPM_HALF_WIDTH, IPM_HALF_WIDTH + 1e-9, IPM_STEP)


def marking_weight(frame: np.ndarray) -> np.ndarray:
    """(H, W) float in [0, 1]: how much each pixel looks like a lane marking (bright white or yellow)."""
    f = np.asarray(frame, np.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    rg = np.minimum(r, g)
    return np.clip((rg - 165.0) / 40.0, 0, 1) * np.clip((rg - b + 60.0) / 40.0, 0, 1)


def bev_profile(frame: np.ndarray, rows: tuple[int, int] = BAND_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(profile (len grid,), coverage (len grid,)): marking weight averaged over the band's rows per
    lateral position (m, + left of the camera), and the fraction of rows that see that position."""
    w = marking_weight(frame)
    r0, r1 = rows
    acc = np.zeros_like(_IPM_GRID)
    cnt = np.zeros_like(_IPM_GRID)
    for v in range(r0, r1):
        d = FOCAL * CAM_HEIGHT / (v + 0.5 - HORIZON_ROW)
        u = CX - _IPM_GRID * FOCAL / d - 0.5  # fractional column index
        inside = (u >= 0) & (u <= WIDTH - 1)
        acc[inside] += np.interp(u[inside], np.arange(WIDTH), w[v])
        cnt[inside] += 1
    prof = np.where(cnt > 0, acc / np.maximum(cnt, 1), 0.0)
    return prof, cnt / (r1 - r0)


def lane_offset(frame: np.ndarray) -> float:
    """Lateral offset (m) of the lane centre from the camera, + left; NaN when no lane is seen.

    The lane is bounded by the nearest lane marking left of the camera and the nearest right of it
    (peaks of the bird's-eye marking profile of the bottom band). An ego right of its lane centre
    gives a positive value.
    """
    prof, cover = bev_profile(frame, LANE_ROWS)
    peaks = _peaks(prof * (cover > 0.3), 0.06)
    left = [p for p in peaks if p > 0.3]
    right = [p for p in peaks if p < -0.3]
    if not left or not right:
        return float("nan")
    return float((min(left) + max(right)) / 2)


def _peaks(prof: np.ndarray, thresh: float) -> list[float]:
    """Lateral positions (m) of the weighted centres of runs above `thresh`."""
    on = prof > thresh
    out = []
    i = 0
    n = len(prof)
    while i < n:
        if on[i]:
            j = i
            while j < n and on[j]:
                j += 1
            w = prof[i:j]
            out.append(float((w * _IPM_GRID[i:j]).sum() / w.sum()))
            i = j
        else:
            i += 1
    return out


def estimate_lateral_shift(frame_a: np.ndarray, frame_b: np.ndarray, max_shift_m: float = 1.5) -> float:
    """Apparent lateral ego motion (m, + left) from frame a to frame b, from the lane markings.

    The bird's-eye marking profiles of the bottom band (~3-6.5 m ahead) are cross-correlated; the
    world moving right in the image means the ego moved (or turned) left. A yaw change shows up too,
    as the shift it causes at that distance. Keep the motion between the two frames well under half
    a lane width (sum consecutive estimates with `estimate_lateral_motion` for longer spans).
    Returns 0.0 when either frame shows no markings.
    """
    pa, ca = bev_profile(frame_a)
    pb, cb = bev_profile(frame_b)
    pa = pa - pa[ca > 0].mean() if (ca > 0).any() else pa
    pb = pb - pb[cb > 0].mean() if (cb > 0).any() else pb
    pa = np.where(ca > 0, pa, 0.0)
    pb = np.where(cb > 0, pb, 0.0)
    if not pa.any() or not pb.any():
        return 0.0
    k = int(round(max_shift_m / IPM_STEP))
    n = len(pa)
    scores = np.empty(2 * k + 1)
    for i, sh in enumerate(range(-k, k + 1)):
        # Markings at l in a appear at l + sh*step in b.
        if sh >= 0:
            num = (pa[:n - sh] * pb[sh:]).sum()
            overlap = ((ca[:n - sh] > 0) & (cb[sh:] > 0)).sum()
        else:
            num = (pa[-sh:] * pb[:n + sh]).sum()
            overlap = ((ca[-sh:] > 0) & (cb[:n + sh] > 0)).sum()
        scores[i] = num / max(overlap, 1)
    j = int(np.argmax(scores))
    frac = 0.0
    if 0 < j < 2 * k:
        y0, y1, y2 = scores[j - 1], scores[j], scores[j + 1]
        den = y0 - 2 * y1 + y2
        if den < 0:
            frac = 0.5 * (y0 - y2) / den
    shift_m = (j - k + frac) * IPM_STEP
    return float(-shift_m)


def estimate_lateral_motion(frames: np.ndarray) -> np.ndarray:
    """(F,) cumulative apparent lateral ego motion (m, + left) from frame 0, summing consecutive shifts."""
    frames = np.asarray(frames)
    steps = [estimate_lateral_shift(frames[i], frames[i + 1]) for i in range(len(frames) - 1)]
    return np.concatenate([[0.0], np.cumsum(steps)])

