"""The roadside objects of the synthetic world (trees, poles, posts, houses) and how they are drawn:
flat shapes scaled by the pinhole's 1/distance, standing on the ground, hazed with distance."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from terra_cli.synthetic.camera import CAM_HEIGHT, CX, FOCAL, HORIZON_ROW, MAX_DIST


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


def draw_objects(img: Image.Image, objects: list[RoadsideObject], haze, fog_dist: float, ex, ey, yaw) -> None:
    """Paint the objects in view onto `img`, farthest first, each hazed by its distance."""
    if not objects:
        return
    c, s = math.cos(yaw), math.sin(yaw)
    xs = np.array([o.x for o in objects]) - ex
    ys = np.array([o.y for o in objects]) - ey
    fwd = c * xs + s * ys
    lat = -s * xs + c * ys
    visible = np.nonzero((fwd > 1.0) & (fwd < MAX_DIST) & (np.abs(lat) < fwd * 1.3 + 15))[0]
    if len(visible) == 0:
        return
    draw = ImageDraw.Draw(img)
    for i in visible[np.argsort(-fwd[visible])]:
        o = objects[i]
        d = fwd[i]
        f = FOCAL / d
        u = CX - lat[i] * f
        v_ground = HORIZON_ROW + CAM_HEIGHT * f
        fog = 1 - math.exp(-d / fog_dist)

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
