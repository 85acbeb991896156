"""Road geometry of the synthetic world: a centreline of piecewise-constant curvature (straight
pieces and circular arcs) and the lanes laid along it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from terra_cli.synthetic.camera import _wrap

# --------------------------------------------------------------------------------------------
# Road geometry


@dataclass(frozen=True)
class Segment:
    s0: float  # arc length at the start
    length: float
    curvature: float  # 1/m, + turns left
    x0: float
    y0: float
    th0: float  # heading at the start

    def end(self) -> tuple[float, float, float]:
        return self.pose_at(self.length)

    def pose_at(self, t):
        """(x, y, heading) at arc length t into the segment (t may be an array)."""
        k = self.curvature
        th = self.th0 + k * t
        if abs(k) < 1e-12:
            return self.x0 + np.cos(self.th0) * t, self.y0 + np.sin(self.th0) * t, th
        return (self.x0 + (np.sin(th) - math.sin(self.th0)) / k,
                self.y0 - (np.cos(th) - math.cos(self.th0)) / k, th)

    def project(self, qx, qy):
        """Points relative to the segment -> (t along it, lateral n (+ left)); float32 arrays."""
        k = self.curvature
        if abs(k) < 1e-12:
            c, s = math.cos(self.th0), math.sin(self.th0)
            dx, dy = qx - np.float32(self.x0), qy - np.float32(self.y0)
            return dx * np.float32(c) + dy * np.float32(s), dy * np.float32(c) - dx * np.float32(s)
        r0 = 1.0 / k
        cx = self.x0 - math.sin(self.th0) * r0
        cy = self.y0 + math.cos(self.th0) * r0
        dx, dy = qx - np.float32(cx), qy - np.float32(cy)
        r = np.sqrt(dx * dx + dy * dy)
        alpha = np.arctan2(dy, dx)
        th = alpha + np.float32(math.pi / 2 if k > 0 else -math.pi / 2)
        t = _wrap(th - np.float32(self.th0)) / np.float32(k)
        n = (np.float32(1.0) - np.float32(abs(k)) * r) / np.float32(k)
        return t, n


@dataclass
class Road:
    segments: list[Segment]

    @classmethod
    def generate(cls, rng: np.random.Generator, s_min: float = -400.0, s_max: float = 1600.0) -> "Road":
        # Straight from s_min through s = 0 (the origin, heading +x) to the first bend.
        first = float(rng.uniform(60.0, 120.0))
        segs = [Segment(s_min, first - s_min, 0.0, s_min, 0.0, 0.0)]
        straight_next = False
        while segs[-1].s0 + segs[-1].length < s_max:
            x, y, th = segs[-1].end()
            s0 = segs[-1].s0 + segs[-1].length
            if straight_next:
                k, length = 0.0, float(rng.uniform(40.0, 200.0))
            else:
                radius = float(rng.uniform(150.0, 900.0))
                k = (1.0 if rng.random() < 0.5 else -1.0) / radius
                length = float(min(rng.uniform(50.0, 250.0), 0.9 * radius))  # at most ~50 degrees
            segs.append(Segment(s0, length, k, float(x), float(y), float(th)))
            straight_next = not straight_next if rng.random() < 0.8 else straight_next
        return cls(segs)

    def segment_index(self, s) -> np.ndarray:
        starts = np.array([g.s0 for g in self.segments])
        return np.clip(np.searchsorted(starts, s, side="right") - 1, 0, len(self.segments) - 1)

    def pose_at(self, s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Centreline (x, y, heading) at arc length(s) s (extrapolated past the ends)."""
        s = np.asarray(s, dtype=np.float64)
        idx = self.segment_index(s)
        x = np.empty_like(s)
        y = np.empty_like(s)
        th = np.empty_like(s)
        for i in np.unique(idx):
            m = idx == i
            g = self.segments[i]
            x[m], y[m], th[m] = g.pose_at(s[m] - g.s0)
        return x, y, th

    def curvature_at(self, s) -> np.ndarray:
        s = np.asarray(s, dtype=np.float64)
        return np.array([g.curvature for g in self.segments])[self.segment_index(s)]

    def to_road_frame(self, x: float, y: float) -> tuple[float, float]:
        """World point -> (s, n) (nearest centreline point; n + left)."""
        s, n = self.project(np.array([[x]], np.float32), np.array([[y]], np.float32), 0.0, 0.0, (-1e9, 1e9))
        return float(s[0, 0]), float(n[0, 0])

    def project(self, qx, qy, ox: float, oy: float, s_window: tuple[float, float]):
        """Road coordinates (s, n) of points (qx + ox, qy + oy), qx/qy float32 relative to (ox, oy).

        Only segments overlapping `s_window` are considered; among them, the one with the smallest |n|
        whose range holds the point. Points no segment holds get n = 1e4 (far off the road).
        """
        best = np.full(qx.shape, np.float32(1e4))
        s_out = np.zeros(qx.shape, np.float32)
        n_out = np.full(qx.shape, np.float32(1e4))
        lo, hi = s_window
        segs = self.segments
        for i, g in enumerate(segs):
            if g.s0 + g.length < lo or g.s0 > hi:
                continue
            rel = Segment(g.s0, g.length, g.curvature, g.x0 - ox, g.y0 - oy, g.th0)
            t, n = rel.project(qx, qy)
            lo_t = -1e9 if i == 0 else -0.05
            hi_t = 1e9 if i == len(segs) - 1 else g.length + 0.05
            absn = np.abs(n)
            upd = (t >= lo_t) & (t <= hi_t) & (absn < best)
            best = np.where(upd, absn, best)
            s_out = np.where(upd, t + np.float32(g.s0), s_out)
            n_out = np.where(upd, n, n_out)
        return s_out, n_out


