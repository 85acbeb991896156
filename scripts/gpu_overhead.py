"""Per-step overhead experiment for the vLLM backend on one GPU (one rollout, Terra-size model).

  python3 scripts/gpu_overhead.py LABEL [--frames 9] [--temperature 0.9] [--vllm-arg key=json ...]

Appends one JSON line per run to $OUT/overhead.jsonl: s/frame and ms/token after a warm-up.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--checkpoint", default="/tmp/terra_random")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--vllm-arg", action="append", default=[])
    args = parser.parse_args()
    from terra_cli.backend_vllm import VllmBackend
    from terra_cli.bench import bench_inputs, timed_generate, write_random_terra_checkpoint
    from terra_cli.world_model import Sampling

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        write_random_terra_checkpoint(ckpt, "cuda")
    options = {}
    for item in args.vllm_arg:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    t0 = time.perf_counter()
    backend = VllmBackend(ckpt, device="cuda", max_rollouts=max(args.rollouts, 1), **options)
    startup = time.perf_counter() - t0
    layout = backend.config.layout
    context, actions = bench_inputs(layout, 3, args.frames, seed=0)
    sampling = Sampling(temperature=args.temperature, seed=1)
    backend.generate(context, actions, 4, sampling)  # warm-up
    _, times = timed_generate(backend, context, actions, args.frames, sampling, rollouts=args.rollouts)
    backend.close()
    row = {
        "label": args.label, "options": options, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_USE_V2")},
        "rollouts": args.rollouts, "temperature": args.temperature, "startup_s": round(startup, 1),
        "s_per_frame": round(statistics.fmean(times), 4), "frames": [round(t, 3) for t in times],
        "ms_per_step": round(1000 * statistics.fmean(times) / layout.image_tokens, 3),
    }
    print(json.dumps(row), flush=True)
    with open(Path(os.environ.get("OUT", ".")) / "overhead.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
