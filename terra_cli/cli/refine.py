"""`terra refine TOKENS.npy OUT.mp4` (refine saved tokens with Terra's video refiner) and
`terra refine convert --trust-checkpoint SRC DST.safetensors` (the one-time pickle conversion)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from terra_cli.cli import options as opts
from terra_cli.cli.app import _state, app, console, friendly_errors, say
from terra_cli.errors import InputError


class _VideoByDefault(TyperGroup):
    """`terra refine TOKENS OUT` means `terra refine video TOKENS OUT`; `convert` is the other command."""

    def parse_args(self, ctx, args):
        # Options may come first (`terra refine --refiner R TOKENS OUT`): only a command name or the
        # group's own --help keep their place.
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["video", *args]
        return super().parse_args(ctx, args)


refine_app = typer.Typer(cls=_VideoByDefault, no_args_is_help=True, help=(
    "Refine saved tokens with Terra's video refiner (terra refine TOKENS.npy OUT.mp4), or convert its "
    "checkpoint once (terra refine convert)."), epilog=(
    "Examples:\n\n"
    "  terra refine tokens.npy refined.mp4 --model turing-motors/Terra\n\n"
    "  terra refine convert --trust-checkpoint refiner_model.pt refiner.safetensors\n\n"
    "Docs: docs/refiner.md"))
app.add_typer(refine_app, name="refine")


@refine_app.command(
    "video",
    epilog=(
        "Examples:\n\n"
        "  terra generate --model turing-motors/Terra --context frames/ --actions left --frames 47 \\\n"
        "      --no-decode --save-tokens tokens.npy        # stage 1: tokens\n\n"
        "  terra refine tokens.npy out.mp4 --model turing-motors/Terra      # stage 2: refined video (GPU)\n\n"
        "  terra refine tokens.npy out.mp4 --refiner refiner_model.safetensors --tokenizer DIR\n\n"
        "Docs: docs/refiner.md"
    ),
)
@friendly_errors
def refine_video(
    tokens: Path = typer.Argument(..., metavar="TOKENS.npy", help="All frames' tokens (N, 576) int, context included, as --save-tokens writes them (N >= 25)."),
    output: Path = typer.Argument(..., metavar="OUT.mp4", help="Video to write (H.264, 10 fps, 640x384)."),
    refiner: Optional[str] = typer.Option(None, "--refiner", help="The refiner's weights: .pt/.safetensors, a folder or a hub id (default: from --model turing-motors/Terra)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="turing-motors/Terra or a local snapshot: its refiner and the tokenizer paired with --variant."),
    variant: str = typer.Option("world_model", help="world_model or world_model_v2: which paired tokenizer decodes the tokens the refiner is conditioned on."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", "-t", help="Image tokenizer directory or hub id (overrides the one paired with --model; default: terra-mini's)."),
    seed: int = typer.Option(0, help="Random seed of the refiner's noise; the same seed gives the same video."),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option("The refiner's dtype (--refiner-dtype fp8 adds its UNet's fp8 matmuls)"),
    allow_slow: bool = typer.Option(False, "--allow-slow", help="On a CPU: run even when it is estimated to take over an hour."),
    refiner_compile: str = opts.refiner_compile_option(),
    refiner_windows: Optional[int] = opts.refiner_windows_option(),
    refiner_dtype: str = opts.refiner_dtype_option(),
    overwrite: bool = opts.overwrite_option(),
):
    """Refine saved tokens into a video with Terra's video refiner."""
    import numpy as np

    from terra_cli.media.frames import write_video
    from terra_cli.models.resolve import PAIRED_TOKENIZER, load_tokenizer, resolve_model, split_tokenizer_spec
    from terra_cli.pipeline.inputs import load_context_tokens
    from terra_cli.pipeline.outputs import check_outputs
    from terra_cli.refiner.decoder import RefinerDecoder, load_refiner, refiner_choice, refiner_options
    from terra_cli.runtime import resolve_device

    given = [("TOKENS", tokens), *((label, Path(path)) for label, path in
                                    (("--model", model), ("--tokenizer", tokenizer), ("--refiner", refiner))
                                    if path and os.path.lexists(path))]
    outputs = check_outputs(output, None, None, no_decode=False, overwrite=overwrite, inputs=given)
    ids = load_context_tokens(tokens, None)
    choice = refiner_choice("refiner", refiner, model, device, dtype, allow_slow,
                            refiner_options("refiner", refiner_windows, refiner_compile, refiner_dtype, len(ids)))
    if variant not in PAIRED_TOKENIZER:
        raise InputError(f"--variant must be one of {', '.join(PAIRED_TOKENIZER)}, got {variant!r}")
    # Only the tokenizer is needed here, not the world model --model names.
    spec = (split_tokenizer_spec(tokenizer or model, PAIRED_TOKENIZER[variant]) if (tokenizer or model)
            else resolve_model(None).tokenizer)
    started = time.perf_counter()
    video_refiner = load_refiner(choice, [ids.shape[0]])
    codes = load_tokenizer(spec, resolve_device(device))
    if ids.shape[1] != codes.tokens_per_frame or int(ids.max(initial=0)) >= codes.codebook_size or int(ids.min(initial=0)) < 0:
        raise InputError(f"{tokens}: tokens of shape {ids.shape} with codes up to {int(ids.max(initial=0))} do not fit "
                         f"the tokenizer {codes.source} ({codes.tokens_per_frame} per frame, {codes.codebook_size} codes)")
    say(f"refiner: {video_refiner.source}; tokenizer: {codes.source} ({time.perf_counter() - started:.1f} s to load)")
    decoder = RefinerDecoder(video_refiner.to(video_refiner.target_device), codes, seed)
    from terra_cli.cli.progress import StepProgress
    from terra_cli.refiner.windows import count_windows

    windows = count_windows(ids.shape[0], video_refiner.config.window, video_refiner.config.min_overlap)
    video_refiner.prepare()  # a compiled UNet compiles here (its time is logged), not inside the refining time
    refining = time.perf_counter()
    with StepProgress(console, "refining", ids.shape[0]) as progress:
        frames = decoder.decode_many([np.asarray(ids)], [seed], on_frames=progress.advance)[0]
    seconds = time.perf_counter() - refining
    write_video(outputs.video, list(frames), fps=10, overwrite=overwrite)
    say(f"{frames.shape[0]} frames ({windows} window(s) of {video_refiner.config.window}) refined in {seconds:.1f} s; "
        f"video -> {output} ({frames.shape[2]}x{frames.shape[1]}); {time.perf_counter() - _state['started']:.1f} s in all")


@refine_app.command(
    "convert",
    epilog=("Example:\n\n  terra refine convert --trust-checkpoint refiner_model.pt refiner_model.safetensors\n\n"
            "Docs: docs/refiner.md"),
)
@friendly_errors
def refine_convert(
    source: Path = typer.Argument(..., metavar="SRC", help="Terra's refiner_model.pt (a torch.save pickle)."),
    destination: Path = typer.Argument(..., metavar="DST.safetensors", help="Where to write its tensors as safetensors."),
    trust_checkpoint: bool = typer.Option(False, "--trust-checkpoint", help="Run the file's pickle code to read it: only for a file you trust (e.g. from turing-motors/Terra)."),
    overwrite: bool = opts.overwrite_option(),
):
    """Convert the refiner's .pt once to safetensors (needs --trust-checkpoint: reading a pickle runs its code)."""
    from terra_cli.media.atomic import check_writable
    from terra_cli.refiner.checkpoint import convert_checkpoint

    if not source.is_file():
        raise InputError(f"{source} is not a file")
    check_writable(destination, overwrite)
    count = convert_checkpoint(source, destination, trust=trust_checkpoint, overwrite=overwrite)
    say(f"{count} tensors -> {destination}; pass it to --refiner")
