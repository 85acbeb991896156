"""Issue 41 lab probe: one rollout on terra's single-stream decoder (backends/single_stream.py), plain
and speculative Jacobi (K = 4, 8), with and without CUDA graphs, on terra-mini (trained: its draft
acceptance is real) and on Terra's config with random bf16 weights (the cost of a step).

    python3 benchmarks/scripts/gpu_single_stream.py --out $OUT/single_stream.json

Prints one JSON line per variant and writes them all to --out after each one (a cut-off run keeps
what finished). Each variant runs in its own try: one that fails records its error and the rest
go on. Times are wall-clock per frame with torch.cuda.synchronize() at each frame's end; CUDA
graphs are captured before the timed run (`graph_capture_s`). Every variant of a model draws with
the same seed; `codes_equal_to_plain_eager` says whether a variant reproduced the eager plain
decoder's codes (plain with graphs must: same seeded stream; Jacobi need not: exact in
distribution only). On a CPU (`--device cpu --models tiny --frames 1`) it is a dry run.
"""

from __future__ import annotations

import argparse
import gc
import json
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

CONTEXT_FRAMES = 3
# (draft_tokens, draft, cuda_graphs): the most telling first, in case the time runs out; plain
# eager first of all, the codes every other variant is compared with.
VARIANTS = [(0, "jacobi", False), (0, "jacobi", True), (4, "jacobi", True), (8, "jacobi", True),
            (4, "previous-frame", True), (8, "previous-frame", True), (4, "jacobi", False), (8, "jacobi", False)]
TARGET_S_PER_FRAME = 0.5


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
    """Terra's released config: from --terra-checkpoint (strict load), else random weights built
    in memory as `terra bench` builds them (transformers' init, seed 0), RoPE kept in float32."""
    from terra_cli.models.config import LlamaActionConfig
    from terra_cli.models.modeling_hf import build_model, load_model
    from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG

    if checkpoint:
        model, source = load_model(checkpoint, device, dtype), checkpoint
    else:
        config = LlamaActionConfig.from_dict(dict(TERRA_WORLD_MODEL_CONFIG))
        torch.manual_seed(0)
        model = build_model(config, device=device, dtype=dtype)
        with torch.device(device):
            model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
        source = "random weights (seed 0), built in memory"
    return model, random_context(model.layout), source


def load_tiny(device, dtype):
    from terra_cli.models.modeling_hf import build_model
    from terra_cli.models.testing import tiny_config

    torch.manual_seed(0)
    model = build_model(tiny_config(), device=device, dtype=dtype)
    return model, random_context(model.layout), "tiny random (dry run)"


def random_context(layout):
    rng = np.random.default_rng(0)
    return rng.integers(0, layout.image_vocab_size, size=(CONTEXT_FRAMES, layout.image_tokens), dtype=np.int64)


def run_variant(model, context, frames, sampling, draft_tokens, draft, cuda_graphs, device) -> tuple[dict, np.ndarray]:
    backend = SingleStreamBackend(device=device, model=model, draft_tokens=draft_tokens, draft=draft, cuda_graphs=cuda_graphs)
    try:
        actions = preset_actions("left", frames, 30.0)
        capture_s = backend.decoder.prepare(range(CONTEXT_FRAMES, frames), sampling)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        codes = backend.generate(context, actions, frames, sampling)
        total = time.perf_counter() - started
        stats = backend.stats[0]
        seconds = stats["frame_seconds"]
        row = {
            "frames_generated": len(seconds),
            "s_per_frame_mean": round(statistics.fmean(seconds), 4),
            "s_per_frame_after_first": round(statistics.fmean(seconds[1:]), 4) if len(seconds) > 1 else None,
            "ms_per_step": round(1000 * sum(seconds) / stats["steps"], 4),
            "codes_per_step": round(stats["codes_per_step"], 4),
            "steps": stats["steps"],
            "accepted_drafts": stats["accepted_drafts"],
            "graph_capture_s": round(capture_s, 2),
            "graphs_captured": stats["graphs_captured"],
            "generate_s_with_prefill": round(total, 3),
            "frame_seconds": [round(s, 4) for s in seconds],
        }
        if device.startswith("cuda"):
            row["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return row, codes
    finally:
        backend.close()


@torch.inference_mode()
def parity(model, context, device) -> dict:
    """A greedy frame of the single-stream decoder (CUDA graphs where the device has them) against
    the reference, as tests/test_gpu_parity.py measures vLLM: the reference reads the frame
    teacher-forced and its argmax is compared at every code; plus the reference's own free-running
    greedy frame (bf16 near-ties may flip one and the rest follows another prefix)."""
    from terra_cli.backends.hf import HfBackend
    from terra_cli.backends.static_kv import _FLOAT_SCORES

    layout, k = model.layout, CONTEXT_FRAMES
    actions = preset_actions("left", k + 1, 30.0)
    greedy = Sampling(temperature=0)
    backend = SingleStreamBackend(device=device, model=model, cuda_graphs=device.startswith("cuda"))
    try:
        frame = backend.generate(context, actions, k + 1, greedy)[0, k]
    finally:
        backend.close()
    slots = [layout.action_placeholder_id] * layout.action_tokens
    ids = torch.tensor([[t for j in range(k) for t in (*context[j].tolist(), *slots)] + frame.tolist()], device=device)
    waypoints = torch.tensor(actions[:k], device=device).reshape(1, -1, 3)
    logits, _ = model(ids, torch.arange(ids.shape[1], device=device)[None], waypoints, logits_to_keep=layout.image_tokens + 1)
    teacher_forced = logits[0, :-1, : layout.image_vocab_size].float().argmax(-1).cpu().numpy()
    reference_frame = HfBackend(device=device, model=model).generate(context, actions, k + 1, greedy)[0, k]
    return {"variant": "parity (greedy, bf16 on a GPU)",
            "teacher_forced_reference_argmax_equals_code": round(float((teacher_forced == frame).mean()), 4),
            "free_running_identical_to_reference_fraction": round(float((frame == reference_frame).mean()), 4),
            "float32_attention_scores": _FLOAT_SCORES["bmm_out_dtype"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("single_stream.json"))
    parser.add_argument("--models", default="mini,terra", help="comma-separated: mini, terra, tiny")
    parser.add_argument("--frames", type=int, default=6, help="generated frames per variant (after 3 context frames)")
    parser.add_argument("--full-round", action=argparse.BooleanOptionalAction, default=True,
                        help="also plain + graphs over a whole 25-frame round (22 generated) on each model")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--terra-checkpoint", default=None, help="a Terra-size checkpoint dir (default: random weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=390.0, help="skip variants not started within this many seconds")
    args = parser.parse_args()

    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.runtime import resolve_dtype

    started = time.perf_counter()
    dtype = resolve_dtype(None, args.device)
    report = {"environment": environment(), "command": " ".join(sys.argv), "dtype": str(dtype),
              "temperature": args.temperature, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(row):
        print(json.dumps({k: v for k, v in row.items() if k != "frame_seconds"}), flush=True)
        report["rows"].append(row)
        args.out.write_text(json.dumps(report, indent=1))

    loaders = {"mini": lambda: load_terra_mini(args.device, dtype),
               "terra": lambda: load_terra_size(args.device, dtype, args.terra_checkpoint),
               "tiny": lambda: load_tiny(args.device, dtype)}
    sampling = Sampling(temperature=args.temperature, seed=0)
    for name in args.models.split(","):
        base = {"model": name}
        try:
            t0 = time.perf_counter()
            model, context, source = loaders[name]()
            base.update(source=source, load_s=round(time.perf_counter() - t0, 1))
        except Exception:  # noqa: BLE001 - one model failing must not stop the other
            record({**base, "error": traceback.format_exc(limit=4)})
            continue
        try:
            record({**base, **parity(model, context, args.device)})
        except Exception:  # noqa: BLE001 - record and go on
            record({**base, "variant": "parity", "error": traceback.format_exc(limit=6)})
        frames = CONTEXT_FRAMES + args.frames
        runs = [(k, d, g, frames) for k, d, g in VARIANTS]
        if args.full_round:
            runs.insert(2, (0, "jacobi", True, model.layout.max_frames))
        plain_eager = None
        for draft_tokens, draft, graphs, n_frames in runs:
            row = {**base, "variant": "plain" if draft_tokens == 0 else f"jacobi K={draft_tokens} draft={draft}",
                   "draft_tokens": draft_tokens, "draft": draft if draft_tokens else None, "cuda_graphs": graphs,
                   "frames": n_frames}
            if time.perf_counter() - started > args.budget_s:
                record({**row, "skipped": f"over the {args.budget_s:.0f} s budget"})
                continue
            try:
                result, codes = run_variant(model, context, n_frames, sampling, draft_tokens, draft, graphs, args.device)
                row.update(result)
                if draft_tokens == 0 and not graphs:
                    plain_eager = codes
                if plain_eager is not None and n_frames == frames and (draft_tokens or graphs):
                    row["codes_equal_to_plain_eager"] = round(float((codes == plain_eager).mean()), 4)
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
        del model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"total_s": report["total_s"], "out": str(args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
