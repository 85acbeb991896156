"""Where a decode step's time goes, on one GPU: wall time vs GPU-busy time per step, the top
kernels and the top CPU ops, for the vLLM backend (in-process engine) or the transformers
reference (greedy vs sampled steps).

  python3 benchmarks/scripts/gpu_profile.py vllm LABEL [--rollouts 1] [--context-frames 3,20] [--vllm-arg key=json ...]
  python3 benchmarks/scripts/gpu_profile.py hf LABEL [--steps 200]

Appends one JSON line per measurement to $OUT/profile.jsonl and writes the profiler tables to
$OUT/profile-LABEL-*.txt. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so torch.profiler sees the scheduler, the model runner and the GPU kernels together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "."))


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(OUT / "profile.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def kernel_stats(prof, steps: int, label: str) -> dict:
    """GPU-busy vs wall time from the kernel timeline, plus the heaviest kernels per step."""
    import torch

    trace = Path("/tmp") / f"trace-{label}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    stats = {"steps": steps}
    if kernels:
        start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
        busy, cursor = 0.0, start
        for e in kernels:  # union of intervals (streams may overlap)
            s, t = max(e["ts"], cursor), e["ts"] + e["dur"]
            if t > s:
                busy += t - s
                cursor = t
        per_kernel: dict[str, list[float]] = {}
        for e in kernels:
            per_kernel.setdefault(e["name"][:90], []).append(e["dur"])
        top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:14]
        stats.update(
            wall_ms_per_step=round((end - start) / 1000 / steps, 3),
            gpu_busy_ms_per_step=round(busy / 1000 / steps, 3),
            kernels_per_step=round(len(kernels) / steps, 1),
            top_kernels=[{"name": n, "per_step": round(len(d) / steps, 2), "us_per_step": round(sum(d) / steps, 1)} for n, d in top],
        )
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    (OUT / f"profile-{label}-cpu.txt").write_text(table)
    if torch.cuda.is_available():
        (OUT / f"profile-{label}-cuda.txt").write_text(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return stats


def profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities)


def run_vllm(args) -> None:
    if not args.multiprocess:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    from terra_cli.backends.vllm import VllmBackend, interleave
    from terra_cli.bench.cache import write_random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import bench_inputs, timed_generate
    from terra_cli.backends.base import Sampling

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        write_random_terra_checkpoint(ckpt, "cuda" if args.device == "cuda" else "cpu")
    options = {k: json.loads(v) for k, _, v in (a.partition("=") for a in args.vllm_arg)}
    t0 = time.perf_counter()
    backend = VllmBackend(ckpt, device=args.device, max_rollouts=max(args.rollouts, 1), **options)
    startup = time.perf_counter() - t0
    layout = backend.config.layout
    contexts = [int(c) for c in args.context_frames.split(",")]
    frames_needed = max(contexts) + args.timed_frames + 1
    context, actions = bench_inputs(layout, max(contexts), frames_needed, seed=0)
    sampling = Sampling(temperature=args.temperature, seed=1)
    for k in contexts:
        backend.generate(context[:k], actions, k + 1, sampling)  # warm-up + prefix cache
        _, times = timed_generate(backend, context[:k], actions, k + args.timed_frames, sampling, rollouts=args.rollouts)
        # The profiled part: `steps` decode steps of the same prompts (all cached but one frame).
        prompt = interleave(context[:k], backend.action_rows.ids_for(actions[:k]))
        requests = [{"prompt_token_ids": prompt}] * args.rollouts
        params = [SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=args.temperature, seed=r, detokenize=False)
                  for r in range(args.rollouts)]
        backend.llm.generate(requests, params, use_tqdm=False)
        label = f"{args.label}-r{args.rollouts}-k{k}"
        # Re-submission of the same (cached) prompts plus one decode step: the per-frame cost.
        one = [SamplingParams(max_tokens=1, ignore_eos=True, temperature=args.temperature, seed=r, detokenize=False)
               for r in range(args.rollouts)]
        admissions = []
        for _ in range(3):
            t1 = time.perf_counter()
            backend.llm.generate(requests, one, use_tqdm=False)
            admissions.append(round(1000 * (time.perf_counter() - t1), 1))
        row_base = {"label": label, "backend": "vllm", "options": options, "rollouts": args.rollouts, "context_frames": k,
                    "env": {k2: v for k2, v in os.environ.items() if k2.startswith(("VLLM_USE_", "VLLM_ENABLE_"))},
                    "startup_s": round(startup, 1), "frame_seconds": [round(t, 3) for t in times],
                    "s_per_frame": round(statistics.fmean(times), 4),
                    "ms_per_step_unprofiled": round(1000 * statistics.fmean(times) / layout.image_tokens, 3),
                    "resubmit_plus_one_step_ms": admissions}
        if args.multiprocess:  # the engine is in another process: nothing to profile here
            emit(row_base)
            continue
        with profiler() as prof:
            t1 = time.perf_counter()
            backend.llm.generate(requests, params, use_tqdm=False)
            call_s = time.perf_counter() - t1
        row = dict(row_base, profiled_call_ms_per_step=round(1000 * call_s / args.steps, 3))
        row.update(kernel_stats(prof, args.steps, label))
        emit(row)
        # Python-side breakdown of the same call (cProfile slows it down: not timed).
        import cProfile
        import io
        import pstats

        python_profile = cProfile.Profile()
        python_profile.enable()
        backend.llm.generate(requests, params, use_tqdm=False)
        python_profile.disable()
        text = io.StringIO()
        pstats.Stats(python_profile, stream=text).sort_stats("tottime").print_stats(35)
        pstats.Stats(python_profile, stream=text).sort_stats("cumulative").print_stats(60)
        (OUT / f"profile-{label}-python.txt").write_text(text.getvalue())
    backend.close()


def run_hf(args) -> None:
    """ms per decode step of the reference loop, each run on key lengths it has not seen yet
    (a fresh frame), with the backend's attention kernels and with torch's default choice."""
    from contextlib import nullcontext

    import torch
    from transformers.cache_utils import DynamicCache

    from terra_cli.backends.hf import HfBackend, _attention_backends, sample_next
    from terra_cli.bench.cache import write_random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import bench_inputs
    from terra_cli.backends.base import Sampling

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        write_random_terra_checkpoint(ckpt, "cuda" if args.device == "cuda" else "cpu")
    backend = HfBackend(ckpt, device=args.device)
    model, layout = backend.model, backend.model.layout
    device = model.lm_head.weight.device
    context, actions = bench_inputs(layout, 4, 5, seed=0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sampling = Sampling(temperature=args.temperature)

    def decode(k: int, steps: int, attention) -> float:
        slots = torch.full((1, k, layout.action_tokens), layout.action_placeholder_id, device=device)
        prompt = torch.cat([torch.tensor(context[:k], device=device)[None], slots], dim=2).reshape(1, -1)
        waypoints = torch.tensor(actions[:k], device=device).reshape(1, -1, 3)
        generators = [torch.Generator(device=device).manual_seed(0)]
        with torch.inference_mode(), attention:
            cache = DynamicCache(config=model.config)
            positions = torch.arange(prompt.shape[1], device=device)[None]
            logits, cache = model(prompt, positions, waypoints, cache, use_cache=True, logits_to_keep=1)
            position = prompt.shape[1]
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                token = sample_next(logits[:, -1], layout, sampling, generators)
                logits, cache = model(token[:, None], torch.tensor([[position]], device=device), None, cache,
                                      use_cache=True, logits_to_keep=1)
                position += 1
            sync()
            return 1000 * (time.perf_counter() - t0) / steps

    ours = _attention_backends(device)
    decode(1, 4, _attention_backends(device))  # one-off CUDA/cuBLAS initialisation, other lengths
    runs = [("backend-kernels-fresh", 3, ours), ("torch-default-fresh", 2, nullcontext()),
            ("torch-default-seen", 2, nullcontext()), ("backend-kernels-seen", 3, _attention_backends(device))]
    for name, k, attention in runs:
        emit({"label": f"{args.label}-{name}", "backend": "hf", "context_frames": k, "steps": args.steps,
              "ms_per_step": round(decode(k, args.steps, attention), 3)})
    with profiler() as prof:
        decode(4, 20, _attention_backends(device))
    row = {"label": f"{args.label}-backend-kernels-profiled", "backend": "hf"}
    row.update(kernel_stats(prof, 20, f"{args.label}-hf"))
    emit(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["vllm", "hf"])
    parser.add_argument("label")
    parser.add_argument("--checkpoint", default="/tmp/terra_random")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--context-frames", default="3")
    parser.add_argument("--timed-frames", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="profiled decode steps")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--vllm-arg", action="append", default=[])
    parser.add_argument("--multiprocess", action="store_true", help="engine in its own process (timings only)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (run_vllm if args.backend == "vllm" else run_hf)(args)


if __name__ == "__main__":
    main()
