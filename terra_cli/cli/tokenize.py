"""`terra tokenize`: frames -> (N, 576) int64 tokens with Terra's LFQ image tokenizer, optionally decoded back."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from pathlib import Path
from typing import Optional

import typer

from terra_cli.cli import options as opts
from terra_cli.cli.app import app, console, friendly_errors, out
from terra_cli.errors import TerraError

class TokenizeInputError(TerraError):
    """Options of `terra tokenize` that do not fit together."""


@app.command(
    epilog=(
        "Examples:\n\n"
        "  terra tokenize clip.mp4 --out tokens.npy --tokenizer turing-motors/Terra/lfq_tokenizer_B_256\n\n"
        "  terra tokenize frames/ --out tokens.npy --reconstruct recon/ --tokenizer ckpt/lfq_tokenizer_B_256 --device cpu\n\n"
        "Docs: docs/models.md"
    )
)
@friendly_errors
def tokenize(
    input: Path = typer.Argument(..., metavar="INPUT", help="A folder of images (natural order: frame2 before frame10), one image, or a video (mp4/avi/mov/webm/gif)."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Tokens to write: int64 .npy of shape (frames, 576)."),
    reconstruct: Optional[Path] = typer.Option(None, "--reconstruct", "-r", help="Decode the tokens again, write the frames as PNGs frame_NNNN.png into this folder and print per-frame PSNR (made whole when new; with --overwrite an existing folder's frame files are replaced and its other files left alone)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", "-t", help="Tokenizer directory (config.json + model.safetensors) or hub id, e.g. turing-motors/Terra/lfq_tokenizer_B_256."),
    device: str = opts.device_option(),
    batch_size: int = typer.Option(8, "--batch-size", "-b", min=1, help="Frames per forward pass; bounds memory use."),
    max_frames: Optional[int] = typer.Option(None, "--max-frames", min=1, help="Read at most this many frames."),
    overwrite: bool = opts.overwrite_option(),
):
    """Turn frames into Terra's image tokens (18 x 32 = 576 per frame), and optionally back into frames."""
    import numpy as np

    from tokenizer_decoder import ImageTokenizer, psnr

    from terra_cli.cli.progress import StepProgress
    from terra_cli.errors import OutputError
    from terra_cli.media.atomic import atomic_directory, atomic_save_npy
    from terra_cli.media.frames import count_frames, iter_frames, write_frames
    from terra_cli.pipeline.outputs import OutputPlan

    if out_path.suffix.lower() != ".npy":
        raise OutputError(f"--out {out_path} must end in .npy (the tokens, int64 (frames, 576))")
    plan = OutputPlan(overwrite)
    plan.input("INPUT", input)
    plan.input("--tokenizer", Path(tokenizer) if tokenizer and os.path.lexists(tokenizer) else None)
    plan.file("--out", out_path)
    if reconstruct is not None:
        plan.folder("--reconstruct", reconstruct)

    # Read the first frame before loading the model: a bad input fails in a moment, not after the load.
    frames = iter_frames(input, max_frames)
    first = next(frames)
    total = count_frames(input, max_frames)

    from terra_cli.models.resolve import resolve_model
    from terra_cli.runtime import resolve_device

    device = resolve_device(device)
    spec = resolve_model(None, tokenizer=tokenizer).tokenizer  # the embedded terra-mini tokenizer by default
    started = time.perf_counter()
    tok = ImageTokenizer.from_pretrained(spec.source, spec.subfolder, device=device, batch_size=batch_size)
    console.print(
        f"tokenizer: {tok.source}  ({tok.num_parameters() / 1e6:.1f}M parameters, {tok.device}, "
        f"{time.perf_counter() - started:.1f} s to load)",
        highlight=False,
        soft_wrap=True,
    )

    token_chunks: list[np.ndarray] = []
    scores: list[float] = []
    done = 0
    started = time.perf_counter()
    # Frames are decoded into a folder beside --reconstruct and placed only once every frame and
    # the tokens are written: a failure or Ctrl-C leaves the folder as it was (or none).
    frames_folder = atomic_directory(reconstruct, overwrite) if reconstruct is not None else contextlib.nullcontext()
    with frames_folder as partial_dir, StepProgress(console, "tokenizing", total) as progress:
        stream = itertools.chain([first], frames)
        while batch := list(itertools.islice(stream, batch_size)):
            tokens = tok.tokenize(batch)
            token_chunks.append(tokens)
            if partial_dir is not None:
                decoded = tok.decode_tokens(tokens)
                originals = tok.resize_frames(batch)
                scores.extend(psnr(a, b) for a, b in zip(originals, decoded))
                write_frames(partial_dir, decoded, start=done)
            done += len(batch)
            progress.advance(len(batch))
        elapsed = time.perf_counter() - started
        all_tokens = np.concatenate(token_chunks).astype(np.int64)
        atomic_save_npy(out_path, all_tokens, overwrite=overwrite)
    if scores:
        _print_psnr_table(scores)
    console.print(
        f"{done} frame(s) -> tokens {tuple(all_tokens.shape)} int64 in {elapsed:.1f} s "
        f"({done / max(elapsed, 1e-9):.1f} frames/s); tokens -> {out_path}"
        + (f"; frames -> {reconstruct}" if reconstruct is not None else ""),
        highlight=False,
        soft_wrap=True,
    )


def _print_psnr_table(scores: list[float]) -> None:
    from rich.table import Table

    from terra_cli.media.frames import frame_filename

    table = Table(title="reconstruction PSNR", title_justify="left")
    table.add_column("frame", justify="right")
    table.add_column("file")
    table.add_column("PSNR (dB)", justify="right")
    for i, value in enumerate(scores):
        table.add_row(str(i), frame_filename(i), _fmt(value))
    finite = [s for s in scores if math.isfinite(s)]
    mean = sum(finite) / len(finite) if finite else float("inf")
    table.add_section()
    table.add_row("mean", "", _fmt(mean))
    out.print(table)


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"
