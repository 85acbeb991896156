"""`terra generate`: parse options, build a VideoRequest, call `generate_video`, report."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional

import typer

from terra_cli.cli import options as opts
from terra_cli.cli.app import (EXIT_INTERRUPTED, _state, app, console, friendly_errors, say,
                               warn_implausible)
from terra_cli.errors import InputError

ONE_VIDEO_FRAMES = 25  # --frames of one video when not given (a scenario line has its own default)


@app.command(
    epilog=(
        "Examples:\n\n"
        "  terra generate out.mp4 --frames 25 --actions left\n\n"
        "  terra generate out.mp4 --context clip.mp4 --actions acts.npy --frames 50 --seed 1 --save-frames frames/\n\n"
        "  terra generate out.mp4 --model turing-motors/Terra --variant world_model_v2 --context frames/ --actions traj.json\n\n"
        "  terra generate --model ckpt/world_model --context-tokens ctx.npy --actions acts.npy \\\n"
        "      --frames 10 --temperature 0 --backend hf --no-decode --save-tokens out.npy\n\n"
        "  terra generate out.mp4 --actions left --draft previous-frame --draft-tokens 4   # several codes per engine step\n\n"
        "  terra generate --scenarios scenarios.jsonl --out-dir videos/ --max-rollouts 256 --kv-cache-dtype fp8\n\n"
        "  terra generate --scenarios scenarios.jsonl --out-dir videos/ --writers 2   # two processes make the mp4s\n\n"
        "  terra generate --scenarios scenarios.jsonl --out-dir videos/ --videos-at-end\n\n"
        "  terra generate --scenarios act_bench.jsonl --image-root /data/nuscenes --out-dir actbench/ \\\n"
        "      --model turing-motors/Terra --data-parallel 2      # scorer-ready NUSCENES_ACTION_*.mp4, 47 frames\n\n"
        "  terra generate out.mp4 --model turing-motors/Terra --context frames/ --actions left --frames 47 \\\n"
        "      --decoder refiner      # Terra's video refiner (the paper's setting): 640x384, GPU\n\n"
        "  terra generate --scenarios scenarios.jsonl --out-dir videos/ --ray auto   # every GPU of a running Ray cluster\n\n"
        "Docs: docs/generate.md (one video), docs/scenarios.md (--scenarios, ACT-Bench), docs/refiner.md, docs/ray.md"
    )
)
@friendly_errors
def generate(
    output: Optional[Path] = typer.Argument(None, metavar="[OUTPUT.mp4]", help="Video to write (H.264 .mp4, 10 fps, 512x288); not needed with --no-decode."),
    actions: Optional[str] = typer.Option(None, "--actions", "-a", help=(
        "Trajectory: a preset (straight, left, right, stop, accelerate; driven at --speed), a .npy of shape "
        "(frames, 6, 3) or (frames*6, 3) with (lateral y m, forward x m, time s) waypoints, or ACT-Bench "
        ".json/.jsonl ('instruction_trajs'). Files need rows for at least frames-1 frames.")),
    frames: Optional[int] = typer.Option(None, "--frames", "-n", show_default="25; 47 for ACT-Bench scenarios", help="Total frames, context included (max 100; above 25 runs in rounds re-seeded with the last 3 frames)."),
    context: Optional[list[Path]] = typer.Option(None, "--context", "-c", help="Context: a folder of images (natural order), image file(s) (repeat the option), or a video. Default: the embedded sample road."),
    context_frames: Optional[int] = typer.Option(None, "--context-frames", "-k", min=1, help="Use the LAST K frames of --context (the most recent). Default 3, or fewer when fewer are given; with --context-tokens, all rows."),
    context_tokens: Optional[Path] = typer.Option(None, help="Context as tokens instead of images: int .npy of shape (frames, 576); skips the encoder."),
    speed: float = opts.speed_option(),
    model: Optional[str] = opts.model_option(),
    variant: str = opts.variant_option(),
    tokenizer: Optional[str] = opts.tokenizer_option(),
    temperature: float = opts.temperature_option(),
    top_k: int = opts.top_k_option(),
    top_p: float = opts.top_p_option(),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same video."),
    backend: str = opts.backend_option(),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option(),
    threads: int = typer.Option(0, min=0, help="CPU threads for the token loop (0: auto, 1 for small models with --backend hf on CPU)."),
    save_frames: Optional[Path] = typer.Option(None, help="Also write every frame, context included, as PNGs frame_NNNN.png into this folder (made whole when new; with --overwrite an existing folder's frame files are replaced and its other files left alone)."),
    save_tokens: Optional[Path] = typer.Option(None, help="Write all frames' tokens, context included, (N, 576) int64 .npy."),
    no_decode: bool = typer.Option(False, "--no-decode", help="Stop at tokens: no image decoder, no video (needs --save-tokens)."),
    overwrite: bool = opts.overwrite_option(),
    scenarios: Optional[Path] = typer.Option(None, "--scenarios", help="Many videos: a JSONL file, terra's format or ACT-Bench's (see README); needs --out-dir."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="With --scenarios: where each scenario's ID.mp4 and ID.npy and results.jsonl go; a re-run resumes. One run at a time; a file no terra run made for that scenario is replaced only with --overwrite."),
    rollouts: int = typer.Option(1, "--rollouts", min=1, help="With --scenarios: seeded samples per scenario (seed, seed+1, ...; ids get _s0, _s1, ...)."),
    max_rollouts: str = typer.Option("auto", "--max-rollouts", help="With --scenarios: rollouts in flight at once on the vLLM engine; auto: as many of the longest scenario as the KV cache holds without preemption, at most 256 (256 with --kv-cache-dtype fp8 was the fastest measured, benchmarks/README.md); even: each engine's scenarios in equal waves, up to what the KV cache holds (at most 512), so no small last wave runs alone (on four H200s no faster than auto: the steps are bound by the KV cache, benchmarks/README.md)."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="With --scenarios: skip bad lines (recorded in results.jsonl) instead of stopping."),
    videos_at_end: bool = typer.Option(False, "--videos-at-end", help="With --scenarios on one engine: decode and write every video once all the scenarios' tokens are made, not beside the engine (one H100, 128 samples: 89-92% of a tokens-only run's pace, against 83-87%); the same files, but they appear only at the end, and a run killed before then writes none (a re-run makes them again)."),
    writers: Optional[int] = typer.Option(None, "--writers", min=0, show_default="auto: 0", help="With --scenarios: processes that decode scenarios' frames as they are made and encode their mp4s beside the engine (e.g. --writers 2); 0: threads of the engine's process do it (the default: faster on a GPU, where they share vLLM's CUDA context). With --ray/--data-parallel: per engine, on its node. --decoder refiner always decodes in the engine's process (each Ray engine refines its own videos)."),
    kv_cache_dtype: str = opts.kv_cache_dtype_option(),
    quantization: str = opts.quantization_option(),
    attention: str = opts.attention_option(),
    draft: str = opts.draft_option(),
    draft_tokens: int = opts.draft_tokens_option(),
    torch_compile: Optional[bool] = opts.torch_compile_option(),
    data_parallel: int = typer.Option(1, "--data-parallel", min=1, help="With --scenarios: N engines on this machine, one per visible GPU (a local Ray cluster; needs terra-cli[ray]), taking scenarios as they free up."),
    ray_address: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help="With --scenarios: run on a Ray cluster, one engine per GPU: auto (the cluster `ray start` joined), ray://HOST:10001, HOST:6379, or local (a cluster of this machine). Needs terra-cli[ray] on every node."),
    engines: Optional[int] = typer.Option(None, "--engines", min=1, help="With --ray: at most N engines (default: one per GPU of the cluster; on CPUs, one per node)."),
    image_root: Optional[Path] = typer.Option(None, "--image-root", help="With ACT-Bench scenarios: the nuScenes dataroot its context_frames paths are relative to (default: the file's folder)."),
    decoder: str = typer.Option("frames", "--decoder", help="frames: Terra's frame-wise token decoder (512x288); refiner: Terra's video refiner, the paper's ACT-Bench setting (640x384, at least 25 frames, a GPU)."),
    refiner: Optional[str] = typer.Option(None, "--refiner", help="With --decoder refiner: its weights, a .pt/.safetensors file, a folder or a hub id (default: from --model turing-motors/Terra, file video_refiner/refiner_model.pt)."),
    allow_slow: bool = typer.Option(False, "--allow-slow", help="With --decoder refiner on a CPU: run even when it is estimated to take over an hour."),
    refiner_compile: str = opts.refiner_compile_option(),
    refiner_windows: Optional[int] = opts.refiner_windows_option(),
    refiner_dtype: str = opts.refiner_dtype_option(),
    server: Optional[str] = typer.Option(None, "--server", help="Run on a `terra serve` at this URL (its model; no start-up here). API key: TERRA_API_KEY."),
):
    """Generate future frames from context frames and a trajectory (out of the box: the embedded terra-mini)."""
    from terra_cli.actions import PRESETS, resolve_actions
    from terra_cli.backends import Sampling
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.models.resolve import resolve_model
    from terra_cli.pipeline import inputs
    from terra_cli.pipeline.outputs import check_outputs
    from terra_cli.pipeline.video import Engine, TokenBuffer, VideoRequest, generate_video
    from terra_cli.runtime import generation_threads, resolve_device, resolve_dtype_name

    refine = None
    if decoder != "frames" or refiner is not None or allow_slow or refiner_compile != "auto" or refiner_windows is not None \
            or refiner_dtype != "auto":
        from terra_cli.refiner.decoder import refiner_choice, refiner_options

        one_video = None if scenarios is not None else ONE_VIDEO_FRAMES if frames is None else frames
        refine = refiner_choice(decoder, refiner, model, device, dtype, allow_slow,
                                refiner_options(decoder, refiner_windows, refiner_compile, refiner_dtype, one_video))

    if scenarios is not None:
        from terra_cli.models.resolve import ModelSpec
        from terra_cli.scenarios.job import ScenarioJob, parse_max_rollouts, wants_even_waves
        from terra_cli.scenarios.spec import Defaults

        if server is not None:
            raise InputError("--server runs one video per call; send a scenario file's lines to the server's page "
                             "or to POST /v1/videos")
        if out_dir is None:
            raise InputError("--scenarios needs --out-dir DIR (each scenario writes DIR/ID.mp4, DIR/ID.npy and a "
                             "line in DIR/results.jsonl)")
        if output is not None:
            raise InputError(f"--scenarios writes into --out-dir; drop OUTPUT ({output})")
        defaults = Defaults(frames=frames, seed=seed, speed_kmh=speed, context_frames=context_frames or 3,
                            image_root=image_root)
        job = ScenarioJob(
            scenarios=scenarios, out_dir=out_dir, defaults=defaults, rollouts=rollouts, skip_invalid=skip_invalid,
            model=ModelSpec(model, variant, tokenizer),
            engine=Engine(backend, device, dtype, threads,
                          engine_options(kv_cache_dtype, quantization, draft, draft_tokens, torch_compile, attention)),
            sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p),
            max_rollouts=parse_max_rollouts(max_rollouts), even_waves=wants_even_waves(max_rollouts), decode=not no_decode,
            overwrite=overwrite,
            refiner=refine, writers=writers, videos_at_end=videos_at_end)
        from terra_cli.cli.scenarios import generate_scenarios

        return generate_scenarios(job, data_parallel, ray_address, engines)
    for name, value in (("--data-parallel", data_parallel != 1), ("--ray", ray_address), ("--engines", engines), ("--image-root", image_root), ("--out-dir", out_dir),
                        ("--rollouts", rollouts != 1), ("--skip-invalid", skip_invalid), ("--writers", writers is not None),
                        ("--videos-at-end", videos_at_end)):
        if value:
            raise InputError(f"{name} works with --scenarios FILE")
    frames = ONE_VIDEO_FRAMES if frames is None else frames
    if actions is None:
        raise InputError("--actions is needed (a preset, a .npy, or ACT-Bench JSON), or --scenarios FILE for many videos")
    # Everything that can be checked without a model, outputs first.
    given = [("--context-tokens", context_tokens), ("--model", _local(model)), ("--tokenizer", _local(tokenizer)),
             ("--actions", None if actions.strip().lower() in PRESETS else _local(actions)),
             *(("--context", path) for path in context or ())]
    outputs = check_outputs(output, save_frames, save_tokens, no_decode=no_decode, overwrite=overwrite, inputs=given)
    if context and context_tokens is not None:
        raise InputError("give --context (images/video) or --context-tokens, not both")
    inputs.check_frame_count(frames, context_frames)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    device = resolve_device(device)
    resolve_dtype_name(dtype, device)
    generation_threads(threads, 0, "hf", device)  # range check only
    waypoints = resolve_actions(actions, frames=frames, speed_kmh=speed)
    inputs.check_actions_cover(waypoints, frames)
    warn_implausible(waypoints[: frames - 1])
    context_ids = inputs.load_context_tokens(context_tokens, context_frames) if context_tokens is not None else None
    images = inputs.read_context_frames(context, context_frames) if context else None
    label = (f" of {', '.join(map(str, context))}" if context else
             f" from {context_tokens}" if context_tokens is not None else "")
    request = VideoRequest(actions=waypoints, frames=frames, outputs=outputs, sampling=sampling,
                           context_images=images, context_tokens=context_ids, context_frames=context_frames,
                           context_label=label)
    request.check()
    if server is not None:
        return _generate_on_server(server, request, model=model, variant=variant != "world_model", tokenizer=tokenizer,
                                   backend=backend != "auto", dtype=dtype != "auto", threads=threads,
                                   kv_cache_dtype=kv_cache_dtype != "auto", quantization=quantization != "none",
                                   draft=draft != "none", torch_compile=torch_compile is not None,
                                   attention=attention != "auto",
                                   decoder=refine is not None)
    choice = resolve_model(model, variant, tokenizer)
    buffer = TokenBuffer()
    options = engine_options(kv_cache_dtype, quantization, draft, draft_tokens, torch_compile, attention)
    try:
        result = generate_video(request, choice, Engine(backend, device, dtype, threads, options), buffer=buffer,
                                observer=CliObserver(), refiner=refine)
    except KeyboardInterrupt:
        _save_interrupted(buffer, outputs.tokens, frames, overwrite)
    say(
        f"{frames} frames ({result.context_frames} context + {result.generated_frames} generated, {result.rounds} round(s)) "
        f"in {result.generation_seconds:.1f} s, {result.seconds_per_frame:.2f} s/frame, backend {result.backend}, "
        f"model {choice.label}; " + "; ".join(result.written)
        + f"; {time.perf_counter() - _state['started']:.1f} s in all"
    )


def _generate_on_server(url: str, request, **engine_flags) -> None:
    from terra_cli.server.client import generate_remote

    given = [name for name, value in engine_flags.items() if value]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')} is the server's choice (set when it started); drop it with --server")
    result = generate_remote(url, request, observer=CliObserver())
    say(f"{result.frames} frames ({result.context_frames} context + {result.generated_frames} generated, {result.rounds} round(s)) "
        f"in {result.generation_seconds:.1f} s, {result.seconds_per_frame:.2f} s/frame, backend {result.backend}, "
        f"model {result.model}; " + "; ".join(result.written) + f"; {time.perf_counter() - _state['started']:.1f} s in all")


def _local(spec: Optional[str]) -> Optional[Path]:
    """A path given as a string option (--model, --actions) when it names something on disk."""
    return Path(spec) if spec and os.path.lexists(spec) else None


def _save_interrupted(buffer, tokens_path: Optional[Path], total: int, overwrite: bool) -> None:
    from terra_cli.media.atomic import atomic_save_npy

    done = buffer.finished()
    if tokens_path is not None and done.size:
        atomic_save_npy(tokens_path, done, overwrite=overwrite)
        say(f"interrupted: saved {done.shape[0]} of {total} frames' tokens (context included) -> {tokens_path}")
    elif tokens_path is None:
        say("interrupted: nothing written (pass --save-tokens to keep finished frames)")
    else:
        say("interrupted before any frame: nothing written")
    raise typer.Exit(EXIT_INTERRUPTED)


class CliObserver:
    """generate_video's reports as console lines and rich progress bars (rate and ETA)."""

    def message(self, text: str) -> None:
        # --verbose: when, since the command started, so gaps in the end-to-end time can be read off.
        say(f"[{time.perf_counter() - _state['started']:6.1f} s] {text}" if _state["verbose"] else text)

    def startup(self, phases: dict) -> None:
        from terra_cli.cli.app import _state

        if _state["verbose"]:
            say("engine start-up: " + ", ".join(f"{k} {v}" for k, v in phases.items()
                                                 if k != "timeline" and v is not None))

    def timing(self, what: str, seconds: float) -> None:
        if _state["verbose"]:
            self.message(f"{what}: {seconds:.1f} s")

    @contextlib.contextmanager
    def steps(self, label: str, total: int):
        from terra_cli.cli.progress import StepProgress

        with StepProgress(console, label, total) as step:
            yield step.advance

    @contextlib.contextmanager
    def frames(self, total: int, tokens_per_frame: int):
        from terra_cli.cli.progress import FrameProgress

        with FrameProgress(console, total, tokens_per_frame) as progress:
            yield progress.frame_done
