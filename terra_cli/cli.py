"""The `terra` command line: parses, reports, and leaves the work to the library."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import cli_options as opts
from .errors import TerraError

app = typer.Typer(
    name="terra",
    help="Run the Terra action-conditioned driving world model: tokenize frames, generate video, benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
actions_app = typer.Typer(help="Convert and draw action trajectories.", no_args_is_help=True)
app.add_typer(actions_app, name="actions")

console = Console(stderr=True)
out = Console()
_state = {"debug": False}


def friendly_errors(fn):
    """Turn the user's mistakes into one line on stderr and exit code 2; --debug shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TerraError as exc:
            if _state["debug"]:
                raise
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    verbose: bool = typer.Option(False, "--verbose", help="Keep vLLM's INFO logs (engine set-up, compilation, ...); by default it logs only warnings and errors. VLLM_LOGGING_LEVEL in the environment wins over both."),
):
    _state["debug"] = debug
    quiet_vllm_logging(verbose)


def quiet_vllm_logging(verbose: bool = False, environ=None) -> None:
    """Let vLLM log warnings and errors only, unless `--verbose` or the user's own VLLM_LOGGING_LEVEL.

    vLLM reads VLLM_LOGGING_LEVEL from the environment: into its default logging config at
    `import vllm`, and again when an engine applies its LoggingConfig. The root callback calls this
    before any command runs, so before vLLM is first imported. Only the CLI calls it: importing
    terra_cli as a library leaves vLLM's defaults alone.
    """
    environ = os.environ if environ is None else environ
    if verbose or environ.get("VLLM_LOGGING_LEVEL"):  # an empty value counts as unset
        return
    environ["VLLM_LOGGING_LEVEL"] = "WARNING"


def not_implemented(what: str) -> None:
    console.print(f"[yellow]terra {what} is not implemented yet.[/]")
    raise typer.Exit(3)


# --------------------------------------------------------------------------------------------
@app.command(
    epilog=(
        "Examples:\n\n"
        "  terra generate out.mp4 --frames 25 --actions left\n\n"
        "  terra generate out.mp4 --context clip.mp4 --actions acts.npy --frames 50 --seed 1 --save-frames frames/\n\n"
        "  terra generate out.mp4 --model turing-motors/Terra --variant world_model_v2 --context frames/ --actions traj.json\n\n"
        "  terra generate --model ckpt/world_model --context-tokens ctx.npy --actions acts.npy \\\n"
        "      --frames 10 --temperature 0 --backend hf --no-decode --save-tokens out.npy"
    )
)
@friendly_errors
def generate(
    output: Optional[Path] = typer.Argument(None, metavar="[OUTPUT.mp4]", help="Video to write (H.264 .mp4, 10 fps, 512x288); not needed with --no-decode."),
    actions: str = typer.Option(..., "--actions", "-a", help=(
        "Trajectory: a preset (straight, left, right, stop, accelerate; driven at --speed), a .npy of shape "
        "(frames, 6, 3) or (frames*6, 3) with (lateral y m, forward x m, time s) waypoints, or ACT-Bench "
        ".json/.jsonl ('instruction_trajs'). Files need rows for at least frames-1 frames.")),
    frames: int = typer.Option(25, "--frames", "-n", help="Total frames, context included (max 100; above 25 runs in rounds re-seeded with the last 3 frames)."),
    context: Optional[list[Path]] = typer.Option(None, "--context", "-c", help="Context: a folder of images (natural order), image file(s) (repeat the option), or a video. Default: the embedded sample road."),
    context_frames: Optional[int] = typer.Option(None, "--context-frames", "-k", min=1, help="Use the LAST K frames of --context (the most recent). Default 3, or fewer when fewer are given; with --context-tokens, all rows."),
    context_tokens: Optional[Path] = typer.Option(None, help="Context as tokens instead of images: int .npy of shape (frames, 576); skips the encoder."),
    speed: float = opts.speed_option(),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="World-model directory or hub id (default: the embedded terra-mini)."),
    variant: str = typer.Option("world_model", help="Subfolder of turing-motors/Terra (or of a local snapshot): world_model or world_model_v2; each comes with its tokenizer."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", "-t", help="Image tokenizer directory or hub id (overrides the one paired with --model)."),
    temperature: float = opts.temperature_option(),
    top_k: int = opts.top_k_option(),
    top_p: float = opts.top_p_option(),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same video."),
    backend: str = opts.backend_option(),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option(),
    threads: int = typer.Option(0, min=0, help="CPU threads for the token loop (0: auto, 1 for small models with --backend hf on CPU)."),
    save_frames: Optional[Path] = typer.Option(None, help="Also write every frame, context included, as PNGs into this folder."),
    save_tokens: Optional[Path] = typer.Option(None, help="Write all frames' tokens, context included, (N, 576) int64 .npy."),
    no_decode: bool = typer.Option(False, "--no-decode", help="Stop at tokens: no image decoder, no video (needs --save-tokens)."),
    overwrite: bool = opts.overwrite_option(),
):
    """Generate future frames from context frames and a trajectory (out of the box: the embedded terra-mini)."""
    import numpy as np

    from . import actions as actions_mod
    from . import pipeline as pl
    from .checkpoint import load_config
    from .io_utils import atomic_save_npy
    from .media import write_frames, write_video
    from .reporting import FrameProgress
    from .world_model import InputError, Sampling, load_backend, resolve_backend_name

    # 1. Everything that can be checked without a model, outputs first.
    outputs = pl.check_outputs(output, save_frames, save_tokens, no_decode=no_decode, overwrite=overwrite)
    if context and context_tokens is not None:
        raise InputError("give --context (images/video) or --context-tokens, not both")
    pl.check_frame_count(frames, context_frames)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    waypoints = actions_mod.resolve_actions(actions, frames=frames, speed_kmh=speed)
    pl.check_actions_cover(waypoints, frames)
    context_ids = pl.load_context_tokens(context_tokens, context_frames) if context_tokens is not None else None
    if context_ids is not None:
        pl.check_frame_count(frames, context_ids.shape[0])
    images = pl.read_context_frames(context, context_frames) if context else None
    backend_name = resolve_backend_name(backend)

    # 2. The model pair; the world model's config is cheap and settles the rest of the checks.
    choice = pl.resolve_model(model, variant, tokenizer)
    config = load_config(choice.world_model_dir)
    layout = config.layout
    needs_tokenizer = outputs.decode or context_ids is None
    if needs_tokenizer and choice.tokenizer is None:
        raise InputError(
            f"--model {model} comes without an image tokenizer: pass --tokenizer DIR_OR_HUB_ID "
            "(or --no-decode with --context-tokens to stay in tokens)"
        )
    console.print(f"model: [bold]{choice.label}[/]", highlight=False, soft_wrap=True)
    tok = None
    if needs_tokenizer:
        started = time.perf_counter()
        tok = pl.load_tokenizer(choice, device)
        pl.check_tokenizer_matches(tok, config)
        console.print(f"tokenizer: {tok.source}  ({time.perf_counter() - started:.1f} s to load)", highlight=False, soft_wrap=True)

    # 3. Context -> tokens.
    if context_ids is None:
        if images is None:
            from .default_model import sample_context_frames

            images = list(sample_context_frames(context_frames or pl.DEFAULT_CONTEXT_FRAMES))
            console.print(f"context: {len(images)} frame(s) of the embedded sample road", highlight=False)
        else:
            console.print(f"context: last {len(images)} frame(s) of {', '.join(map(str, context))}", highlight=False, soft_wrap=True)
        with _StepProgress("encoding", len(images)) as step:
            context_ids = tok.tokenize(images, on_batch=step.advance)
    else:
        console.print(f"context: {context_ids.shape[0]} frame(s) of tokens from {context_tokens}", highlight=False, soft_wrap=True)
    k = context_ids.shape[0]
    pl.check_frame_count(frames, k)
    rounds = pl.plan_rounds(k, frames, layout.max_frames)

    # 4. Generate, frame by frame; Ctrl-C keeps what is finished when --save-tokens is given.
    import torch

    default_threads = torch.get_num_threads()
    loop_threads = pl.generation_threads(threads, config, backend_name, device)
    started = time.perf_counter()
    world_model = load_backend(backend_name, choice.world_model_dir, device=device, dtype=dtype)
    auto = " (auto)" if backend == "auto" else ""
    console.print(
        f"backend: [bold]{world_model.name}[/]{auto}  model: {choice.world_model_dir}  "
        f"({time.perf_counter() - started:.1f} s to load)" + (f", {loop_threads} CPU thread(s)" if loop_threads else ""),
        highlight=False, soft_wrap=True,
    )
    generated = frames - k
    if len(rounds) > 1:
        console.print(f"{frames} frames in {len(rounds)} rounds of at most {layout.max_frames} "
                      f"(each re-seeded with the last {pl.RESEED_FRAMES} frames)", highlight=False)
    progress = FrameProgress(console, generated, layout.image_tokens)
    recorder = pl.TokenRecorder(context_ids, frames, on_frame=progress.frame_done)
    try:
        if loop_threads:
            torch.set_num_threads(loop_threads)
        with progress:
            tokens = pl.generate_tokens(world_model, context_ids, waypoints, frames, sampling, on_frame=recorder.frame_done)[0]
    except KeyboardInterrupt:
        _save_interrupted(recorder, outputs.tokens, frames)
    finally:
        torch.set_num_threads(default_threads)  # decoding images is convolutions: all threads again
        world_model.close()
    tokens = tokens.astype(np.int64)
    gen_seconds = progress.elapsed

    # 5. Write: tokens first (cheapest), then decode and write frames / video, each atomically.
    try:
        if outputs.tokens is not None:
            atomic_save_npy(outputs.tokens, tokens)
        if outputs.decode:
            with _StepProgress("decoding", len(tokens)) as step:
                pictures = tok.decode_tokens(tokens, on_batch=step.advance)
            if outputs.frames_dir is not None:
                if outputs.overwrite and outputs.frames_dir.is_dir():
                    for stale in outputs.frames_dir.glob("frame_*.png"):
                        stale.unlink()
                write_frames(outputs.frames_dir, list(pictures))
            if outputs.video is not None:
                write_video(outputs.video, list(pictures), fps=10)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted while writing; no partial video was left behind[/]")
        raise typer.Exit(130) from None

    written = [f"video -> {outputs.video}" if outputs.video else None,
               f"frames -> {outputs.frames_dir}/" if outputs.frames_dir else None,
               f"tokens -> {outputs.tokens}" if outputs.tokens else None]
    console.print(
        f"{frames} frames ({k} context + {generated} generated, {len(rounds)} round(s)) in {gen_seconds:.1f} s, "
        f"{gen_seconds / max(generated, 1):.2f} s/frame, backend {world_model.name}, model {choice.label}; "
        + "; ".join(w for w in written if w),
        highlight=False, soft_wrap=True,
    )


def _save_interrupted(recorder, tokens_path: Optional[Path], total: int) -> None:
    from .io_utils import atomic_save_npy

    if tokens_path is not None:
        done = recorder.finished()
        atomic_save_npy(tokens_path, done)
        console.print(f"[yellow]interrupted:[/] saved {done.shape[0]} of {total} frames' tokens "
                      f"(context included) -> {tokens_path}", highlight=False, soft_wrap=True)
    else:
        console.print("[yellow]interrupted:[/] nothing written (pass --save-tokens to keep finished frames)")
    raise typer.Exit(130)


class _StepProgress:
    """A progress bar for encoding / decoding, shown only once the step takes over a second."""

    def __init__(self, label: str, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("frames"),
                                 TimeElapsedColumn(), console=console, transient=False, auto_refresh=False)
        self.task = self.progress.add_task(label, total=total)
        self.label = label
        self.started = 0.0
        self.shown = False

    def __enter__(self):
        self.started = time.perf_counter()
        return self

    def advance(self, n: int) -> None:
        self.progress.update(self.task, advance=n)
        if not self.shown and time.perf_counter() - self.started > 1.0:
            self.progress.start()
            self.shown = True
        if self.shown:
            self.progress.refresh()

    def __exit__(self, *exc):
        if self.shown:
            self.progress.stop()
        elif exc[0] is None:
            console.print(f"{self.label}: {self.progress.tasks[0].completed:.0f} frames in "
                          f"{time.perf_counter() - self.started:.1f} s", highlight=False)
        return False


@app.command()
@friendly_errors
def info(model: str = typer.Argument(..., help="World-model directory or hub id.")):
    """Show a world model's config and size."""
    from .checkpoint import load_config, resolve_checkpoint_dir, weight_files

    checkpoint_dir = resolve_checkpoint_dir(model)
    config = load_config(checkpoint_dir)
    files = weight_files(checkpoint_dir)
    size = sum(f.stat().st_size for f in files)
    layout = config.layout
    out.print(f"[bold]{checkpoint_dir}[/]")
    out.print(f"  architecture   {config.architecture}")
    out.print(f"  decoder        {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_attention_heads} heads ({config.num_key_value_heads} kv)")
    out.print(f"  image codes    {layout.image_vocab_size}, {layout.image_tokens} per frame")
    out.print(f"  actions        {layout.action_tokens} waypoints x {config.action_dim} per frame")
    out.print(f"  frames/round   {layout.max_frames}")
    out.print(f"  weights        {len(files)} file(s), {size / 1e6:.1f} MB")


# Each larger command lives in its own module and registers itself on `app` / `actions_app`.
from . import cli_actions, cli_bench, cli_eval, cli_tokenize  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
