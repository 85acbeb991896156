"""A synthetic driving world: a deterministic procedural renderer of a forward camera on a road.

Used to train and evaluate ``terra-mini``, a small world model that ships with the project, and as
ground truth for action-following metrics. Pure numpy + PIL, no GPU; one 288x512 frame takes a few
milliseconds to a few tens of milliseconds on one CPU core.

The world (seeded, see `World`):

* a road whose centreline is a world-fixed curve of piecewise-constant curvature (straight pieces and
  circular arcs, radius >= 150 m; the first 60-120 m after s = 0 are straight), 2 to 4 lanes of
  3.0-3.8 m, solid white edge lines, dashed lane lines (a yellow or white dashed centre line on two-lane
  roads), tyre tracks and low-frequency patches on the asphalt, shoulders, textured fields beyond;
* roadside objects at regular spacing so that motion is visible: trees, poles (with a lamp arm),
  white delineator posts at the road edge, and boxy houses further out;
* a sky gradient with clouds and a hill silhouette painted on a world-fixed panorama (rotation cue),
  distance haze.

The camera is a pinhole 1.5 m above flat ground, looking along the ego heading with zero pitch and
roll: horizontal FOV 80 degrees, horizon at row `HORIZON_ROW` (a little above the middle).

The ego moves as Terra's actions say (`terra_cli.actions`): between frames k and k+1 (0.1 s) it moves
by the motion implied by frame k's waypoints (`rollout_poses`, the same dead reckoning that
`summarize_actions` uses). `render_rollout(world_seed, actions)` renders those poses.

Metrics for generated frames: `psnr`, `ssim`, and lane-marking based `lane_offset` /
`estimate_lateral_shift` / `estimate_lateral_motion`, which read the lateral position of the bright lane
markings in a band of rows near the bottom of the image through an inverse perspective mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

import numpy as np
from PIL import Image, ImageDraw

from terra_cli.actions import (
    FRAME_DT,
    PRESETS,
    TRAJ_DT,
    WAYPOINT_TIMES,
    _step_motion,
    normalize_actions,
    preset_actions,
)

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


# --------------------------------------------------------------------------------------------
# The world


@dataclass
class RoadsideObject:
    kind: str  # tree | pole | post | house
    x: float
    y: float
    width: float
    height: float
    colour: tuple[int, int, int]
    colour2: tuple[int, int, int]
    side: float  # +1 left of the road, -1 right
    extra: float = 0.0  # tree: trunk height; house: roof height


def _jitter(rng, base, amount):
    return tuple(int(np.clip(c + rng.uniform(-amount, amount), 0, 255)) for c in base)


@dataclass
class World:
    """One procedurally generated world; everything follows from `seed`."""

    seed: int
    road: Road = field(init=False)
    n_lanes: int = field(init=False)
    lane_width: float = field(init=False)
    ego_lane: int = field(init=False)

    def __post_init__(self):
        rng = _rng(0x7E77A, self.seed)
        self.road = Road.generate(rng)
        self.n_lanes = int(rng.choice([2, 2, 2, 3, 4]))
        self.lane_width = float(rng.uniform(3.0, 3.8))
        self.half_width = self.n_lanes * self.lane_width / 2
        self.ego_lane = 0 if self.n_lanes == 2 else int(rng.integers(0, self.n_lanes))  # 0 = rightmost
        self.mark_width = float(rng.uniform(0.12, 0.18))
        self.dash_length = float(rng.uniform(2.5, 4.5))
        self.dash_period = float(rng.uniform(8.0, 13.0))
        self.yellow_centre = self.n_lanes == 2 and rng.random() < 0.5
        self.shoulder = float(rng.uniform(0.4, 2.0))
        self.fog_dist = float(rng.uniform(160.0, 420.0))

        grey = rng.uniform(55, 105)
        self.asphalt = np.array([grey, grey, grey]) + rng.uniform(-6, 6, 3) + np.array([0, 0, rng.uniform(0, 6)])
        base_shoulder = [(118, 110, 95), (105, 105, 100), (125, 112, 88), (95, 92, 85)][int(rng.integers(0, 4))]
        self.shoulder_col = np.array(_jitter(rng, base_shoulder, 10), np.float64)
        grass = [(70, 120, 55), (95, 130, 60), (120, 125, 70), (60, 100, 50), (135, 120, 80), (85, 110, 70)]
        self.grass = np.array(_jitter(rng, grass[int(rng.integers(0, len(grass)))], 12), np.float64)
        self.grass2 = np.clip(self.grass * rng.uniform(0.75, 0.9) + rng.uniform(-8, 8, 3), 0, 150)
        self.white = np.array(_jitter(rng, (235, 235, 230), 8), np.float64)
        self.yellow = np.array(_jitter(rng, (235, 195, 55), 10), np.float64)
        self.tex_k = rng.uniform(0.08, 0.35, size=(3, 2)) * rng.choice([-1, 1], size=(3, 2))  # rad/m
        self.tex_phase = rng.uniform(0, 2 * np.pi, 3)
        self.stripe_period = float(rng.uniform(4.0, 12.0))  # field rows across the road direction
        self.stripe_amount = float(rng.uniform(0.0, 0.12))
        self.patch_k = float(rng.uniform(0.1, 0.3))
        self.patch_phase = float(rng.uniform(0, 2 * np.pi))

        # Sky.
        self.zenith = np.array(_jitter(rng, (70, 120, 200), 25), np.float64)
        self.horizon_col = np.clip(self.zenith + np.array([95, 80, 40]) + rng.uniform(-15, 15, 3), 0, 255)
        self.haze = np.clip(0.6 * self.horizon_col + 0.4 * np.array([200, 200, 200]), 0, 255)
        self.hill_col = np.array(_jitter(rng, (80, 105, 95), 20), np.float64)
        self.pano = self._make_panorama(rng)
        self.objects = self._make_objects(rng)

    # -- lanes ----------------------------------------------------------------------------------
    def lane_centre(self, lane: int) -> float:
        """Lateral offset n of lane `lane`'s centre (0 = rightmost lane)."""
        return -self.half_width + (lane + 0.5) * self.lane_width

    def start_pose(self, s: float = 0.0, lane: int | None = None, lateral: float = 0.0, heading: float = 0.0):
        """World pose (x, y, yaw) of an ego at arc length s, centred in `lane` (+ `lateral` m), along the road."""
        lane = self.ego_lane if lane is None else int(lane)
        x, y, th = (float(v) for v in self.road.pose_at(s))
        n = self.lane_centre(lane) + lateral
        return (x - math.sin(th) * n, y + math.cos(th) * n, th + heading)

    def curvature_at(self, s) -> np.ndarray:
        return self.road.curvature_at(s)

    # -- panorama -------------------------------------------------------------------------------
    def _make_panorama(self, rng) -> np.ndarray:
        rows = FIRST_GROUND_ROW
        v = np.arange(rows) + 0.5
        el = np.arctan((HORIZON_ROW - v) / FOCAL)  # elevation of each row (the last ones are < 0: haze)
        az = np.arange(PANO_COLUMNS) * (2 * np.pi / PANO_COLUMNS)
        top = math.atan(HORIZON_ROW / FOCAL)
        g = np.clip(el / top, 0, 1)[:, None] ** 0.7
        sky = (1 - g)[..., None] * self.horizon_col + g[..., None] * self.zenith
        sky = np.broadcast_to(sky.astype(np.float32), (rows, PANO_COLUMNS, 3)).copy()
        # Clouds: a soft threshold of a smooth periodic field.
        dens = np.zeros((rows, PANO_COLUMNS), np.float32)
        for _ in range(5):
            fa = int(rng.integers(2, 14))
            fe = rng.uniform(4, 20)
            amp, ph = rng.uniform(0.4, 1.0), rng.uniform(0, 2 * np.pi)
            # amp * sin(fa az + fe el + ph), as a sum of two outer products (cheap)
            a_s, a_c = np.sin(fa * az).astype(np.float32), np.cos(fa * az).astype(np.float32)
            e_c, e_s = (amp * np.cos(fe * el + ph)).astype(np.float32), (amp * np.sin(fe * el + ph)).astype(np.float32)
            dens += np.outer(e_c, a_s) + np.outer(e_s, a_c)
        cover = rng.uniform(0.8, 2.6)
        cloud = np.clip((dens - np.float32(cover)) / np.float32(1.2), 0, 1) * np.clip(el / 0.05, 0, 1).astype(np.float32)[:, None]
        cloud_col = np.clip(np.array([245.0, 245, 245]) - rng.uniform(0, 40), 0, 255)
        sky = sky * (1 - cloud[..., None]) + cloud[..., None] * cloud_col.astype(np.float32)
        # Hills: elevation of the silhouette per azimuth.
        h = np.full(PANO_COLUMNS, rng.uniform(0.005, 0.02))
        for _ in range(4):
            h += rng.uniform(0.0, 0.012) * (1 + np.sin(int(rng.integers(1, 9)) * az + rng.uniform(0, 2 * np.pi)))
        above = (h[None, :] - el[:, None]).astype(np.float32)
        hill = np.clip(above * np.float32(FOCAL), 0, 1)  # anti-aliased over one pixel
        shade = np.clip(1.0 - above * 8, 0.75, 1.0)
        hill_rgb = (0.55 * self.hill_col + 0.45 * self.haze).astype(np.float32)[None, None, :] * shade[..., None]
        sky = sky * (1 - hill[..., None]) + hill[..., None] * hill_rgb
        # Rows at or below the horizon: haze.
        below = el <= 0
        sky[below] = self.haze
        return sky.astype(np.float32)

    # -- objects --------------------------------------------------------------------------------
    def _make_objects(self, rng) -> list[RoadsideObject]:
        objs: list[RoadsideObject] = []
        s_lo, s_hi = -350.0, 1550.0
        edge = self.half_width + self.shoulder

        def place(s_arr, n_arr):
            x, y, th = self.road.pose_at(np.asarray(s_arr, np.float64))
            n_arr = np.asarray(n_arr, np.float64)
            return x - np.sin(th) * n_arr, y + np.cos(th) * n_arr

        # Trees on one or both sides.
        for side in (1.0, -1.0):
            if rng.random() < 0.25:
                continue
            spacing = rng.uniform(10.0, 30.0)
            s = np.arange(s_lo + rng.uniform(0, spacing), s_hi, spacing)
            s = s + rng.uniform(-0.3, 0.3, s.shape) * spacing
            keep = rng.random(s.shape) < rng.uniform(0.6, 1.0)
            s = s[keep]
            n = side * (edge + rng.uniform(2.0, 9.0, s.shape))
            xs, ys = place(s, n)
            base = _jitter(rng, (45, 95, 45), 20)
            for x, y in zip(xs, ys):
                h = float(rng.uniform(4.0, 9.0))
                objs.append(RoadsideObject("tree", float(x), float(y), float(rng.uniform(2.2, 5.0)), h,
                                           _jitter(rng, base, 18), _jitter(rng, (90, 65, 45), 12), side,
                                           extra=float(rng.uniform(1.2, 2.5))))
        # Poles (street lights / utility poles) on one side.
        side = 1.0 if rng.random() < 0.5 else -1.0
        spacing = rng.uniform(25.0, 50.0)
        s = np.arange(s_lo + rng.uniform(0, spacing), s_hi, spacing)
        n = np.full(s.shape, side * (edge + rng.uniform(0.5, 1.5)))
        xs, ys = place(s, n)
        pole_col = _jitter(rng, (120, 115, 110), 25)
        h = float(rng.uniform(6.5, 9.5))
        for x, y in zip(xs, ys):
            objs.append(RoadsideObject("pole", float(x), float(y), 0.22, h, pole_col, (60, 60, 60), side))
        # Delineator posts at both road edges.
        if rng.random() < 0.8:
            spacing = rng.uniform(15.0, 40.0)
            s = np.arange(s_lo, s_hi, spacing)
            for side in (1.0, -1.0):
                xs, ys = place(s, np.full(s.shape, side * (self.half_width + 0.5 * self.shoulder + 0.3)))
                for x, y in zip(xs, ys):
                    objs.append(RoadsideObject("post", float(x), float(y), 0.12, 1.0, (225, 225, 220),
                                               (30, 30, 30), side))
        # Houses further out.
        if rng.random() < 0.7:
            spacing = rng.uniform(40.0, 120.0)
            s = np.arange(s_lo + rng.uniform(0, spacing), s_hi, spacing)
            for s_i in s:
                if rng.random() < 0.4:
                    continue
                side = 1.0 if rng.random() < 0.5 else -1.0
                n = side * (edge + rng.uniform(12.0, 35.0))
                (x,), (y,) = place([s_i], [n])
                wall = _jitter(rng, [(200, 190, 170), (170, 160, 150), (210, 205, 195), (150, 120, 100)][int(rng.integers(0, 4))], 15)
                roof = _jitter(rng, [(140, 60, 50), (80, 80, 90), (110, 80, 60)][int(rng.integers(0, 3))], 15)
                objs.append(RoadsideObject("house", float(x), float(y), float(rng.uniform(7, 14)),
                                           float(rng.uniform(3.5, 6.5)), wall, roof, side, extra=float(rng.uniform(1.5, 3.5))))
        return objs

    # -- rendering ------------------------------------------------------------------------------
    def render(self, pose) -> np.ndarray:
        """(288, 512, 3) uint8: the view from world pose (x, y, yaw)."""
        ex, ey, yaw = (float(v) for v in pose)
        img = np.empty((HEIGHT, WIDTH, 3), np.float32)
        # Sky and hills from the world-fixed panorama.
        az = (yaw + _COL_AZ) % (2 * np.pi)
        cols = (az * (PANO_COLUMNS / (2 * np.pi))).astype(np.int64) % PANO_COLUMNS
        img[:FIRST_GROUND_ROW] = self.pano[:, cols]
        img[FIRST_GROUND_ROW:] = self._render_ground(ex, ey, yaw)
        out = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8))
        self._draw_objects(out, ex, ey, yaw)
        return np.asarray(out)

    def _render_ground(self, ex, ey, yaw) -> np.ndarray:
        c, s = np.float32(math.cos(yaw)), np.float32(math.sin(yaw))
        D, L = _GROUND_D, _GROUND_L
        qx = c * D - s * L  # world offsets from the ego
        qy = s * D + c * L
        s_ego, _ = self.road.to_road_frame(ex, ey)
        S, N = self.road.project(qx, qy, ex, ey, (s_ego - MAX_DIST - 30, s_ego + MAX_DIST + 30))
        S = S - np.float32(s_ego)  # relative arc length: keeps float32 precise
        # Footprint of a pixel in road coordinates, for anti-aliasing.
        mN = _footprint(N)
        mS = _footprint(S)
        hw = np.float32(self.half_width)
        absn = np.abs(N)

        # Fields: low-frequency patches in world coordinates + rows of crops along the road.
        wx, wy = qx + np.float32(ex), qy + np.float32(ey)
        tex = np.zeros_like(N)
        for (kx, ky), ph in zip(self.tex_k, self.tex_phase):
            tex += np.sin(np.float32(kx) * wx + np.float32(ky) * wy + np.float32(ph))
        mix = np.clip(0.5 + tex / 4, 0, 1)
        stripes = _periodic_cover(S + np.float32(s_ego % self.stripe_period), mS, self.stripe_period, self.stripe_period / 2)
        mix = np.clip(mix + np.float32(self.stripe_amount) * (stripes - 0.5) * 2, 0, 1)
        col = self.grass[None, None, :].astype(np.float32) * (1 - mix[..., None]) + self.grass2.astype(np.float32) * mix[..., None]

        # Shoulder and asphalt.
        shoulder = _band_cover(absn, mN, hw - 0.01, hw + np.float32(self.shoulder))
        col = _blend(col, self.shoulder_col, shoulder)
        road = _band_cover(absn, mN, -1.0, hw)
        patch = 1 + np.float32(0.05) * np.sin(np.float32(self.patch_k) * (S + np.float32(s_ego % 100.0)) + np.float32(self.patch_phase))
        asphalt = self.asphalt.astype(np.float32)[None, None, :] * patch[..., None]
        col = col * (1 - road[..., None]) + asphalt * road[..., None]
        # Tyre tracks: slightly darker bands in every lane.
        tracks = np.zeros_like(N)
        for lane in range(self.n_lanes):
            centre = self.lane_centre(lane)
            for off in (-0.8, 0.8):
                tracks += _band_cover(N, mN, centre + off - 0.3, centre + off + 0.3)
        col *= (1 - np.float32(0.1) * np.clip(tracks, 0, 1) * road)[..., None]

        # Markings.
        mw = np.float32(self.mark_width)
        edge = _band_cover(absn, mN, hw - 0.1 - mw, hw - 0.1)
        col = _blend(col, self.white, edge)
        dash_phase = np.float32(s_ego % self.dash_period)
        dashes = _periodic_cover(S + dash_phase, mS, self.dash_period, self.dash_length)
        for i in range(1, self.n_lanes):
            n_line = -self.half_width + i * self.lane_width
            line = _band_cover(N, mN, n_line - mw / 2, n_line + mw / 2)
            if self.yellow_centre:
                col = _blend(col, self.yellow, line * dashes)
            else:
                col = _blend(col, self.white, line * dashes)

        # Haze with distance.
        fog = (1 - np.exp(-D / np.float32(self.fog_dist)))[..., None]
        col = col * (1 - fog) + self.haze.astype(np.float32) * fog
        return col

    def _draw_objects(self, img: Image.Image, ex, ey, yaw) -> None:
        if not self.objects:
            return
        c, s = math.cos(yaw), math.sin(yaw)
        xs = np.array([o.x for o in self.objects]) - ex
        ys = np.array([o.y for o in self.objects]) - ey
        fwd = c * xs + s * ys
        lat = -s * xs + c * ys
        visible = np.nonzero((fwd > 1.0) & (fwd < MAX_DIST) & (np.abs(lat) < fwd * 1.3 + 15))[0]
        if len(visible) == 0:
            return
        draw = ImageDraw.Draw(img)
        haze = self.haze
        for i in visible[np.argsort(-fwd[visible])]:
            o = self.objects[i]
            d = fwd[i]
            f = FOCAL / d
            u = CX - lat[i] * f
            v_ground = HORIZON_ROW + CAM_HEIGHT * f
            fog = 1 - math.exp(-d / self.fog_dist)

            def col(rgb, k=1.0):
                return tuple(int(round((1 - fog) * v * k + fog * h)) for v, h in zip(rgb, haze))

            if o.kind == "tree":
                tw = max(0.35 * f, 1.0)
                trunk_top = v_ground - o.extra * f
                draw.rectangle([u - tw / 2, trunk_top, u + tw / 2, v_ground], fill=col(o.colour2))
                top = v_ground - o.height * f
                cw = o.width * f
                draw.ellipse([u - cw / 2, top, u + cw / 2, trunk_top + 0.15 * (trunk_top - top)], fill=col(o.colour))
                draw.ellipse([u - cw / 3, top + 0.08 * (trunk_top - top), u + cw / 8, top + 0.5 * (trunk_top - top)],
                             fill=col(o.colour, 1.15))
            elif o.kind == "pole":
                pw = max(o.width * f, 1.0)
                top = v_ground - o.height * f
                draw.rectangle([u - pw / 2, top, u + pw / 2, v_ground], fill=col(o.colour))
                arm = -o.side * 1.8 * f  # the lamp arm reaches over the road
                draw.rectangle([min(u, u + arm), top, max(u, u + arm), top + max(0.15 * f, 1.0)], fill=col(o.colour))
                lx = u + arm
                draw.rectangle([lx - 0.3 * f, top, lx + 0.3 * f, top + max(0.25 * f, 1.0)], fill=col(o.colour2))
            elif o.kind == "post":
                pw = max(o.width * f, 1.0)
                top = v_ground - o.height * f
                draw.rectangle([u - pw / 2, top, u + pw / 2, v_ground], fill=col(o.colour))
                draw.rectangle([u - pw / 2, top + 0.1 * f, u + pw / 2, top + 0.25 * f], fill=col(o.colour2))
            else:  # house: a wall with a pitched roof, facing the camera
                w = o.width * f
                top = v_ground - o.height * f
                draw.rectangle([u - w / 2, top, u + w / 2, v_ground], fill=col(o.colour))
                roof_top = top - o.extra * f
                draw.polygon([(u - w / 2 - 0.05 * w, top), (u + w / 2 + 0.05 * w, top), (u, roof_top)], fill=col(o.colour2))
                win = max(0.9 * f, 1.0)
                for k in (-0.25, 0.25):
                    wx = u + k * w
                    wy = top + 0.35 * (v_ground - top)
                    draw.rectangle([wx - win / 2, wy - win / 2, wx + win / 2, wy + win / 2], fill=col((60, 70, 85)))


def _footprint(a: np.ndarray) -> np.ndarray:
    """Per pixel, how much `a` changes to the next pixel (rows or columns), for anti-aliasing."""
    du = np.abs(np.diff(a, axis=1, append=a[:, -1:]))
    du[:, -1] = du[:, -2]
    dv = np.abs(np.diff(a, axis=0, append=a[-1:, :]))
    dv[-1] = dv[-2]
    return np.clip(np.maximum(du, dv), np.float32(1e-3), np.float32(50.0))


def _band_cover(x, m, a, b):
    """Fraction of the pixel footprint [x - m/2, x + m/2] inside [a, b]."""
    half = m * np.float32(0.5)
    return np.clip((np.minimum(x + half, np.float32(b)) - np.maximum(x - half, np.float32(a))) / m, 0, 1)


def _periodic_cover(x, m, period, on):
    """Fraction of [x - m/2, x + m/2] inside the periodic pattern [0, on) + k * period."""
    period, on = np.float32(period), np.float32(on)

    def integral(t):
        return np.floor(t / period) * on + np.minimum(np.mod(t, period), on)

    half = m * np.float32(0.5)
    return np.clip((integral(x + half) - integral(x - half)) / m, 0, 1)


def _blend(col, rgb, alpha):
    a = alpha[..., None]
    return col * (1 - a) + np.asarray(rgb, np.float32) * a


@lru_cache(maxsize=64)
def make_world(seed: int) -> World:
    """The world of a seed (cached)."""
    return World(int(seed))


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


# --------------------------------------------------------------------------------------------
# Metrics


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 images (or stacks) of the same shape; inf when identical."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"psnr needs arrays of the same shape, got {a.shape} and {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


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


__all__ = [
    "CAM_HEIGHT", "FOCAL", "HEIGHT", "HORIZON_ROW", "WIDTH", "Road", "RolloutSpec", "Segment", "World",
    "bev_profile", "dataset_rollouts", "estimate_lateral_motion", "estimate_lateral_shift", "lane_offset",
    "make_world", "marking_weight", "psnr", "random_actions", "render_dataset_rollout", "render_frame",
    "render_rollout", "rollout_poses", "rollout_spec", "ssim", "trajectory_to_actions",
]
