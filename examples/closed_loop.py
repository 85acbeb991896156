"""Closed loop on the embedded terra-mini: a planner that keeps the car on the road, against the
open-loop `left` preset, which leaves it.

Each planning step forks the car's state into K branches (terra_cli.env's `fork`), drives each
with one candidate steering command for `--horizon` frames (the K branches step together: one
batch), scores each by the road pixels ahead in its decoded last frame, and keeps the best
(`select`). Open loop drives `left` for the same number of frames from the same context and seed.

    python examples/closed_loop.py                      # 50 frames, 5 candidates, horizon 2
    python examples/closed_loop.py --backend hf --device cpu --frames 16 --candidates 3 --horizon 2
                                                        # the small CPU run: a few minutes on 2 cores

It prints, for both runs, the share of road pixels ahead every few frames and how many frames
kept the road in view; `--strip out.png` writes both runs side by side (every 5th frame).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

ROAD_ROWS, ROAD_COLUMNS = (160, 284), (128, 384)  # below the horizon, the middle half: what lies ahead
ON_ROAD = 0.3  # a frame whose road share ahead is above this still has the road in front of the car


def road_share(frame: np.ndarray) -> float:
    """The share of pixels ahead that are asphalt (grey, unsaturated) or lane markings."""
    from terra_cli.synthetic.metrics import marking_weight

    ahead = np.asarray(frame, np.float32)[slice(*ROAD_ROWS), slice(*ROAD_COLUMNS)]
    saturation, brightness = ahead.max(-1) - ahead.min(-1), ahead.mean(-1)
    asphalt = (saturation < 28) & (brightness > 35) & (brightness < 140)
    return float((asphalt | (marking_weight(ahead) > 0.5)).mean())


def steering(speed_kmh: float) -> dict[str, np.ndarray]:
    """Candidate commands: blends of terra's straight and left/right presets (one frame's waypoints)."""
    from terra_cli.actions import preset_actions

    straight, left, right = (preset_actions(name, 1, speed_kmh)[0] for name in ("straight", "left", "right"))
    return {"left": left, "half-left": (straight + left) / 2, "straight": straight,
            "half-right": (straight + right) / 2, "right": right}


def open_loop(env, seed: int, command: np.ndarray) -> np.ndarray:
    env.reset(seed=seed)
    truncated = np.array([False])
    while not truncated[0]:
        _, _, _, truncated, _ = env.step(command[None])
    return env.tokens(0)


def closed_loop(env, seed: int, commands: dict[str, np.ndarray], candidates: int, horizon: int) -> tuple[np.ndarray, list]:
    names = [list(commands)[i] for i in sorted(set(np.linspace(0, len(commands) - 1, candidates).round().astype(int)))]
    env.reset(seed=seed)
    chosen = []
    while env.states[0].frames < env.max_frames:
        env.select(env.fork(0, len(names)))  # the parent's state, once per candidate
        steps = min(horizon, env.max_frames - env.states[0].frames)
        for _ in range(steps):
            env.step(np.stack([commands[name] for name in names]))
        last = env.tokenizer.decode_tokens(np.stack([env.tokens(i)[-1] for i in range(len(names))]))  # one batch
        scores = [road_share(frame) for frame in last]
        best = int(np.argmax(scores))
        chosen.append((env.states[0].frames - steps, names[best], round(scores[best], 3)))
        env.select([best])
    return env.tokens(0), chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", help="auto, hf or vllm")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--frames", type=int, default=50, help="frames per run, the 3 context frames included")
    parser.add_argument("--candidates", type=int, default=5, help="steering commands tried each planning step (1-5)")
    parser.add_argument("--horizon", type=int, default=2, help="frames each candidate is rolled out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed", type=float, default=30.0, help="km/h")
    parser.add_argument("--strip", help="write both runs side by side to this PNG (every 5th frame)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --strip file")
    args = parser.parse_args()
    if args.strip and Path(args.strip).exists() and not args.overwrite:
        parser.error(f"--strip {args.strip} exists; pass --overwrite to replace it")  # before minutes of generation

    from terra_cli.env import TerraVectorEnv

    env = TerraVectorEnv.load(1, backend=args.backend, device=args.device, observation="tokens",
                              max_frames=args.frames, speed_kmh=args.speed,
                              # room for the candidates beside the slots of the state they fork from (vLLM)
                              max_in_flight=2 * args.candidates + 1)
    commands = steering(args.speed)
    began = time.perf_counter()
    open_tokens = open_loop(env, args.seed, commands["left"])
    open_seconds = time.perf_counter() - began
    closed_tokens, chosen = closed_loop(env, args.seed, commands, args.candidates, args.horizon)
    closed_seconds = time.perf_counter() - began - open_seconds
    open_frames, closed_frames = env.tokenizer.decode_tokens(open_tokens), env.tokenizer.decode_tokens(closed_tokens)
    open_road = [road_share(f) for f in open_frames]
    closed_road = [road_share(f) for f in closed_frames]
    context = env.states[0].context_frames
    print(f"frames {args.frames} ({context} context), candidates {args.candidates}, horizon {args.horizon}, "
          f"seed {args.seed}, backend {env.engine.backend.name}")
    print("frame  open-loop left  closed loop   (share of road pixels ahead)")
    for index in range(0, args.frames, 5):
        print(f"{index:5d}  {open_road[index]:14.2f}  {closed_road[index]:11.2f}")
    for name, road, seconds in (("open loop (left)", open_road, open_seconds), ("closed loop", closed_road, closed_seconds)):
        kept = sum(share > ON_ROAD for share in road[context:])
        print(f"{name:17s}: road in view in {kept}/{len(road) - context} generated frames ({seconds:.0f} s)")
    print("planner's choices (from frame, command, score):", chosen)
    if env.engine.prefix_cache is not None:
        cached, prompt = env.engine.prefix_cache
        print(f"prefix cache: {cached} of {prompt} prompt tokens served from the cache")
    if args.strip:
        from PIL import Image

        rows = [np.concatenate([f[::2, ::2] for f in frames[::5]], axis=1) for frames in (open_frames, closed_frames)]
        from terra_cli.media.atomic import atomic_path

        # Written beside its target and moved into place whole; an existing file only with --overwrite.
        with atomic_path(Path(args.strip), overwrite=args.overwrite) as tmp:
            Image.fromarray(np.concatenate(rows, axis=0)).save(tmp, format="PNG")
        print(f"strip: {args.strip} (top: open loop, bottom: closed loop)")
    env.close()


if __name__ == "__main__":
    main()
