"""`terra bench`."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from terra_cli.cli import options as opts
from terra_cli.cli.app import app, console, friendly_errors, out

EPILOG = (
    "Examples:\n\n"
    "  terra bench --hf-vs-vllm --out results.json --plot results.png      # Terra-size model, random weights (GPU)\n\n"
    "  terra bench --hf-vs-vllm --model ckpt/world_model --batch 1,8 --hf-frames 2\n\n"
    "  terra bench --hf-vs-vllm --model tiny_ckpt --device cpu --frames 4 --context-frames 2 --batch 1,2   # smoke test\n\n"
    "  terra bench --draft-acceptance --seeds 3 --frames 8 --out acceptance.json --heatmap acceptance.png\n\n"
    "  terra bench --hf-vs-vllm --skip-hf --batch 1 --draft previous-frame --draft-tokens 4   # codes/step column\n\n"
    "  terra bench --hf-vs-vllm --skip-hf --batch 1 --draft jacobi --draft-tokens 8   # single-stream rows, plain and Jacobi (codes/step, ms/step, GPU busy)\n\n"
    "  terra bench --hf-vs-vllm --skip-hf --batch 1 --quantization fp8   # one rollout, fp8 weights (vLLM, single-stream)\n\n"
    "  terra bench --scenarios 256 --max-rollouts 128 --lockstep 64 --out scen.json      # continuous batching (GPU)\n\n"
    "  terra bench --scenarios 512 --data-parallel 2 --kv-cache-dtype fp8 --keep-outputs runs/dp2   # 2 GPUs (Ray)\n\n"
    "  CUDA_VISIBLE_DEVICES=0 terra bench --scenarios 256 --ray local --kv-cache-dtype fp8   # 1 engine, as a Ray actor\n\n"
    "  terra bench --act-bench 512 --data-parallel 2 --kv-cache-dtype fp8 --out act2.json   # ACT-Bench-shaped on 2 GPUs\n\n"
    "  terra bench --act-bench 256 --kv-cache-dtype fp8 --out act.json   # ACT-Bench-shaped, end to end, videos included\n\n"
    "  terra bench --act-bench 256 --kv-cache-dtype fp8 --writers 2 --out act-w2.json   # videos made in two processes\n\n"
    "  terra bench --act-bench 512 --data-parallel 4 --kv-cache-dtype fp8 --decoder refiner --refiner-windows 4\n"
    "      # ACT-Bench-shaped with Terra's video refiner on 4 GPUs, each engine refining its own videos\n\n"
    "  terra bench --refiner --windows 1,2 --refiner-compile default --out refiner.json   # Terra's refiner (GPU)\n\n"
    "  terra bench --env 64 --branches 8 --fork-from 20 --out env.json   # the closed-loop simulator (GPU; docs/simulator.md)\n\n"
    "Docs: docs/performance.md"
)


def parse_batches(text: str, option: str = "--batch", what: str = "rollout counts like 1,8,32") -> list[int]:
    from terra_cli.backends.base import InputError

    try:
        batches = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InputError(f"{option} takes comma-separated {what}, got {text!r}") from None
    if not batches or batches[0] < 1:
        raise InputError(f"{option} needs positive counts, got {text!r}")
    return batches


def _parse_vllm_args(items: list[str]) -> dict:
    import json

    from terra_cli.backends.base import InputError

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"--vllm-arg takes key=value, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@app.command(epilog=EPILOG)
@friendly_errors
def bench(
    hf_vs_vllm: bool = typer.Option(False, "--hf-vs-vllm", help="Compare the transformers reference with vLLM."),
    draft_acceptance: bool = typer.Option(False, "--draft-acceptance", help="Teacher-forced: how often a draft copied from the previous frame would be accepted (default model: terra-mini)."),
    seeds: int = typer.Option(3, "--seeds", min=1, help="--draft-acceptance: held-out synthetic worlds per preset."),
    temperatures: str = typer.Option("0.9,0", "--temperatures", help="--draft-acceptance: temperatures, comma-separated."),
    heatmap: Optional[Path] = typer.Option(None, "--heatmap", help="--draft-acceptance: PNG of the acceptance per grid position."),
    scenarios: int = typer.Option(0, "--scenarios", min=0, help="Scenario throughput: N scenarios of --frames frames through `generate --scenarios`'s engine (continuous batching)."),
    act_bench: int = typer.Option(0, "--act-bench", min=0, help="End to end like ACT-Bench: N samples (random nuScenes-size JPEGs, 47 frames in 2 rounds) through `generate --scenarios`, videos included; s/sample and a 2,286-sample projection."),
    writers: Optional[int] = typer.Option(None, "--writers", min=0, show_default="auto, as generate --scenarios", help="--act-bench: video writer processes per engine (0: threads of the engine's process), as `generate --scenarios --writers`."),
    videos_at_end: bool = typer.Option(False, "--videos-at-end", help="--act-bench on one engine: every video decoded and written once the tokens are made, as `generate --scenarios --videos-at-end`."),
    max_rollouts: str = typer.Option("auto", "--max-rollouts", help="--scenarios/--act-bench: rollouts in flight per engine, auto (as many as the KV cache holds, at most 256) or even (the samples in equal waves, up to what the KV cache holds, at most 512)."),
    data_parallel: int = typer.Option(1, "--data-parallel", min=1, help="--scenarios/--act-bench: engines, one per GPU; more than one run as actors of a local Ray cluster (needs terra-cli[ray])."),
    ray_address: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help="--scenarios/--act-bench: run the --data-parallel engines as Ray actors, also one: local (a cluster of this machine), auto, ray://HOST:10001 or HOST:6379, as `generate --scenarios --ray`."),
    lockstep: int = typer.Option(0, "--lockstep", min=0, help="--scenarios: also measure this many rollouts in lockstep (0: skip)."),
    kv_cache_dtype: str = opts.kv_cache_dtype_option(),
    quantization: str = opts.quantization_option(),
    attention: str = opts.attention_option(),
    backend: str = typer.Option("vllm", "--backend", help="--scenarios: vllm, or hf for a CPU smoke test."),
    keep_outputs: Optional[Path] = typer.Option(None, "--keep-outputs", help="--scenarios/--act-bench: keep the inputs (scenario file, images) and every output in this folder (new or empty; --overwrite to reuse one)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="World-model dir or hub id (default: Terra's config, random weights)."),
    frames: Optional[int] = typer.Option(None, help="Frames per run, context included (default 25; 47 with --act-bench)."),
    context_frames: int = typer.Option(3, help="Context frames."),
    batch: str = typer.Option("1,8,32,64", help="vLLM parallel rollouts to measure, comma-separated."),
    hf_frames: Optional[int] = typer.Option(None, help="Generated frames for the slow reference (default: all)."),
    temperature: float = opts.temperature_option(),
    seed: int = typer.Option(0, help="Seed for inputs and sampling."),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option(),
    skip_hf: bool = typer.Option(False, "--skip-hf", help="Leave out the transformers reference."),
    skip_single_stream: bool = typer.Option(False, "--skip-single-stream", help=(
        "--hf-vs-vllm: leave out the single-stream backend's rows (one rollout; plain, and with --draft jacobi).")),
    draft: str = opts.draft_option(),
    draft_tokens: int = opts.draft_tokens_option(),
    torch_compile: Optional[bool] = opts.torch_compile_option(),
    vllm_arg: list[str] = typer.Option([], "--vllm-arg", help="Extra vLLM engine argument key=value (repeatable)."),
    out_json: Optional[Path] = typer.Option(None, "--out", help="Write results (with the environment) as JSON."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG chart."),
    overwrite: bool = opts.overwrite_option(),
    refiner: bool = typer.Option(False, "--refiner", help="Terra's video refiner, random weights in its exact shapes: s/window, UNet evaluations/s, MFU, peak memory, ACT-Bench projection."),
    windows: str = typer.Option("1,2", "--windows", help="--refiner: windows per UNet call to measure, comma-separated."),
    refiner_compile: Optional[str] = typer.Option(None, "--refiner-compile", show_default="none with --refiner, auto with --decoder refiner", help="--refiner or --act-bench --decoder refiner: torch.compile mode for the UNet: none, auto (default on a GPU, none on a CPU), default, reduce-overhead or max-autotune (CUDA graphs), max-autotune-no-cudagraphs; --refiner compiles once at the largest --windows, then again per other size."),
    refiner_dtype: str = typer.Option("auto", "--refiner-dtype", help="--refiner or --act-bench --decoder refiner: auto (--dtype throughout) or fp8 (the UNet's attention and feed-forward Linear layers in float8; --refiner also reports the PSNR of one refined window against the same weights unquantized)."),
    full_cfg: bool = typer.Option(False, "--full-cfg", help="--refiner: run the guidance pair (two UNet evaluations per step, as Terra computes them) instead of one (same result: Terra's uc equals c)."),
    plain_cross_attention: bool = typer.Option(False, "--plain-cross-attention", help="--refiner: compute cross-attention over the zero context token instead of its closed form."),
    tiny: bool = typer.Option(False, "--tiny", help="--refiner, or --act-bench --decoder refiner without --refiner-weights: a tiny refiner config with random weights (a CPU smoke test; its times mean nothing)."),
    decoder: str = typer.Option("frames", "--decoder", help="--act-bench: frames (the frame-wise token decoder, 512x288) or refiner (Terra's video refiner, 640x384, as `generate --scenarios --decoder refiner`: each engine refines its own videos; at least 25 frames, a GPU)."),
    refiner_weights: Optional[str] = typer.Option(None, "--refiner-weights", metavar="PATH_OR_HUB_ID", help="--act-bench --decoder refiner: the refiner's weights, as `generate --refiner` takes them (here --refiner is a measure). Default: --model's own (turing-motors/Terra or a snapshot of it); with no --model, random weights in Terra's shapes and checkpoint format, written once into terra's cache folder."),
    refiner_windows: Optional[int] = opts.refiner_windows_option(),
    allow_slow: bool = typer.Option(False, "--allow-slow", help="--act-bench --decoder refiner on a CPU: run even when the refiner is estimated to take over an hour."),
    env: int = typer.Option(0, "--env", min=0, help="The closed-loop simulator: N environments stepping one frame each against the engine's frames/s at N rollouts in flight, and a fork's first step against its branches' next (docs/simulator.md)."),
    steps: int = typer.Option(8, "--steps", min=1, help="--env: steps the N environments take (within one round)."),
    branches: int = typer.Option(8, "--branches", min=1, help="--env: branches of the fork."),
    fork_from: int = typer.Option(20, "--fork-from", min=2, help="--env: frames of the forked state, context included."),
):
    """Measure generation speed: transformers reference vs vLLM, and vLLM with parallel rollouts."""
    from terra_cli.backends.base import InputError, Sampling
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.bench.hf_vs_vllm import BenchPlan, plot_results, run_bench, save_results
    from terra_cli.pipeline.outputs import OutputPlan

    vllm_options = _parse_vllm_args(vllm_arg)
    chosen = engine_options(kv_cache_dtype=kv_cache_dtype, quantization=quantization, draft=draft,
                            draft_tokens=draft_tokens, torch_compile=torch_compile, attention=attention)
    jacobi_draft_tokens = 0
    if hf_vs_vllm and chosen.get("draft") == "jacobi":  # the single-stream rows' draft, not vLLM's
        jacobi_draft_tokens = chosen["draft_tokens"]
        chosen = {key: value for key, value in chosen.items() if key not in ("draft", "draft_tokens")}
    if "draft_tokens" in chosen:
        vllm_options["disable_log_stats"] = False  # statistics on: the bench reports the codes each step kept
    vllm_options.update(chosen)
    if sum((hf_vs_vllm, draft_acceptance, scenarios > 0, act_bench > 0, refiner, env > 0)) > 1:
        raise InputError("measure one thing per run: --hf-vs-vllm, --draft-acceptance, --scenarios N, --act-bench N, --refiner or --env N")
    if not (hf_vs_vllm or draft_acceptance or scenarios or act_bench or refiner or env):
        raise InputError("say what to measure: terra bench --hf-vs-vllm, --draft-acceptance, --scenarios N, --act-bench N, --refiner or --env N")
    Sampling(temperature=temperature, seed=seed)  # --seed and --temperature in range, before anything runs
    for name, given in (("--writers", writers is not None), ("--videos-at-end", videos_at_end)):
        if given and not act_bench:
            raise InputError(f"{name} goes with --act-bench (the other measures write no videos)")
    if (data_parallel != 1 or ray_address is not None) and not (scenarios or act_bench):
        raise InputError("--data-parallel and --ray go with --scenarios or --act-bench")
    for name, given in (("--decoder", decoder.strip().lower() != "frames"), ("--refiner-weights", refiner_weights is not None),
                        ("--refiner-windows", refiner_windows is not None), ("--allow-slow", allow_slow)):
        if given and not act_bench:
            raise InputError(f"{name} goes with --act-bench" + ("" if name == "--decoder" else " --decoder refiner"))
    for name, given in (("--refiner-compile", refiner_compile is not None), ("--refiner-dtype", refiner_dtype != "auto"),
                        ("--tiny", tiny)):
        if given and not (refiner or act_bench):
            raise InputError(f"{name} goes with --refiner or --act-bench --decoder refiner")
    outputs = OutputPlan(overwrite)
    outputs.input("--model", Path(model) if model and os.path.lexists(model) else None)
    for name, path, used in (("--out", out_json, True), ("--plot", plot, hf_vs_vllm),
                             ("--heatmap", heatmap, draft_acceptance),
                             ("--keep-outputs", keep_outputs, scenarios > 0 or act_bench > 0)):
        if path is not None and not used:
            raise InputError(f"{name} does not go with what this run measures")
    if out_json is not None:
        outputs.file("--out", out_json, (".json",))
    if plot is not None:
        outputs.file("--plot", plot, (".png", ".svg", ".pdf"))
    if heatmap is not None:
        outputs.file("--heatmap", heatmap, (".png",))
    if keep_outputs is not None:
        outputs.folder("--keep-outputs", keep_outputs)
    if env:
        from terra_cli.bench.env import EnvBenchPlan
        from terra_cli.cli.bench_env import env_bench
        from terra_cli.env import require_gymnasium
        from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name

        check_backend_options(resolve_backend_name(backend), vllm_options)  # the other measures check in their jobs
        require_gymnasium(f"--env {env}")

        plan = EnvBenchPlan(envs=env, steps=steps, context_frames=context_frames, branches=branches,
                            fork_from=fork_from, backend=backend, device=device, dtype=dtype, temperature=temperature,
                            seed=seed, vllm_options=vllm_options)
        return env_bench(model, plan, out_json, overwrite)
    if refiner:
        from terra_cli.cli.bench_refiner import refiner_bench

        return refiner_bench(windows, refiner_compile or "none", refiner_dtype, full_cfg, plain_cross_attention, tiny,
                              device, dtype, seed, out_json, overwrite)
    if act_bench:
        from terra_cli.bench.act_bench import ActBenchPlan
        from terra_cli.cli.bench_act import act_bench as run_act_bench, act_bench_refiner
        from terra_cli.scenarios.job import parse_max_rollouts, wants_even_waves

        if lockstep:
            raise InputError("--lockstep goes with --scenarios")
        if windows != "1,2" or full_cfg or plain_cross_attention:
            raise InputError("--windows, --full-cfg and --plain-cross-attention go with --refiner (with --act-bench "
                             "--decoder refiner: --refiner-windows N)")
        refine, random_refiner = act_bench_refiner(decoder, refiner_weights, model, tiny, seed, device, dtype,
                                                   allow_slow, refiner_windows, refiner_compile, refiner_dtype)
        plan = ActBenchPlan(samples=act_bench, frames=47 if frames is None else frames, context_frames=context_frames,
                            max_rollouts=parse_max_rollouts(max_rollouts), backend=backend, device=device, dtype=dtype,
                            temperature=temperature, seed=seed, vllm_options=vllm_options, writers=writers,
                            data_parallel=data_parallel, ray=ray_address, refiner=refine,
                            even_waves=wants_even_waves(max_rollouts), videos_at_end=videos_at_end)
        return run_act_bench(model, plan, keep_outputs, out_json, overwrite, random_refiner)
    frames = 25 if frames is None else frames
    if draft_acceptance:
        return _draft_acceptance(model, seeds, frames, temperatures, device, out_json, heatmap, overwrite)
    if scenarios:
        from terra_cli.bench.scenarios import MAX_BENCH_SCENARIOS, ScenarioBenchPlan
        from terra_cli.scenarios.job import parse_max_rollouts, wants_even_waves

        if scenarios > MAX_BENCH_SCENARIOS:
            raise InputError(f"--scenarios {scenarios} is above the bench's {MAX_BENCH_SCENARIOS} (ACT-Bench is "
                             "2,286 samples); measure fewer")

        plan = ScenarioBenchPlan(scenarios=scenarios, frames=frames, context_frames=context_frames,
                                 max_rollouts=parse_max_rollouts(max_rollouts), data_parallel=data_parallel,
                                 ray=ray_address, lockstep=lockstep, backend=backend, device=device, dtype=dtype,
                                 temperature=temperature, seed=seed, vllm_options=vllm_options,
                                 even_waves=wants_even_waves(max_rollouts))
        from terra_cli.cli.bench_scenarios import scenario_bench

        return scenario_bench(model, plan, keep_outputs, out_json, overwrite)
    if hf_frames is not None and hf_frames < 1:
        raise InputError(f"--hf-frames must be at least 1, got {hf_frames}")
    from terra_cli.bench.cache import check_frames

    round_frames = check_frames(model, frames, context_frames)  # before a random model is built
    if frames > round_frames:
        raise InputError(f"--frames {frames}: --hf-vs-vllm measures one round, at most {round_frames} frames")
    if not skip_single_stream and vllm_options.get("quantization"):  # the single-stream rows read fp8 weights too
        from terra_cli.pipeline.engine_request import check_backend_options
        from terra_cli.runtime import resolve_device

        check_backend_options("single-stream", {"quantization": vllm_options["quantization"]}, resolve_device(device))
    plan = BenchPlan(
        frames=frames, context_frames=context_frames, batches=parse_batches(batch), hf_frames=hf_frames,
        temperature=temperature, seed=seed, device=device, dtype=dtype, run_hf=not skip_hf,
        vllm_options=vllm_options, run_single_stream=not skip_single_stream, jacobi_draft_tokens=jacobi_draft_tokens,
    )
    command = "terra " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def save_json(data: dict) -> None:
        # A bench takes minutes: what is measured so far is kept if it is interrupted, in a file
        # this run may replace because it made it.
        save_results(data, out_json, overwrite=outputs.may_replace(out_json))
        outputs.made(out_json)

    def save_partial(partial: dict) -> None:
        if out_json:
            save_json(dict(partial, command=command))

    results = run_bench(model, plan, log=lambda msg: console.print(f"[dim]{msg}[/]", highlight=False), on_update=save_partial)
    results["command"] = command
    _print_table(results)
    if out_json:
        save_json(results)
        console.print(f"results -> {out_json}")
    if plot:
        plot_results(results, plot, overwrite=overwrite)
        console.print(f"chart -> {plot}")


def _print_table(results: dict) -> None:
    table = Table(title=f"terra bench: {results['model']}")
    for col in ("backend", "rollouts", "start-up s", "first frame s", "s/frame (mean ± sd)", "tokens/s", "frames/s",
                "GPU mem GB", "prefix hit", "codes/step", "ms/step", "GPU busy"):
        table.add_column(col, justify="right" if col != "backend" else "left")
    for r in results["runs"]:
        table.add_row(
            r["backend"], str(r["rollouts"]), f"{r['startup_s']:.1f}", f"{r['first_frame_s']:.3f}",
            f"{r['s_per_frame_mean']:.3f} ± {r['s_per_frame_stdev']:.3f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['frames_per_s']:.2f}", "-" if r["peak_gpu_memory_gb"] is None else f"{r['peak_gpu_memory_gb']:.1f}",
            "-" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.1%}",
            "-" if r.get("tokens_per_step") is None else f"{r['tokens_per_step']:.2f}",
            "-" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.2f}",
            "-" if r.get("gpu_busy") is None else f"{r['gpu_busy']:.0%}",
        )
    out.print(table)
    if results.get("speedup_vllm_over_hf"):
        out.print(f"vLLM (1 rollout) is [bold]{results['speedup_vllm_over_hf']}x[/] faster per frame than the transformers reference")
    for r in results["runs"]:
        if r["notes"]:
            out.print(f"[dim]{r['backend']} x{r['rollouts']}: {r['notes']}[/]")


def _draft_acceptance(model, seeds, frames, temperatures, device, out_json, heatmap, overwrite) -> None:
    import math

    from terra_cli.bench.draft_acceptance import AcceptancePlan, plot_heatmaps, run_draft_acceptance
    from terra_cli.errors import InputError
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.modeling_hf import load_model
    from terra_cli.models.resolve import load_tokenizer, resolve_model
    from terra_cli.runtime import resolve_device

    try:
        temps = tuple(float(t) for t in temperatures.split(",") if t.strip())
    except ValueError:
        raise InputError(f"--temperatures takes numbers like 0.9,0, got {temperatures!r}") from None
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps):
        raise InputError(f"--temperatures must be finite numbers >= 0, got {temperatures!r}")
    device = resolve_device(device)
    choice = resolve_model(model)
    if choice.tokenizer is None:
        raise InputError(f"--model {model} comes without an image tokenizer: --draft-acceptance needs one")
    config = load_config(choice.world_model_dir)
    if frames < 2 or frames > config.layout.max_frames:
        raise InputError(f"--frames must be 2..{config.layout.max_frames} for --draft-acceptance, got {frames}")
    tok = load_tokenizer(choice.tokenizer, device, matching=config)
    wm = load_model(choice.world_model_dir, device)
    plan = AcceptancePlan(seeds=seeds, frames=frames, temperatures=temps)
    results = run_draft_acceptance(wm, tok, plan, log=lambda msg: console.print(f"[dim]{msg}[/]", highlight=False))
    results["model"] = choice.label
    table = Table(title=f"previous-frame drafts: {choice.label}")
    table.add_column("T")
    table.add_column("mean acceptance", justify="right")
    for k in (1, 2, 4, 8, 16):
        table.add_column(f"tokens/step k={k}", justify="right")
    for t, data in results["temperatures"].items():
        table.add_row(t, f"{data['mean_acceptance']:.3f}", *(f"{data['tokens_per_step'][k]:.2f}" for k in (1, 2, 4, 8, 16)))
    out.print(table)
    out.print(f"true next frame repeats the previous one at {results['true_next_frame_repeats_previous']:.1%} of positions")
    if out_json:
        atomic_write_json(out_json, results, overwrite=overwrite)
    if heatmap:
        plot_heatmaps(results, heatmap, overwrite=overwrite)
