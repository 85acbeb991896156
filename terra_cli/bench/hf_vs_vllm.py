"""`terra bench --hf-vs-vllm`: the transformers reference, the vLLM backend and the single-stream
backend (plain, and with `--draft jacobi`) on the same GPU, the same context tokens and the same
actions, plus vLLM throughput with parallel rollouts.

Engine start-up is timed separately from generation; per-frame times are wall-clock between
finished frames, so they include vLLM's per-frame prompt re-submission.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from terra_cli.actions import preset_actions
from terra_cli.backends.base import Sampling
from terra_cli.bench.engine_report import busy_while


@dataclass
class RunResult:
    backend: str
    rollouts: int
    generated_frames: int
    frame_seconds: list[float]
    startup_seconds: float
    tokens_per_frame: int
    peak_gpu_memory_gb: float | None = None
    prefix_cache_hit_rate: float | None = None
    notes: str = ""
    tokens_per_step: float | None = None  # with a draft: codes one engine step kept, per rollout
    ms_per_step: float | None = None  # single-stream: decode time per step (prefill and frame ends included)
    gpu_busy: float | None = None  # NVML's share of the timed frames' wall in which a kernel ran (None: a CPU)

    @property
    def total_seconds(self) -> float:
        return sum(self.frame_seconds)

    def summary(self) -> dict:
        s = self.frame_seconds
        total = self.total_seconds
        return {
            "backend": self.backend,
            "rollouts": self.rollouts,
            "generated_frames": self.generated_frames,
            "startup_s": round(self.startup_seconds, 3),
            "first_frame_s": round(s[0], 4) if s else None,
            "s_per_frame_mean": round(statistics.fmean(s), 4) if s else None,
            "s_per_frame_stdev": round(statistics.pstdev(s), 4) if len(s) > 1 else 0.0,
            "s_per_frame_min": round(min(s), 4) if s else None,
            "s_per_frame_max": round(max(s), 4) if s else None,
            "tokens_per_s": round(self.rollouts * self.tokens_per_frame * len(s) / total, 1) if total else None,
            "frames_per_s": round(self.rollouts * len(s) / total, 3) if total else None,
            "peak_gpu_memory_gb": self.peak_gpu_memory_gb,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "tokens_per_step": self.tokens_per_step,
            "ms_per_step": self.ms_per_step,
            "gpu_busy": self.gpu_busy,
            "frame_seconds": [round(x, 4) for x in s],
            "notes": self.notes,
        }


@dataclass
class BenchPlan:
    frames: int = 25
    context_frames: int = 3
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    hf_frames: int | None = None  # generated frames for the (slow) reference; None: all
    temperature: float = 0.9
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    run_hf: bool = True
    run_vllm: bool = True
    vllm_options: dict = field(default_factory=dict)
    run_single_stream: bool = True
    jacobi_draft_tokens: int = 0  # --draft jacobi: also a single-stream row with K drafts per step


def environment() -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        env["vllm"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def bench_inputs(layout, context_frames: int, frames: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random context codes and a gentle left curve, identical for every backend."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, layout.image_vocab_size, size=(context_frames, layout.image_tokens), dtype=np.int64)
    actions = preset_actions("left", frames, 30.0)
    return context, actions


def _gpu_used_gb() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def run_hf(checkpoint_dir: Path, plan: BenchPlan, context, actions, log: Callable[[str], None]) -> RunResult:
    import torch

    from terra_cli.backends.hf import HfBackend

    generated = plan.frames - plan.context_frames
    frames = plan.context_frames + (min(plan.hf_frames, generated) if plan.hf_frames else generated)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    backend = HfBackend(checkpoint_dir, device=plan.device, dtype=plan.dtype)
    startup = time.perf_counter() - started
    sampling = Sampling(temperature=plan.temperature, seed=plan.seed)
    (_, times), busy = busy_while(plan.device, lambda: timed_generate(backend, context, actions, frames, sampling, log, "hf"))
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None
    backend.close()
    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    note = f"measured over the first {frames - plan.context_frames} of {generated} generated frames" if frames < plan.frames else ""
    return RunResult("hf", 1, len(times), times, startup, context.shape[-1], peak, None, note, gpu_busy=busy)


def timed_generate(backend, context, actions, frames, sampling, log=lambda msg: None, label="", rollouts=1):
    """`rollouts` copies of one context (K, T) and actions -> (tokens, seconds between finished frames)."""
    times: list[float] = []
    last = [time.perf_counter()]

    def on_frame(index, _tokens):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        log(f"{label}: frame {index + 1}/{frames}  {times[-1]:.3f} s")

    ctx = np.broadcast_to(context, (rollouts, *context.shape))
    acts = np.broadcast_to(actions, (rollouts, *actions.shape))
    last[0] = time.perf_counter()
    tokens = backend.generate(ctx, acts, frames, sampling, on_frame=on_frame)
    return tokens, times


def run_single_stream(checkpoint_dir: Path, plan: BenchPlan, context, actions, log: Callable[[str], None],
                      draft_tokens: int = 0) -> RunResult:
    """One rollout on the single-stream backend (CUDA graphs on a GPU). Its start-up includes
    capturing the graphs (and torch.compile of the layers) for the frames it will generate. With
    `--quantization fp8` (in `plan.vllm_options`) its decode steps read fp8 weights, as vLLM's rows do."""
    import torch

    from terra_cli.backends.single_stream import SingleStreamBackend

    quantization = plan.vllm_options.get("quantization")
    label = ("single-stream" + (f" {quantization}" if quantization else "")
             + (f" jacobi K={draft_tokens}" if draft_tokens else ""))
    sampling = Sampling(temperature=plan.temperature, seed=plan.seed)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    backend = SingleStreamBackend(checkpoint_dir, device=plan.device, dtype=plan.dtype, draft_tokens=draft_tokens,
                                  draft="jacobi", cuda_graphs=None, quantization=quantization)
    try:
        backend.decoder.prepare(range(plan.context_frames, plan.frames), sampling)
        startup = time.perf_counter() - started
        log(f"{label}: ready in {startup:.1f} s")
        (_, times), busy = busy_while(plan.device, lambda: timed_generate(backend, context, actions, plan.frames,
                                                                          sampling, log, label))
        stats = backend.stats[0]
        core = backend.decoder.core
    finally:
        backend.close()
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ms = round(1000 * sum(stats["frame_seconds"]) / stats["steps"], 4) if stats["steps"] else None
    note = (f"one rollout; attention {core.attention}, layers {'compiled' if core.compiled else 'eager'}, "
            f"CUDA graphs {'on' if stats['graphs_captured'] else 'off'}"
            + ("; exact in distribution, not plain sampling's stream" if draft_tokens else ""))
    return RunResult(label, 1, len(times), times, startup, context.shape[-1], peak, None, note,
                     round(stats["codes_per_step"], 3), ms, busy)


def tokens_per_step(before: dict | None, after: dict | None) -> float | None:
    """Codes kept per draft step between two `speculation_counts` readings (None without drafts)."""
    if not before or not after or after["drafts"] == before["drafts"]:
        return None
    return round(1 + (after["accepted"] - before["accepted"]) / (after["drafts"] - before["drafts"]), 3)


def run_vllm(checkpoint_dir: Path, plan: BenchPlan, context, actions, log: Callable[[str], None],
             on_run: Callable[[RunResult], None] = lambda run: None,
             on_startup: Callable[[dict], None] = lambda phases: None) -> list[RunResult]:
    from terra_cli.backends.vllm import VllmBackend

    started = time.perf_counter()
    backend = VllmBackend(checkpoint_dir, device=plan.device, dtype=plan.dtype,
                          max_rollouts=max(plan.batches), **plan.vllm_options)
    startup = time.perf_counter() - started
    log(f"vllm: engine ready in {startup:.1f} s")
    sampling = Sampling(temperature=plan.temperature, seed=plan.seed)
    # Warm-up: the first requests after start-up pay one-off costs (allocator, graph replays).
    warm_started = time.perf_counter()
    backend.generate(context, actions, plan.context_frames + 1, sampling)
    phases = dict(backend.startup, ready_s=round(startup, 3), first_frame_s=round(time.perf_counter() - warm_started, 3))
    log("vllm start-up: " + ", ".join(f"{k} {v}" for k, v in phases.items() if k != "timeline" and v is not None))
    on_startup(phases)
    results = []
    for rollouts in plan.batches:
        before = backend.speculation_counts()
        (_, times), busy = busy_while(plan.device, lambda: timed_generate(backend, context, actions, plan.frames, sampling,
                                                                          log, f"vllm x{rollouts}", rollouts))
        prompts = np.array(backend.last_prompt_tokens[1:], dtype=float)
        cached = np.array(backend.last_cached_tokens[1:], dtype=float)
        hit = round(float(cached.sum() / prompts.sum()), 4) if prompts.size else None
        results.append(RunResult("vllm", rollouts, len(times), times, startup, context.shape[-1],
                                 _gpu_used_gb(), hit, "peak memory: whole GPU in use (weights + KV cache reservation)",
                                 tokens_per_step(before, backend.speculation_counts()), gpu_busy=busy))
        on_run(results[-1])
    backend.close()
    return results


def run_bench(model: str | None, plan: BenchPlan, log: Callable[[str], None] = print,
              on_update: Callable[[dict], None] | None = None) -> dict:
    """Run the plan; `on_update(partial results)` after every finished run, so a long bench that
    is interrupted still leaves what it measured (marked `"partial": true`)."""
    from terra_cli.bench.cache import random_terra_checkpoint
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.resolve import resolve_world_model_dir
    from terra_cli.runtime import resolve_device

    plan.device = resolve_device(plan.device)
    if model is None:
        checkpoint_dir = random_terra_checkpoint(plan.device, plan.seed, log)
        model_label = "random weights, Terra world_model config (2,043,973,632 parameters, bf16)"
    else:
        checkpoint_dir = resolve_world_model_dir(model)
        model_label = str(checkpoint_dir)
    layout = load_config(checkpoint_dir).layout
    context, actions = bench_inputs(layout, plan.context_frames, plan.frames, plan.seed)
    runs: list[RunResult] = []
    startup: dict = {}
    environment_info = environment()

    def add(run: RunResult) -> None:
        runs.append(run)
        if on_update is not None:
            on_update(_results(model_label, plan, environment_info, runs, partial=True, startup=startup))

    if plan.run_hf:
        add(run_hf(checkpoint_dir, plan, context, actions, log))
    if plan.run_single_stream:
        for draft_tokens in (0, plan.jacobi_draft_tokens) if plan.jacobi_draft_tokens else (0,):
            add(run_single_stream(checkpoint_dir, plan, context, actions, log, draft_tokens))
    if plan.run_vllm:
        run_vllm(checkpoint_dir, plan, context, actions, log, on_run=add, on_startup=startup.update)
    return _results(model_label, plan, environment_info, runs, partial=False, startup=startup)


def _results(model_label: str, plan: BenchPlan, environment_info: dict, runs: list[RunResult], partial: bool,
             startup: dict | None = None) -> dict:
    summaries = [r.summary() for r in runs]
    hf = next((s for s in summaries if s["backend"] == "hf"), None)
    one = next((s for s in summaries if s["backend"] == "vllm" and s["rollouts"] == 1), None)
    speedup = None
    if hf and one and one["s_per_frame_mean"]:
        speedup = round(hf["s_per_frame_mean"] / one["s_per_frame_mean"], 2)
    return {
        "command": None,
        "model": model_label,
        "partial": partial,
        "plan": {k: v for k, v in asdict(plan).items()},
        "environment": environment_info,
        "runs": summaries,
        "speedup_vllm_over_hf": speedup,
        "vllm_startup": startup or None,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def plot_results(results: dict, path: Path, overwrite: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from terra_cli.media.atomic import save_figure

    runs = results["runs"]
    singles = [r for r in runs if r["rollouts"] == 1]
    batched = sorted((r for r in runs if r["backend"] == "vllm"), key=lambda r: r["rollouts"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [r["backend"] for r in singles]
    means = [r["s_per_frame_mean"] for r in singles]
    errs = [r["s_per_frame_stdev"] for r in singles]
    bars = ax1.bar(labels, means, yerr=errs, color=["#888888" if l == "hf" else "#2a7ab9" for l in labels], capsize=4)
    ax1.bar_label(bars, labels=[f"{m:.2f} s" for m in means])
    ax1.set_ylabel("seconds per generated frame (1 rollout)")
    title = "s/frame"
    if results.get("speedup_vllm_over_hf"):
        title += f"  (vLLM {results['speedup_vllm_over_hf']}x faster)"
    ax1.set_title(title)
    if batched:
        xs = [r["rollouts"] for r in batched]
        ax2.plot(xs, [r["frames_per_s"] for r in batched], "o-", color="#2a7ab9")
        for x, r in zip(xs, batched):
            ax2.annotate(f"{r['frames_per_s']:.1f}", (x, r["frames_per_s"]), textcoords="offset points", xytext=(0, 6), ha="center")
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(xs, [str(x) for x in xs])
    ax2.set_xlabel("parallel rollouts")
    ax2.set_ylabel("generated frames / s (aggregate)")
    ax2.set_title("vLLM throughput")
    env = results["environment"]
    fig.suptitle(f"{results['model']}\n{env.get('gpu') or env.get('cpu')}, vLLM {env.get('vllm')}, torch {env.get('torch')}", fontsize=9,
                 parse_math=False)  # a model path with $ is not mathtext
    fig.tight_layout()
    save_figure(fig, Path(path), overwrite, dpi=120)
    plt.close(fig)


def save_results(results: dict, path: Path, overwrite: bool = False) -> None:
    from terra_cli.media.atomic import atomic_path

    with atomic_path(Path(path), overwrite) as tmp:
        tmp.write_text(json.dumps(results, indent=2))
