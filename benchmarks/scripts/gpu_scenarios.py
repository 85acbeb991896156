"""Scenario throughput on one GPU (issues 15, 16): N scenarios of F frames through continuous
batching (terra_cli/backends/vllm_stream.py) on the Terra-size random model. Lab probe.

Reports aggregate generated frames/s, the GPU busy fraction while scenarios are in flight (NVML,
sampled every 100 ms), engine start-up, optionally the lockstep figure (all rollouts advancing
frame by frame through VllmBackend.generate) on the same engine, and optionally the teacher-forced
argmax agreement of this engine's KV-cache dtype with a bf16-KV engine on the same tokens.

    python3 benchmarks/scripts/gpu_scenarios.py --scenarios 256 --max-rollouts 128 --lockstep 64
    python3 benchmarks/scripts/gpu_scenarios.py --scenarios 256 --max-rollouts 128 --kv-cache-dtype fp8 --agreement
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np


class BusySampler:
    """Mean GPU utilization (NVML's 'percent of time a kernel was running') while active."""

    def __init__(self, interval: float = 0.1):
        self.samples: list[int] = []
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
        except Exception:
            return
        while not self.stop.is_set():
            self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            time.sleep(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def busy(self) -> float | None:
        return round(float(np.mean(self.samples)) / 100, 3) if self.samples else None


def scenario_jobs(layout, count: int, frames: int, context_frames: int, seed: int):
    from terra_cli.actions import preset_actions
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.vllm_stream import RolloutJob

    rng = np.random.default_rng(seed)
    presets = ["left", "right", "straight", "stop", "accelerate"]
    jobs = []
    for i in range(count):
        context = rng.integers(0, layout.image_vocab_size, size=(context_frames, layout.image_tokens))
        speed = float(rng.uniform(10, 50))
        actions = preset_actions(presets[i % len(presets)], frames, speed)
        jobs.append(RolloutJob(f"s{i:05d}", context, actions, frames, Sampling(temperature=0.9, seed=seed + i)))
    return jobs


def teacher_forced_argmax(backend, layout, context, actions, frames: int, positions: int):
    """Generate `frames` frames (temperature 0.9, seed 0), then the argmax at the first `positions`
    image positions of the first and the last generated frame, each given the true prefix."""
    from terra_cli.backends.base import Sampling

    tokens = backend.generate(context, actions, frames, Sampling(temperature=0.9, seed=0))[0]
    return tokens, _argmax_over(backend, tokens, actions, context.shape[0], positions)


def _argmax_over(backend, tokens, actions, first_generated: int, positions: int) -> np.ndarray:
    """One request per position (max_tokens=1, greedy) whose prompt is the true prefix up to it:
    action ids lie past the vocabulary, so vLLM's prompt_logprobs cannot score them in one pass.
    The shared prefix comes from the prefix cache."""
    from vllm import SamplingParams

    from terra_cli.backends.vllm import interleave

    frames = tokens.shape[0]
    ids = backend.action_rows.ids_for(actions[None, :frames])[0]
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    best = []
    for frame in (first_generated, frames - 1):
        prefix = interleave(tokens[:frame], ids[:frame])
        prompts = [{"prompt_token_ids": prefix + tokens[frame][:i].tolist()} for i in range(positions)]
        outs = backend.llm.generate(prompts, params, use_tqdm=False)
        best.extend(o.outputs[0].token_ids[0] for o in outs)
    return np.array(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", type=int, default=256)
    ap.add_argument("--frames", type=int, default=25)
    ap.add_argument("--context-frames", type=int, default=3)
    ap.add_argument("--max-rollouts", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="none", help="weight quantization of the measured engine (fp8)")
    ap.add_argument("--lockstep", type=int, default=0, help="also run this many rollouts in lockstep")
    ap.add_argument("--agreement", action="store_true", help="teacher-forced argmax agreement with a bf16-KV engine")
    ap.add_argument("--agreement-positions", type=int, default=576, help="image positions per compared frame")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="default: the bench's random Terra-size model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--label", default="run")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))

    from terra_cli.runtime import configure_vllm_env

    configure_vllm_env()
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.backends.vllm_stream import StreamDriver
    from terra_cli.bench.cache import random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.models.checkpoint import load_config

    ckpt = Path(args.model) if args.model else random_terra_checkpoint(args.device, 0)
    layout = load_config(ckpt).layout
    report = {"label": args.label, "args": vars(args), "environment": environment()}
    options = engine_options(args.kv_cache_dtype, args.quantization)
    rng = np.random.default_rng(1234)
    agree_context = rng.integers(0, layout.image_vocab_size, size=(args.context_frames, layout.image_tokens))
    from terra_cli.actions import preset_actions

    agree_actions = preset_actions("left", 8, 30.0)
    agree_frames = min(6, layout.max_frames - 1)
    if args.agreement:
        reference = VllmBackend(ckpt, device=args.device, max_rollouts=2)
        ref_tokens, ref_argmax = teacher_forced_argmax(reference, layout, agree_context, agree_actions, agree_frames,
                                                       args.agreement_positions)
        reference.close()
        del reference

    started = time.perf_counter()
    backend = VllmBackend(ckpt, device=args.device, max_rollouts=max(args.max_rollouts, args.lockstep or 1), **options)
    report["startup_s"] = round(time.perf_counter() - started, 2)
    report["startup_phases"] = {k: v for k, v in backend.startup.items() if k != "timeline"}
    print(f"engine ready in {report['startup_s']} s", flush=True)

    if args.agreement:
        argmax = _argmax_over(backend, ref_tokens, agree_actions, args.context_frames, args.agreement_positions)
        report["teacher_forced_argmax_agreement_with_bf16"] = round(float((argmax == ref_argmax).mean()), 4)
        report["agreement_positions"] = int(argmax.size)
        print("agreement", report["teacher_forced_argmax_agreement_with_bf16"], flush=True)

    jobs = scenario_jobs(layout, args.scenarios, args.frames, args.context_frames, args.seed)
    # Warm-up: one short job pays the one-off costs before the clock starts.
    StreamDriver(backend, 1).run(scenario_jobs(layout, 1, args.context_frames + 1, args.context_frames, 99))
    driver = StreamDriver(backend, args.max_rollouts)
    done_times: list[float] = []
    frames_done = [0]

    def on_frame(job, index, tokens):
        frames_done[0] += 1

    def on_done(job, tokens):
        done_times.append(time.perf_counter())

    started = time.perf_counter()
    with BusySampler() as sampler:
        driver.run(jobs, on_frame=on_frame, on_done=on_done)
    seconds = time.perf_counter() - started
    generated = args.scenarios * (args.frames - args.context_frames)
    report["stream"] = {
        "scenarios": args.scenarios, "frames": args.frames, "max_in_flight": driver.max_in_flight,
        "seconds": round(seconds, 2), "generated_frames": frames_done[0],
        "generated_frames_per_s": round(frames_done[0] / seconds, 3), "gpu_busy": sampler.busy,
        "prefix_cache_hit_rate": round(driver.cached_tokens / max(driver.prompt_tokens, 1), 4),
        "projected_act_bench_hours": round(2286 * 44 / (frames_done[0] / seconds) / 3600, 3),
    }
    assert frames_done[0] == generated, (frames_done[0], generated)
    print(json.dumps(report["stream"]), flush=True)

    if args.lockstep:
        from terra_cli.backends.base import Sampling

        context = np.broadcast_to(jobs[0].context, (args.lockstep, *jobs[0].context.shape))
        actions = np.broadcast_to(jobs[0].actions, (args.lockstep, *jobs[0].actions.shape))
        started = time.perf_counter()
        with BusySampler() as sampler:
            backend.generate(context, actions, args.frames, Sampling(temperature=0.9, seed=0))
        seconds = time.perf_counter() - started
        frames = args.lockstep * (args.frames - args.context_frames)
        report["lockstep"] = {"rollouts": args.lockstep, "seconds": round(seconds, 2),
                              "generated_frames_per_s": round(frames / seconds, 3), "gpu_busy": sampler.busy}
        print(json.dumps(report["lockstep"]), flush=True)
    backend.close()
    (out_dir / f"scenarios-{args.label}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
