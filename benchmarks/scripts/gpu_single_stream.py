"""Issue 41 lab probe: one rollout on terra's single-stream decoder (backends/single_stream.py), plain
and speculative Jacobi (K = 4, 8), CUDA graphs, on Terra's config with random bf16 weights (the cost
of a step; built once into $TERRA_CACHE as `terra bench` builds it) and on terra-mini (trained: its
draft acceptance is real). Per variant: s/frame, codes per step, ms per step, and over one profiled
frame the GPU's busy share (union of kernel intervals / wall) and kernels per step.

On the GPU host (the vLLM bundle unpacked into /tmp/site, as ../shared/notes/gpu-host.md says, so
FlashAttention's varlen kernel is importable; without it the probe runs torch's attention and says so):

    export PYTHONPATH=/tmp/site TERRA_CACHE=/tmp/terra-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/terra-cache/inductor; timeout 540 python3 benchmarks/scripts/gpu_single_stream.py --budget-s 420 --out $OUT/single_stream.json 2>&1 | tee $OUT/single_stream.log

Variants (the most telling first, in case the time runs out): the new path (FlashAttention varlen
kernel + torch.compile'd layer functions, `attention`/`compiled_layers` say what actually ran),
Jacobi K=8 and K=4 on it, then the path measured on 2026-11-26 (torch attention, eager layers) and
the two halves of the change apart, so each fix's share is measured. Each variant stops after
--variant-s seconds of generation (the frames done so far are what it reports); variants not
started within --budget-s are recorded as skipped. JSON is rewritten after every variant (a cut-off
run keeps what finished). `codes_equal_to_first` compares a variant's codes with the model's first
variant (same seed): plain variants draw the same stream (bf16 kernels may differ at near-ties),
Jacobi is exact in distribution only. On a CPU (`--device cpu --models tiny`) it is a dry run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from terra_cli.actions import preset_actions  # noqa: E402
from terra_cli.backends.base import Sampling  # noqa: E402
from terra_cli.backends.single_stream import SingleStreamBackend  # noqa: E402
from gpu_batched_step import busy_share  # noqa: E402

CONTEXT_FRAMES = 3
# name, draft_tokens, draft, environment (attention / layer compile switches read at decoder start).
NEW = {"TERRA_SINGLE_STREAM_ATTENTION": "", "TERRA_SINGLE_STREAM_COMPILE": "", "TERRA_SINGLE_STREAM_LOGITS": "",
       "TERRA_SINGLE_STREAM_COMPILE_MODE": "", "TERRA_SINGLE_STREAM_LAYERS": "", "TERRA_SINGLE_STREAM_FLASH_PLAN": "",
       "TERRA_SINGLE_STREAM_CACHE_WRITE": ""}
FEW_ROWS = {**NEW, "TERRA_SINGLE_STREAM_LOGITS": "few-rows", "TERRA_SINGLE_STREAM_LAYERS": "few-rows"}
VARIANTS = [
    ("plain", 0, "jacobi", NEW),
    ("jacobi K=8", 8, "jacobi", NEW),
    ("jacobi K=4", 4, "jacobi", NEW),
    ("plain, 2026-11-26 path (torch attention, eager layers)", 0, "jacobi",
     {"TERRA_SINGLE_STREAM_ATTENTION": "torch", "TERRA_SINGLE_STREAM_COMPILE": "0"}),
    ("plain, flash attention, eager layers", 0, "jacobi", {"TERRA_SINGLE_STREAM_ATTENTION": "", "TERRA_SINGLE_STREAM_COMPILE": "0"}),
    ("plain, torch attention, compiled layers", 0, "jacobi", {"TERRA_SINGLE_STREAM_ATTENTION": "torch", "TERRA_SINGLE_STREAM_COMPILE": ""}),
    ("previous-frame K=4", 4, "previous-frame", NEW),
    ("jacobi K=8, logits weight-major (W @ h.T)", 8, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_LOGITS": "weight-major"}),
    ("jacobi K=8, logits by terra's few-rows kernel", 8, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_LOGITS": "few-rows"}),
    ("plain, logits by terra's few-rows kernel", 0, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_LOGITS": "few-rows"}),
    ("plain, layers compiled max-autotune (Inductor times its GEMMs)", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_COMPILE_MODE": "max-autotune-no-cudagraphs"}),
    # 11, 12: the layers' projections by terra's split-K kernel too (kernels/few_rows_matmul.py)
    ("plain, layers and logits by terra's few-rows kernel (split-K)", 0, "jacobi", FEW_ROWS),
    ("jacobi K=8, layers and logits by terra's few-rows kernel (split-K)", 8, "jacobi", FEW_ROWS),
    # 13-15: the same kernel over fp8 copies of the weights (one scale a row): half the bytes a step reads,
    # an approximation (codes_equal_to_first: agreement with plain bf16 at the same seed)
    ("plain, layers' projections in fp8 (few-rows kernel), logits bf16 (few-rows)", 0, "jacobi",
     {**FEW_ROWS, "TERRA_SINGLE_STREAM_LAYERS": "few-rows-fp8"}),
    ("plain, layers and logits in fp8 (few-rows kernel)", 0, "jacobi",
     {**FEW_ROWS, "TERRA_SINGLE_STREAM_LAYERS": "few-rows-fp8", "TERRA_SINGLE_STREAM_LOGITS": "few-rows-fp8"}),
    ("jacobi K=8, layers and logits in fp8 (few-rows kernel)", 8, "jacobi",
     {**FEW_ROWS, "TERRA_SINGLE_STREAM_LAYERS": "few-rows-fp8", "TERRA_SINGLE_STREAM_LOGITS": "few-rows-fp8"}),
    # 16-18 (2026-11-29): "plain" now runs few-rows logits, the CUDA default; 16 is the default before it.
    # 17, 18: the product's `--quantization fp8` (a fifth element: the backend's options), whose one-row
    # steps read fp8 weights as a GEMV (kernels/few_rows_matmul.py's tile_for), not 13-15's one tile
    ("plain, logits by cuBLAS (the default before 2026-11-29)", 0, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_LOGITS": "linear"}),
    ("plain, --quantization fp8", 0, "jacobi", NEW, {"quantization": "fp8"}),
    ("jacobi K=8, --quantization fp8", 8, "jacobi", NEW, {"quantization": "fp8"}),
    # 19, 20: FlashAttention-3's scheduler plan once a step, not once a layer (static_kv.FLASH_PLAN_ENV)
    ("plain, one FlashAttention plan a step", 0, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "step"}),
    ("plain, --quantization fp8, one FlashAttention plan a step", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "step"}, {"quantization": "fp8"}),
    # 21-23: k and v written into the cache inside the compiled layer function (layer_ops.CACHE_WRITE_ENV)
    ("plain, k and v written in the layer function", 0, "jacobi", {**NEW, "TERRA_SINGLE_STREAM_CACHE_WRITE": "fused"}),
    ("plain, one plan a step and k and v written in the layer function", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "step", "TERRA_SINGLE_STREAM_CACHE_WRITE": "fused"}),
    ("plain, --quantization fp8, one plan a step and k and v written in the layer function", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "step", "TERRA_SINGLE_STREAM_CACHE_WRITE": "fused"},
     {"quantization": "fp8"}),
    # 24, 25 (since 2026-11-29's lease 6, 22 and 23 are the defaults, so "plain" is 22): the steps as before it
    ("plain, each call plans and k and v copied apart (the default before lease 6)", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "call", "TERRA_SINGLE_STREAM_CACHE_WRITE": "separate"}),
    ("plain, --quantization fp8, each call plans and k and v copied apart", 0, "jacobi",
     {**NEW, "TERRA_SINGLE_STREAM_FLASH_PLAN": "call", "TERRA_SINGLE_STREAM_CACHE_WRITE": "separate"},
     {"quantization": "fp8"}),
]
TARGET_S_PER_FRAME = 0.5


class OutOfTime(Exception):
    pass


def load_terra_mini(device, dtype):
    from terra_cli.models.default import default_tokenizer_dir, default_world_model_dir, sample_context_frames
    from terra_cli.models.modeling_hf import load_model

    model = load_model(default_world_model_dir(), device, dtype)
    try:  # the embedded sample road, tokenized: real context makes real acceptance
        from tokenizer_decoder import ImageTokenizer

        tokenizer = ImageTokenizer.from_pretrained(default_tokenizer_dir(), device=device)
        context, source = np.asarray(tokenizer.tokenize(list(sample_context_frames(CONTEXT_FRAMES)))), "sample road"
        del tokenizer
    except Exception as error:  # noqa: BLE001 - a probe: fall back, say so
        context, source = random_context(model.layout), f"random codes ({type(error).__name__}: {error})"
    return model, context, source


def load_terra_size(device, dtype, checkpoint: str | None):
    """Terra's released config: --terra-checkpoint, else `terra bench`'s random bf16 checkpoint
    (seed 0), written once into $TERRA_CACHE and loaded strictly like any checkpoint."""
    from terra_cli.bench.cache import random_terra_checkpoint
    from terra_cli.models.modeling_hf import load_model

    folder = checkpoint or random_terra_checkpoint(device, 0, lambda message: print(message, flush=True))
    return load_model(folder, device, dtype), random_context(load_model_layout(folder)), str(folder)


def load_model_layout(folder):
    from terra_cli.models.checkpoint import load_config

    return load_config(folder).layout


def load_tiny(device, dtype):
    from terra_cli.models.modeling_hf import build_model
    from terra_cli.models.testing import tiny_config

    torch.manual_seed(0)
    model = build_model(tiny_config(), device=device, dtype=dtype)
    return model, random_context(model.layout), "tiny random (dry run)"


def random_context(layout):
    rng = np.random.default_rng(0)
    return rng.integers(0, layout.image_vocab_size, size=(CONTEXT_FRAMES, layout.image_tokens), dtype=np.int64)


def gpu_busy(decoder, frame: int, device: str) -> dict:
    """Re-decide frame `frame`'s codes 1.. under torch.profiler: the union of the GPU's kernel
    intervals over the frame's wall time, and kernels per step (kernels inside graph replays are
    reported by CUPTI; `kernels_seen` 0 means they were not, and the share is unknown)."""
    from torch.profiler import ProfilerActivity, profile

    decoder.next_index.fill_(1)
    decoder.frame_base.fill_(frame * decoder.layout.frame_stride)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        steps = decoder.decide_frame(frame)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    # Where a step's kernel time goes: the kernels by total time, per step (names cut to 90 chars).
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:15]
    top_kernels = [{"kernel": name, "per_step": round(len(times) / steps, 2) if steps else None,
                    "us_per_step": round(sum(times) / steps, 1) if steps else None,
                    "us_each": round(sum(times) / len(times), 2)} for name, times in top]
    covered = busy_share(intervals)  # microseconds
    span, busy = covered["span_us"], covered["covered_us"]
    return {"profiled_frame_s": round(wall, 4), "profiled_steps": steps, "kernels_seen": len(intervals),
            "kernels_per_step": round(len(intervals) / steps, 1) if steps else None,
            "gpu_busy_share_of_kernel_span": round(busy / span, 4) if span else None,
            "gpu_busy_share_of_wall": round(busy / 1e6 / wall, 4) if intervals else None,
            "kernel_ms_per_step": round(busy / 1e3 / steps, 4) if steps and intervals else None,
            "top_kernels": top_kernels}


def run_variant(model, context, frames, sampling, draft_tokens, draft, device, variant_s,
                options=None) -> tuple[dict, np.ndarray]:
    graphs = device.startswith("cuda")
    backend = SingleStreamBackend(device=device, model=model, draft_tokens=draft_tokens, draft=draft, cuda_graphs=graphs,
                                  **(options or {}))
    decoder = backend.decoder
    try:
        actions = preset_actions("left", frames, 30.0)
        capture_s = decoder.prepare(range(CONTEXT_FRAMES, frames), sampling)
        if graphs:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        codes = np.zeros((frames, model.layout.image_tokens), dtype=np.int64)

        def on_frame(index, tokens):
            codes[index] = tokens[0]
            if time.perf_counter() - started > variant_s and index < frames - 1:
                raise OutOfTime

        try:
            backend.generate(context, actions, frames, sampling, on_frame)
        except OutOfTime:
            pass
        total = time.perf_counter() - started
        stats = decoder.stats
        seconds = stats["frame_seconds"]
        row = {
            "attention": stats["attention"], "compiled_layers": stats["compiled_layers"],
            "compile_error": decoder.core.ops.compile_error, "layer_projections": decoder.core.ops.projections,
            "logits_layout": decoder.core.logits_layout,
            "frames_generated": len(seconds),
            "s_per_frame_mean": round(statistics.fmean(seconds), 4),
            "s_per_frame_after_first": round(statistics.fmean(seconds[1:]), 4) if len(seconds) > 1 else None,
            "ms_per_step": round(1000 * sum(seconds) / stats["steps"], 4),
            "codes_per_step": round(stats["codes_per_step"], 4),
            "steps": stats["steps"], "accepted_drafts": stats["accepted_drafts"],
            "graph_capture_and_compile_s": round(capture_s, 2), "graphs_captured": stats["graphs_captured"],
            "generate_s_with_prefill": round(total, 3), "frame_seconds": [round(s, 4) for s in seconds],
        }
        if graphs:
            row["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            try:
                row.update(gpu_busy(decoder, CONTEXT_FRAMES + len(seconds) - 1, device))
            except Exception as error:  # noqa: BLE001 - the timing stands without the profile
                row["profile_error"] = f"{type(error).__name__}: {error}"
        return row, codes[CONTEXT_FRAMES: CONTEXT_FRAMES + len(seconds)]
    finally:
        backend.close()


@torch.inference_mode()
def parity(model, context, device) -> dict:
    """A greedy frame of the decoder (its default path on this device) against the reference read
    teacher-forced, as tests/test_gpu_parity.py measures vLLM."""
    from terra_cli.backends.hf import HfBackend

    layout, k = model.layout, CONTEXT_FRAMES
    actions = preset_actions("left", k + 1, 30.0)
    greedy = Sampling(temperature=0)
    backend = SingleStreamBackend(device=device, model=model, cuda_graphs=device.startswith("cuda"))
    try:
        frame = backend.generate(context, actions, k + 1, greedy)[0, k]
        path = {"attention": backend.decoder.core.attention, "compiled_layers": backend.decoder.core.compiled}
    finally:
        backend.close()
    slots = [layout.action_placeholder_id] * layout.action_tokens
    ids = torch.tensor([[t for j in range(k) for t in (*context[j].tolist(), *slots)] + frame.tolist()], device=device)
    waypoints = torch.tensor(actions[:k], device=device).reshape(1, -1, 3)
    logits, _ = model(ids, torch.arange(ids.shape[1], device=device)[None], waypoints, logits_to_keep=layout.image_tokens + 1)
    teacher_forced = logits[0, :-1, : layout.image_vocab_size].float().argmax(-1).cpu().numpy()
    reference_frame = HfBackend(device=device, model=model).generate(context, actions, k + 1, greedy)[0, k]
    return {"variant": "parity (greedy)", **path,
            "teacher_forced_reference_argmax_equals_code": round(float((teacher_forced == frame).mean()), 4),
            "free_running_identical_to_reference_fraction": round(float((frame == reference_frame).mean()), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("single_stream.json"))
    parser.add_argument("--models", default="terra,mini", help="comma-separated: terra, mini, tiny")
    parser.add_argument("--frames", type=int, default=6, help="generated frames per variant (after 3 context frames)")
    parser.add_argument("--variant-s", type=float, default=20.0, help="stop a variant's generation after this many seconds")
    parser.add_argument("--variants", default="", help="comma-separated indexes into VARIANTS (default: all)")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--terra-checkpoint", default=None, help="a Terra-size checkpoint dir (default: random weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip variants not started within this many seconds")
    args = parser.parse_args()
    if args.out.exists():  # it is rewritten after every variant: only ever this run's own file
        parser.error(f"{args.out} exists: name another --out")

    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.runtime import resolve_dtype

    started = time.perf_counter()
    dtype = resolve_dtype(None, args.device)
    report = {"environment": environment(), "command": " ".join(sys.argv), "dtype": str(dtype),
              "temperature": args.temperature, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(row):
        print(json.dumps({k: v for k, v in row.items() if k != "frame_seconds"}), flush=True)
        report["rows"].append(row)
        atomic_write_json(args.out, report, overwrite=True)  # (refused above if it was there before the run)

    loaders = {"mini": lambda: load_terra_mini(args.device, dtype),
               "terra": lambda: load_terra_size(args.device, dtype, args.terra_checkpoint),
               "tiny": lambda: load_tiny(args.device, dtype)}
    chosen = [VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else VARIANTS
    sampling = Sampling(temperature=args.temperature, seed=0)
    for name in args.models.split(","):
        base = {"model": name}
        if time.perf_counter() - started > args.budget_s:
            record({**base, "skipped": f"over the {args.budget_s:.0f} s budget"})
            continue
        try:
            t0 = time.perf_counter()
            model, context, source = loaders[name]()
            base.update(source=source, load_s=round(time.perf_counter() - t0, 1))
        except Exception:  # noqa: BLE001 - one model failing must not stop the other
            record({**base, "error": traceback.format_exc(limit=4)})
            continue
        first = None
        for label, draft_tokens, draft, env, *options in chosen:
            row = {**base, "variant": label, "draft_tokens": draft_tokens, "draft": draft if draft_tokens else None,
                   "frames": CONTEXT_FRAMES + args.frames}
            if time.perf_counter() - started > args.budget_s:
                record({**row, "skipped": f"over the {args.budget_s:.0f} s budget"})
                continue
            os.environ.update(env)
            try:
                result, codes = run_variant(model, context, CONTEXT_FRAMES + args.frames, sampling, draft_tokens, draft,
                                            args.device, args.variant_s, *options)
                row.update(result)
                if first is None:
                    first = codes
                else:
                    common = min(len(first), len(codes))
                    row["codes_equal_to_first"] = round(float((codes[:common] == first[:common]).mean()), 4)
                if draft_tokens and name == "terra":
                    # Codes per step this model would need for TARGET_S_PER_FRAME at this step cost.
                    per_frame = model.layout.image_tokens - 1
                    row["codes_per_step_for_0.5_s"] = round(per_frame * row["ms_per_step"] / 1000 / TARGET_S_PER_FRAME, 2)
            except Exception:  # noqa: BLE001 - record and go on
                row["error"] = traceback.format_exc(limit=6)
            record(row)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        os.environ.update(NEW)
        if time.perf_counter() - started < args.budget_s:
            try:
                record({**base, **parity(model, context, args.device)})
            except Exception:  # noqa: BLE001 - record and go on
                record({**base, "variant": "parity", "error": traceback.format_exc(limit=6)})
        del model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - started, 1)
    atomic_write_json(args.out, report, overwrite=True)
    print(json.dumps({"total_s": report["total_s"], "out": str(args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
