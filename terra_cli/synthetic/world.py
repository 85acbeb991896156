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
by the motion implied by frame k's waypoints (`dataset.rollout_poses`, the same dead reckoning that
`summarize_actions` uses). `dataset.render_rollout(world_seed, actions)` renders those poses.

The pieces: `camera` (the pinhole and its ground rays), `road` (the centreline and lanes), `objects`
(roadside objects and their drawing), `coverage` (anti-aliased bands), this module (the world and its
rendering), `dataset` (ego motion, rollouts, training trajectories) and `metrics` (SSIM and
lane-marking metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image

from terra_cli.synthetic.camera import (FIRST_GROUND_ROW, FOCAL, HEIGHT, HORIZON_ROW, MAX_DIST, PANO_COLUMNS, WIDTH,
                                        _COL_AZ, _GROUND_D, _GROUND_L, _rng)
from terra_cli.synthetic.coverage import band_cover, blend, footprint, periodic_cover
from terra_cli.synthetic.objects import RoadsideObject, draw_objects
from terra_cli.synthetic.road import Road

# --------------------------------------------------------------------------------------------
# The world


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
        draw_objects(out, self.objects, self.haze, self.fog_dist, ex, ey, yaw)
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
        mN = footprint(N)
        mS = footprint(S)
        hw = np.float32(self.half_width)
        absn = np.abs(N)

        # Fields: low-frequency patches in world coordinates + rows of crops along the road.
        wx, wy = qx + np.float32(ex), qy + np.float32(ey)
        tex = np.zeros_like(N)
        for (kx, ky), ph in zip(self.tex_k, self.tex_phase):
            tex += np.sin(np.float32(kx) * wx + np.float32(ky) * wy + np.float32(ph))
        mix = np.clip(0.5 + tex / 4, 0, 1)
        stripes = periodic_cover(S + np.float32(s_ego % self.stripe_period), mS, self.stripe_period, self.stripe_period / 2)
        mix = np.clip(mix + np.float32(self.stripe_amount) * (stripes - 0.5) * 2, 0, 1)
        col = self.grass[None, None, :].astype(np.float32) * (1 - mix[..., None]) + self.grass2.astype(np.float32) * mix[..., None]

        # Shoulder and asphalt.
        shoulder = band_cover(absn, mN, hw - 0.01, hw + np.float32(self.shoulder))
        col = blend(col, self.shoulder_col, shoulder)
        road = band_cover(absn, mN, -1.0, hw)
        patch = 1 + np.float32(0.05) * np.sin(np.float32(self.patch_k) * (S + np.float32(s_ego % 100.0)) + np.float32(self.patch_phase))
        asphalt = self.asphalt.astype(np.float32)[None, None, :] * patch[..., None]
        col = col * (1 - road[..., None]) + asphalt * road[..., None]
        # Tyre tracks: slightly darker bands in every lane.
        tracks = np.zeros_like(N)
        for lane in range(self.n_lanes):
            centre = self.lane_centre(lane)
            for off in (-0.8, 0.8):
                tracks += band_cover(N, mN, centre + off - 0.3, centre + off + 0.3)
        col *= (1 - np.float32(0.1) * np.clip(tracks, 0, 1) * road)[..., None]

        # Markings.
        mw = np.float32(self.mark_width)
        edge = band_cover(absn, mN, hw - 0.1 - mw, hw - 0.1)
        col = blend(col, self.white, edge)
        dash_phase = np.float32(s_ego % self.dash_period)
        dashes = periodic_cover(S + dash_phase, mS, self.dash_period, self.dash_length)
        for i in range(1, self.n_lanes):
            n_line = -self.half_width + i * self.lane_width
            line = band_cover(N, mN, n_line - mw / 2, n_line + mw / 2)
            if self.yellow_centre:
                col = blend(col, self.yellow, line * dashes)
            else:
                col = blend(col, self.white, line * dashes)

        # Haze with distance.
        fog = (1 - np.exp(-D / np.float32(self.fog_dist)))[..., None]
        col = col * (1 - fog) + self.haze.astype(np.float32) * fog
        return col

@lru_cache(maxsize=64)
def make_world(seed: int) -> World:
    """The world of a seed (cached)."""
    return World(int(seed))


