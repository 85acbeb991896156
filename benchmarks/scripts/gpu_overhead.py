"""Per-step overhead experiment for the vLLM backend on one GPU.

  python3 benchmarks/scripts/gpu_overhead.py LABEL [--checkpoint DIR|mini] [--plain] [--frames 9] [--rollouts 1]
                                        [--max-rollouts N] [--temperature 0.9] [--gc-off]
                                        [--profile-steps N] [--vllm-arg key=json ...]

`--checkpoint mini` is the embedded terra-mini; the default is a random Terra-size checkpoint.
`--plain` runs vLLM's own LlamaForCausalLM with the same decoder dimensions and random weights on
the same frame loop, action slots replaced by code 0: what Terra's multimodal path adds per step
is the difference to the run without `--plain`.

Appends one JSON line per run to $OUT/overhead.jsonl: s/frame and ms/token after a warm-up.
"""

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def write_plain_llama(like_dir: Path, out_dir: Path) -> Path:
    """vLLM's stock Llama with the decoder dimensions of `like_dir`'s world model, random bf16 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from terra_cli.models.checkpoint import load_config

    terra = load_config(like_dir)
    config = LlamaConfig(
        hidden_size=terra.hidden_size, intermediate_size=terra.intermediate_size,
        num_hidden_layers=terra.num_hidden_layers, num_attention_heads=terra.num_attention_heads,
        num_key_value_heads=terra.num_key_value_heads, vocab_size=terra.vocab_size,
        max_position_embeddings=terra.max_position_embeddings, rms_norm_eps=terra.rms_norm_eps,
        rope_theta=getattr(terra, "rope_theta", 10000.0), tie_word_embeddings=False,
        bos_token_id=terra.bos_token_id, eos_token_id=terra.eos_token_id, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


class PlainLlamaLoop:
    """The backend's frame loop (prompt grows by a frame and 6 slots per call) without actions."""

    def __init__(self, checkpoint_dir: Path, layout, max_rollouts: int, **options):
        from vllm import LLM

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.layout = layout
        self.llm = LLM(model=str(checkpoint_dir), skip_tokenizer_init=True, dtype="bfloat16",
                       max_model_len=layout.max_positions, max_num_seqs=max_rollouts, enable_prefix_caching=True,
                       generation_config="vllm", gpu_memory_utilization=0.85, seed=0, **options)

    def generate(self, context, actions, num_frames, sampling, on_frame=None):
        from vllm import SamplingParams

        from terra_cli.backends.vllm import interleave

        rollouts, k = context.shape[:2]
        slots = [0] * self.layout.action_tokens
        prompts = [interleave(context[r], np.zeros((k, len(slots)), dtype=np.int64)) for r in range(rollouts)]
        frames = np.zeros((rollouts, num_frames, self.layout.image_tokens), dtype=np.int64)
        for f in range(k, num_frames):
            params = [SamplingParams(max_tokens=self.layout.image_tokens, ignore_eos=True, temperature=sampling.temperature,
                                     seed=r * 1_000_003 + f, detokenize=False) for r in range(rollouts)]
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for r, out in enumerate(outputs):
                frames[r, f] = out.outputs[0].token_ids
                prompts[r] = prompts[r] + list(out.outputs[0].token_ids) + slots
            if on_frame is not None:
                on_frame(f, frames[:, f])
        return frames

    def close(self):
        del self.llm


def profile_steps(backend, context, actions, args) -> dict:
    """One request of `--profile-steps` decode steps on the 3 context frames, under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    from gpu_profile import kernel_stats
    from terra_cli.backends.vllm import interleave

    k = len(context)
    if args.plain:
        action_ids = np.zeros((k, backend.layout.action_tokens), dtype=np.int64)
    else:
        action_ids = backend.action_rows.ids_for(actions[:k])
    request = {"prompt_token_ids": interleave(context, action_ids)}
    params = SamplingParams(max_tokens=args.profile_steps, ignore_eos=True, temperature=args.temperature, seed=1, detokenize=False)
    backend.llm.generate([request], params, use_tqdm=False)  # the prompt is cached from here on
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        backend.llm.generate([request], params, use_tqdm=False)
    stats = kernel_stats(prof, args.profile_steps, args.label)
    launches = {e.key: e.count for e in prof.key_averages() if e.key in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync")}
    stats["cpu_launches_per_step"] = {k: round(v / args.profile_steps, 1) for k, v in launches.items()}
    return stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--checkpoint", default="/tmp/terra_random")
    parser.add_argument("--plain", action="store_true", help="vLLM's stock Llama of the same size, no actions")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--max-rollouts", type=int, default=0,
                        help="the engine's max_num_seqs (default: --rollouts), e.g. 64 as `terra bench` uses")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--vllm-arg", action="append", default=[])
    parser.add_argument("--gc-off", action="store_true",
                        help="Python's cyclic garbage collector off while frames are generated")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="then profile this many decode steps (GPU-busy time, kernels and CPU launches per step)")
    args = parser.parse_args()
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.bench.cache import write_random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import bench_inputs, timed_generate
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.default import default_world_model_dir
    from terra_cli.backends.base import Sampling

    ckpt = default_world_model_dir() if args.checkpoint == "mini" else Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        write_random_terra_checkpoint(ckpt, "cuda")
    options = {}
    for item in args.vllm_arg:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    layout = load_config(ckpt).layout
    recorded_options = json.loads(json.dumps(options))  # vLLM adds its own objects to the dicts it is given
    engine_seqs = max(args.max_rollouts, args.rollouts, 1)
    if args.plain:
        plain_dir = Path(f"/tmp/plain_{ckpt.name}_{abs(hash(str(ckpt))) % 10**6}")
        if not (plain_dir / "config.json").exists():
            write_plain_llama(ckpt, plain_dir)
        t0 = time.perf_counter()
        backend = PlainLlamaLoop(plain_dir, layout, engine_seqs, **options)
    else:
        t0 = time.perf_counter()
        backend = VllmBackend(ckpt, max_rollouts=engine_seqs, **options)
    startup = time.perf_counter() - t0
    context, actions = bench_inputs(layout, 3, args.frames, seed=0)
    sampling = Sampling(temperature=args.temperature, seed=1)
    timed_generate(backend, context, actions, 4, sampling, rollouts=args.rollouts)  # warm-up
    if args.gc_off:
        gc.collect()
        gc.disable()
    _, times = timed_generate(backend, context, actions, args.frames, sampling, rollouts=args.rollouts)
    gc.enable()
    profile = profile_steps(backend, context, actions, args) if args.profile_steps else {}
    backend.close()
    row = {
        "label": args.label, "checkpoint": str(ckpt), "plain_llama": args.plain, "options": recorded_options, "gc_off": args.gc_off,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_USE_V2", "VLLM_ENABLE"))},
        "rollouts": args.rollouts, "max_rollouts": engine_seqs, "temperature": args.temperature, "startup_s": round(startup, 1),
        "s_per_frame": round(statistics.fmean(times), 4), "frames": [round(t, 3) for t in times],
        "ms_per_step": round(1000 * statistics.fmean(times) / layout.image_tokens, 3),
        **profile,
    }
    print(json.dumps(row), flush=True)
    with open(Path(os.environ.get("OUT", ".")) / "overhead.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
