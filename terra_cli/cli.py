"""The `terra` command line: parses, reports, and leaves the work to the library."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

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
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")):
    _state["debug"] = debug


def not_implemented(what: str) -> None:
    console.print(f"[yellow]terra {what} is not implemented yet.[/]")
    raise typer.Exit(3)


# --------------------------------------------------------------------------------------------
@app.command(
    epilog=(
        "Examples:\n\n"
        "  terra generate --model ckpt/world_model --context-tokens ctx.npy --actions acts.npy \\\n"
        "      --frames 10 --temperature 0 --backend hf --no-decode --save-tokens out.npy"
    )
)
@friendly_errors
def generate(
    output: Optional[Path] = typer.Argument(None, help="Video to write (.mp4); not needed with --no-decode."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="World-model directory or hub id."),
    context_tokens: Optional[Path] = typer.Option(None, help="Context as tokens: int .npy of shape (frames, 576)."),
    actions: str = typer.Option(..., "--actions", "-a", help="Actions: .npy of shape (frames, 6, 3) or (frames*6, 3)."),
    frames: int = typer.Option(25, "--frames", "-n", help="Total frames, context included."),
    temperature: float = typer.Option(0.9, help="Sampling temperature; 0 is greedy."),
    top_k: int = typer.Option(0, help="Keep the k most likely codes (0: off)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1.0: off)."),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same video."),
    backend: str = typer.Option("auto", help="auto, vllm or hf."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:1 ... (auto: GPU when there is one)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    save_tokens: Optional[Path] = typer.Option(None, help="Write all frames' tokens, context included, (N, 576) int64 .npy."),
    no_decode: bool = typer.Option(False, "--no-decode", help="Stop at tokens: no image decoder, no video."),
    overwrite: bool = typer.Option(False, help="Replace existing outputs."),
):
    """Generate future frames from context frames and a trajectory."""
    import numpy as np

    from . import actions as actions_mod
    from .checkpoint import resolve_checkpoint_dir
    from .io_utils import atomic_save_npy, check_writable
    from .pipeline import generate_tokens
    from .reporting import FrameProgress
    from .world_model import InputError, Sampling, load_backend

    if not no_decode:
        not_implemented("generate with decoding (use --no-decode --save-tokens)")
    if model is None or context_tokens is None:
        raise InputError("--model and --context-tokens are needed until the embedded default and image context land")
    if save_tokens is None:
        raise InputError("--no-decode needs --save-tokens FILE.npy, or there is nothing to write")
    check_writable(save_tokens, overwrite)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    waypoints = actions_mod.resolve_actions(actions, frames=frames, speed_kmh=actions_mod.DEFAULT_SPEED_KMH)
    context = _load_context_tokens(context_tokens)
    checkpoint_dir = resolve_checkpoint_dir(model)

    started = time.perf_counter()
    world_model = load_backend(backend, checkpoint_dir, device=device, dtype=dtype)
    console.print(f"backend: [bold]{world_model.name}[/]  model: {checkpoint_dir}  ({time.perf_counter() - started:.1f} s to load)")
    generated = frames - context.shape[0]
    with FrameProgress(console, generated, world_model.config.layout.image_tokens) as progress:
        tokens = generate_tokens(world_model, context, waypoints, frames, sampling, on_frame=progress.frame_done)
    world_model.close()
    atomic_save_npy(save_tokens, tokens[0].astype(np.int64))
    elapsed = progress.elapsed
    console.print(
        f"{frames} frames ({generated} generated) in {elapsed:.1f} s, {elapsed / max(generated, 1):.2f} s/frame, "
        f"backend {world_model.name}; tokens -> {save_tokens}"
    )


def _load_context_tokens(path: Path):
    import numpy as np

    from .world_model import InputError

    if not path.is_file():
        raise InputError(f"context tokens file {path} does not exist")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} as a .npy array: {exc}") from exc
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: context tokens must be an int array (frames, 576), got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64)


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
from . import cli_actions, cli_bench, cli_tokenize  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
