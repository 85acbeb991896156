"""`terra eval`: score a world model + tokenizer against the synthetic road world (see terra_cli/evaluate.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer

from terra_cli.cli import options as opts
from terra_cli.cli.app import app, console, friendly_errors, out

EPILOG = (
    "Examples:\n\n"
    "  terra eval --out eval.json --plot eval.png --strip strip.png          # embedded terra-mini, defaults\n\n"
    "  terra eval --seeds 20 --frames 8 --presets left,right,straight --backend hf --device cpu\n\n"
    "  terra eval --model ckpt/world_model --tokenizer ckpt/tokenizer --temperature 0.9\n\n"
    "Docs: docs/eval.md"
)


@app.command(name="eval", epilog=EPILOG)
@friendly_errors
def eval_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="World-model dir (default: the embedded terra-mini)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", "-t", help="Tokenizer dir (default: the embedded terra-mini tokenizer)."),
    seeds: int = typer.Option(10, help="Held-out synthetic worlds per preset (world seeds 1000, 1001, ...); 20 for the full eval (~2x the time)."),
    ceiling_seeds: int = typer.Option(4, help="Seeds on which the tokenizer ceiling (encode + decode of the true frames) is measured."),
    presets: str = typer.Option("left,right,straight", help="Action presets to drive, comma-separated."),
    context_frames: int = typer.Option(3, help="True frames given as context."),
    frames: int = typer.Option(8, help="Frames per rollout, context included (generated = frames - context)."),
    speed: float = opts.speed_option(),
    temperature: float = typer.Option(0.0, help="Sampling temperature; eval defaults to 0 = greedy (deterministic)."),
    top_k: int = opts.top_k_option(),
    top_p: float = opts.top_p_option(),
    seed: int = typer.Option(0, help="Sampling seed (rollout i uses seed + i) when --temperature > 0."),
    backend: str = opts.backend_option(),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option(),
    out_json: Optional[Path] = typer.Option(None, "--out", "-o", help="Write every number (config, per frame, per seed, summary, environment) as JSON."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG: PSNR per frame and lateral motion per seed."),
    strip: Optional[Path] = typer.Option(None, help="Write a PNG strip: true vs generated frames, first seed of each preset."),
    overwrite: bool = opts.overwrite_option(),
):
    # one paragraph on one line: rich help keeps a docstring's line breaks
    """Evaluate the world model on held-out synthetic worlds: PSNR/SSIM against the truth and a copy-last-frame baseline, the tokenizer's ceiling, and whether the generated motion follows left/right commands."""  # noqa: E501
    from terra_cli.cli.progress import TaskProgress
    from terra_cli.evaluation.report import plot_eval, save_json, save_strip
    from terra_cli.evaluation.run import (
        EvalPlan,
        build_results,
        evaluate_preset,
        parse_presets,
    )
    from terra_cli.pipeline.outputs import OutputPlan

    from terra_cli.backends import Sampling, load_backend
    from terra_cli.pipeline.engine_request import resolve_backend_name

    plan = EvalPlan(  # Sampling and validate() check the options before any loading
        presets=parse_presets(presets), seeds=seeds, context_frames=context_frames, frames=frames, speed_kmh=speed,
        ceiling_seeds=ceiling_seeds, sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
    )
    plan.validate()
    backend_name = resolve_backend_name(backend)
    outputs = OutputPlan(overwrite)
    for label, path in (("--model", model), ("--tokenizer", tokenizer)):
        outputs.input(label, Path(path) if path and os.path.lexists(path) else None)
    for label, path, suffixes in (("--out", out_json, (".json",)), ("--plot", plot, (".png",)), ("--strip", strip, (".png",))):
        if path is not None:
            outputs.file(label, path, suffixes)

    from terra_cli.errors import InputError
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.resolve import load_tokenizer, resolve_model
    from terra_cli.runtime import resolve_device, resolve_dtype_name

    dev = resolve_device(device)
    resolve_dtype_name(dtype, dev)
    started = time.perf_counter()
    choice = resolve_model(model, "world_model", tokenizer)
    if choice.tokenizer is None:
        raise InputError(f"--model {model} comes without an image tokenizer: pass --tokenizer DIR_OR_HUB_ID")
    model_dir = choice.world_model_dir
    config = load_config(model_dir)
    plan.check_model(config.layout.max_frames)  # before the synthetic truth is rendered
    tok = load_tokenizer(choice.tokenizer, dev, matching=config)
    wm = load_backend(backend_name, model_dir, device=dev, dtype=dtype, max_rollouts=plan.seeds)
    seconds_load = time.perf_counter() - started
    console.print(
        f"eval: model {model_dir}, tokenizer {tok.source}, backend: {backend_name} on {dev}; "
        f"{plan.seeds} world(s) x {len(plan.presets)} preset(s) ({','.join(plan.presets)}), "
        f"{plan.context_frames} context + {plan.generated_frames} generated frames, "
        + ("greedy" if plan.sampling.greedy else f"temperature {plan.sampling.temperature}")
        + f"; loaded in {seconds_load:.1f} s",
        highlight=False, soft_wrap=True,
    )

    results = []
    total = len(plan.presets) * plan.generated_frames
    try:
        with TaskProgress(console, "eval", total) as progress:
            for name in plan.presets:
                res = evaluate_preset(
                    name, plan, tok, wm,
                    on_frame=lambda _i, _t: progress.advance(),
                    on_stage=progress.note,
                )
                results.append(res)
            progress.note("done")
    finally:
        close = getattr(wm, "close", None)
        if close is not None:
            close()
    from terra_cli.bench.hf_vs_vllm import environment

    report = build_results(
        plan, results, model=str(model_dir), tokenizer=str(tok.source), backend=backend_name, device=dev,
        seconds_total=time.perf_counter() - started, seconds_load=seconds_load, environment=environment(),
    )
    _print_table(report)
    if out_json is not None:
        save_json(report, out_json, overwrite)
    if plot is not None:
        plot_eval(report, plot, overwrite)
    if strip is not None:
        save_strip(results, strip, overwrite)
    written = [str(p) for p in (out_json, plot, strip) if p is not None]
    console.print(
        f"eval took {report['seconds']['total']:.1f} s (generation {report['seconds']['generate']:.1f} s)"
        + (f"; wrote {', '.join(written)}" if written else ""),
        highlight=False, soft_wrap=True,
    )


def _print_table(report: dict) -> None:
    from rich.table import Table

    from terra_cli.evaluation.report import format_metric

    s = report["summary"]
    n = len(s["summary_frames"])
    table = Table(title=f"terra eval: means over seeds, generated frames 1-{n}", title_justify="left")
    for col in ("preset", "seeds", "PSNR gen", "PSNR copy", "SSIM gen", "SSIM copy", "PSNR tok ceiling",
                "lateral gen (m)", "lateral true (m)", "commanded (m)", "sign ok"):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for name, res in report["presets"].items():
        p = res["summary"]
        acc = p.get("sign_accuracy")
        table.add_row(
            name, str(len(res["per_seed"])), format_metric(p["psnr_generated"]), format_metric(p["psnr_copy_baseline"]),
            format_metric(p["ssim_generated"]), format_metric(p["ssim_copy_baseline"]), format_metric(p["psnr_tokenizer_ceiling"]),
            f"{format_metric(p['lateral_generated_mean_m'])} ± {format_metric(p['lateral_generated_std_m'])}",
            format_metric(p["lateral_true_mean_m"]), format_metric(p["lateral_commanded_m"]),
            "-" if acc is None else f"{acc:.0%}",
        )
    table.add_section()
    table.add_row("all", "", format_metric(s["psnr_generated_frames_1_5"]), format_metric(s["psnr_copy_baseline_frames_1_5"]),
                  format_metric(s["ssim_generated_frames_1_5"]), format_metric(s["ssim_copy_baseline_frames_1_5"]),
                  format_metric(s["psnr_tokenizer_ceiling_frames_1_5"]), "", "", "",
                  "-" if s.get("sign_accuracy_left_right") is None else f"{s['sign_accuracy_left_right']:.0%}")
    out.print(table)
