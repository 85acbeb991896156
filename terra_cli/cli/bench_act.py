"""`terra bench --act-bench N`: checks, the run (terra_cli/bench/act_bench.py), its table and JSON, and its `--decoder refiner` options."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.table import Table

from terra_cli.cli.app import console, out


def act_bench(model: str | None, plan, keep_outputs: Path | None, out_json: Path | None, overwrite: bool,
              random_refiner=None) -> None:
    """`random_refiner`: with --decoder refiner, the refiner config (refiner.config.RefinerConfig) whose
    random weights go into the folder `plan.refiner` names (bench.refiner.random_refiner_folder)."""
    from terra_cli.bench.act_bench import bench_tokenizer, run_act_bench
    from terra_cli.bench.cache import check_engine_run, random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.cli.bench_scenarios import engine_shares
    from terra_cli.cli.progress import LazyFrameBar
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.models.resolve import resolve_world_model_dir
    from terra_cli.runtime import resolve_device

    # --out and --keep-outputs were checked with the bench's other outputs (cli/bench.py).
    check_engine_run(model, plan.backend, plan.vllm_options, plan.device, plan.frames, plan.context_frames)
    device = resolve_device(plan.device)
    if random_refiner is not None:
        from terra_cli.refiner.cost import check_cpu_time
        from terra_cli.refiner.windows import check_frames

        # the product's own checks (refiner.decoder.load_refiner), before any random weights are built
        check_frames(plan.frames, random_refiner.window)
        check_cpu_time(random_refiner, [plan.frames] * plan.samples, device, plan.refiner.allow_slow)
    log = lambda msg: console.print(f"[dim]{msg}[/]", highlight=False)  # noqa: E731
    checkpoint = resolve_world_model_dir(model) if model else random_terra_checkpoint(device, plan.seed, log)
    tokenizer = bench_tokenizer(checkpoint, model, plan.seed, log)
    if random_refiner is not None:
        from terra_cli.bench.refiner import random_refiner_checkpoint

        random_refiner_checkpoint(random_refiner, plan.seed, device, log)
    bar = LazyFrameBar(console, "ACT-Bench")
    try:
        results = run_act_bench(checkpoint, tokenizer, plan, keep_outputs, log, bar)
    finally:
        bar.close()
    results["model"] = str(model or checkpoint)
    if results["plan"]["refiner"] is not None:
        results["plan"]["refiner"]["random_weights"] = random_refiner is not None
    results["command"] = "terra " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results["environment"] = environment()
    run, phases = results["run"], results["run"]["phases_s"]
    busy = ", ".join("-" if b is None else f"{b:.0%}" for b in run["gpu_busy"].values()) or "-"
    table = Table(title=f"terra bench --act-bench: {results['model']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    refiner = results["plan"]["refiner"]
    if refiner is None:
        videos = (("decoder", "frames"), ("video writer processes", str(run["writers"])),
                  ("s/video in a writer", "-" if run["writer_s_per_video"] is None else f"{run['writer_s_per_video']:.2f}"))
    else:
        compiled = ", ".join(f"{u:.0f}+{v:.0f}" for u, v in zip(refiner["compile_s"], refiner["vae_decoder_compile_s"]))
        videos = (("decoder", f"refiner, {refiner['windows_per_call']} window(s) per UNet call"),
                  ("refiner compile (per engine: UNet+VAE decoder s)",
                   f"{'/'.join(refiner['compile_mode']) or refiner['compile']}" + (f" ({compiled})" if compiled else "")),
                  ("refined videos/s after start-up", f"{run['refined_videos_per_s']:.3f}"),
                  ("refiner s/sample (its thread's work)",
                   "-" if run["refiner_s_per_sample"] is None else f"{run['refiner_s_per_sample']:.2f}"),
                  ("refiner s/sample, wall (first UNet batch to last video, all engines)",
                   "-" if run.get("refiner_pace_s_per_sample") is None else f"{run['refiner_pace_s_per_sample']:.2f}"))
    for name, value in (
        ("samples x frames (rounds)", f"{plan.samples} x {plan.frames} ({run['rounds_per_sample']})"),
        ("engines (share of samples)", engine_shares(results["engines"])),
        ("rollouts in flight per engine", ", ".join(str(e.get("in_flight") or "-") for e in results["engines"])),
        *videos,
        ("s/sample, wall", f"{run['seconds_per_sample_wall']:.3f}"),
        ("s/sample after start-up", f"{run['seconds_per_sample_steady']:.3f}"),
        ("generated frames/s after start-up", f"{run['generated_frames_per_s']:.2f}"),
        ("  from the first frame (bench --scenarios' clock)", f"{run['generated_frames_per_s_from_first_frame']:.2f}"),
        ("GPU busy while generating", busy),
        *((f"phase: {k.replace('_', ' ')} s", f"{v:.1f}") for k, v in phases.items()),
        (f"ACT-Bench ({run['projected_samples']:,} samples), projected h", f"{run['projected_act_bench_hours']:.2f}"),
        ("  with encoding and writing beside generation, h", f"{run['projected_act_bench_hours_pipelined']:.2f}"),
    ):
        table.add_row(name, value)
    out.print(table)
    if out_json:
        atomic_write_json(out_json, results, overwrite=overwrite)
        console.print(f"results -> {out_json}")


def act_bench_refiner(decoder: str, weights: str | None, model: str | None, tiny: bool, seed: int, device: str,
                       dtype: str, allow_slow: bool, windows: int | None, compile_mode: str | None, refiner_dtype: str):
    """--decoder and the refiner's options of --act-bench, checked as `generate --scenarios` checks
    them -> (RefinerChoice or None, the config of random weights to write or None). Without
    --refiner-weights the refiner is --model's own; with no --model (the bench's random Terra-size
    world model), or with --tiny, random weights (bench.refiner.random_refiner_checkpoint)."""
    from terra_cli.bench.refiner import random_refiner_folder
    from terra_cli.errors import InputError
    from terra_cli.refiner.config import TERRA_REFINER, tiny_refiner_config
    from terra_cli.refiner.decoder import refiner_choice, refiner_options

    random_config = None
    if decoder.strip().lower() == "refiner" and weights is None and (model is None or tiny):
        random_config = tiny_refiner_config() if tiny else TERRA_REFINER
    spec = str(random_refiner_folder(random_config, seed)) if random_config is not None else weights
    choice = refiner_choice(decoder, spec, model, device, dtype, allow_slow,
                            refiner_options(decoder, windows, compile_mode or "auto", refiner_dtype),
                            flag="--refiner-weights")
    if choice is None and (tiny or allow_slow):
        raise InputError("--tiny and --allow-slow go with --decoder refiner")
    if tiny and weights is not None:
        raise InputError("--tiny is a refiner of random weights: drop it or --refiner-weights")
    return choice, random_config
