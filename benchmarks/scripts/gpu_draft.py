"""Issue 17: the previous-frame draft (`--draft previous-frame`) against no drafting, one engine
per process, one JSON line per run appended to $OUT/draft.jsonl.

  python3 benchmarks/scripts/gpu_draft.py LABEL --checkpoint mini|random [--draft-tokens K]
      [--temperature 0.9] [--frames 11] [--rollouts 1] [--quantization fp8]

`mini` is the embedded terra-mini with 3 true context frames of held-out synthetic world 1003
(`left`, 30 km/h), so proposals can be kept; `random` is a Terra-size checkpoint with random bf16
weights (nothing repeats, so nearly every proposal is rejected: the verification's cost alone).
Records s/frame over the generated frames after a warm-up, codes kept per engine step, and the
time of one engine step (with drafting: one verification of K proposals plus the draft's steps).
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def mini_inputs(frames: int):
    from terra_cli.actions import preset_actions
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.synthetic.dataset import render_rollout
    from tokenizer_decoder import ImageTokenizer

    actions = np.asarray(preset_actions("left", frames, 30.0), dtype=np.float32)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = ImageTokenizer.from_pretrained(str(default_tokenizer_dir()), None, device=device)
    context = tokenizer.tokenize(list(render_rollout(1003, actions[:3])))
    return context, actions


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--checkpoint", default="random", help="mini, random, or a directory")
    parser.add_argument("--draft-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--frames", type=int, default=11)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra engine argument key=json")
    args = parser.parse_args()
    from terra_cli.runtime import configure_vllm_env

    configure_vllm_env()
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.bench.cache import write_random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import bench_inputs, timed_generate, tokens_per_step
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.default import default_world_model_dir

    if args.checkpoint == "mini":
        ckpt = default_world_model_dir()
    elif args.checkpoint == "random":
        ckpt = Path("/tmp/terra_random")
        if not (ckpt / "config.json").exists():
            write_random_terra_checkpoint(ckpt, "cuda")
    else:
        ckpt = Path(args.checkpoint)
    layout = load_config(ckpt).layout
    if args.checkpoint == "mini":
        context, actions = mini_inputs(args.frames)
    else:
        context, actions = bench_inputs(layout, 3, args.frames, seed=0)
    options = {"disable_log_stats": False}
    if args.draft_tokens:
        options["draft_tokens"] = args.draft_tokens
    if args.quantization:
        options["quantization"] = args.quantization
    for item in args.vllm_arg:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    started = time.perf_counter()
    backend = VllmBackend(ckpt, max_rollouts=max(args.rollouts, 1), **options)
    startup = time.perf_counter() - started
    sampling = Sampling(temperature=args.temperature, seed=1)
    timed_generate(backend, context, actions, min(5, args.frames), sampling, rollouts=args.rollouts)  # warm-up
    before = backend.speculation_counts()
    tokens, times = timed_generate(backend, context, actions, args.frames, sampling, rollouts=args.rollouts)
    after = backend.speculation_counts()
    backend.close()
    generated = len(times) * args.rollouts * layout.image_tokens
    steps = (after["drafts"] - before["drafts"]) / args.rollouts if args.draft_tokens else generated / args.rollouts
    row = {
        "label": args.label, "checkpoint": args.checkpoint, "draft_tokens": args.draft_tokens,
        "quantization": args.quantization, "vllm_args": args.vllm_arg, "temperature": args.temperature, "rollouts": args.rollouts,
        "startup_s": round(startup, 1), "s_per_frame": round(statistics.fmean(times), 4),
        "frames": [round(t, 3) for t in times],
        "codes_per_step": tokens_per_step(before, after) if args.draft_tokens else 1.0,
        "ms_per_step": round(1000 * sum(times) / steps, 3),
        "accepted_of_proposed": round((after["accepted"] - before["accepted"]) / max(after["draft_tokens"] - before["draft_tokens"], 1), 4)
        if args.draft_tokens else None,
        "repeat_of_previous_frame": round(float((tokens[:, 3:] == tokens[:, 2:-1]).mean()), 4),
    }
    print(json.dumps(row), flush=True)
    with open(Path(os.environ.get("OUT", ".")) / "draft.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
