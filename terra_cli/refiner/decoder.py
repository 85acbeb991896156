"""`RefinerDecoder`: tokens -> refined frames, with the interface of the frame-wise decoder
(`decode_tokens(tokens, on_batch=...)`), so the pipeline and the scenario writer take either.

Which token decoder conditions the refiner: Terra's inference.yaml names `lfq_tokenizer_B_256`
(`token_decoder_config`), and the refiner checkpoint carries a copy of a token decoder's weights,
but generate.py overwrites `video_refiner.token_decoder` after loading with the tokenizer paired
with the world model (`lfq_tokenizer_B_256` for world_model, `lfq_tokenizer_B_256_ema` for
world_model_v2). So the refiner is conditioned on the frames the run's own tokenizer decodes,
which is what this class does; the checkpoint's copy is ignored (keymap.IGNORED).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner


@dataclass(frozen=True)
class RefinerChoice:
    """What --decoder refiner asks for: the weights, the device/dtype, and whether a CPU run
    estimated at hours may go ahead."""

    spec: str
    device: str = "auto"
    dtype: str = "auto"
    allow_slow: bool = False
    options: RefinerOptions = RefinerOptions()


class RefinerDecoder:
    seeded = True  # decode_tokens takes a seed (the refiner samples noise)

    def __init__(self, refiner: VideoRefiner, tokenizer, seed: int = 0):
        self.refiner, self.tokenizer, self.seed = refiner, tokenizer, seed

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.refiner.config.height, self.refiner.config.width

    @torch.inference_mode()
    def token_frames(self, tokens) -> torch.Tensor:
        """The token decoder's frames (N, 3, 288, 512), not clamped (the refiner clamps after resizing).
        In float32 without autocast: Terra's `decode_tokens` runs with autocast disabled
        (`disable_first_stage_autocast`), where the frame-wise path decodes under bf16 autocast."""
        codes = self.tokenizer.tokens_to_codes(tokens)
        model, device = self.tokenizer.model, self.tokenizer.device
        return torch.cat([model.decode(part.to(device, torch.float32)).float()
                          for part in codes.split(self.tokenizer.batch_size)])

    def decode_tokens(self, tokens, *, seed: int | None = None, on_batch=None) -> np.ndarray:
        pixels = self.token_frames(tokens)
        return self.refiner.refine_pixels([pixels], [self.seed if seed is None else seed], on_batch)[0]

    def decode_many(self, videos: list, seeds: list[int], on_frames=None) -> list[np.ndarray]:
        """Several videos' tokens at once: their windows share UNet calls."""
        return self.refiner.refine_pixels([self.token_frames(t) for t in videos], seeds, on_frames)

    def stage(self, fps: float):
        """A `refiner.stage.RefineStage` that gives each submitted video's mp4 bytes (scenario runs)."""
        from terra_cli.media.frames import video_bytes
        from terra_cli.refiner.stage import RefineStage

        return RefineStage(self, finish=lambda frames: video_bytes(list(frames), fps=fps))


DECODERS = ("frames", "refiner")


def refiner_options(decoder: str, windows: int | None, compile: str, dtype: str,
                    frames: int | None = None) -> RefinerOptions:
    """--refiner-windows, --refiner-compile and --refiner-dtype as a command gives them (checked by
    `refiner_choice`). Windows per call by default: `windows_per_call` for the refiner, given the one
    video's `frames` when only one is refined."""
    from terra_cli.refiner.refiner import windows_per_call

    if windows is None and decoder.strip().lower() == "refiner":
        windows = windows_per_call(None, frames)
    return RefinerOptions(batch_windows=windows or 1, compile=compile.strip().lower(), dtype=dtype.strip().lower())


def refiner_choice(decoder: str, refiner: str | None, model: str | None, device: str = "auto", dtype: str = "auto",
                   allow_slow: bool = False, options: RefinerOptions = RefinerOptions(),
                   flag: str = "--refiner") -> RefinerChoice | None:
    """--decoder / --refiner as the CLI gives them -> a RefinerChoice (None for the frame-wise decoder).
    Without --refiner, a --model that is turing-motors/Terra (or a local snapshot of it) brings its own.
    `options` (--refiner-compile, --refiner-windows, --refiner-dtype) are checked here, before anything loads.
    `flag`: what the command calls --refiner (`terra bench`, whose --refiner is a measure: --refiner-weights)."""
    from pathlib import Path

    from terra_cli.errors import InputError
    from terra_cli.models.checkpoint import TERRA_HUB_ID
    from terra_cli.refiner.checkpoint import REFINER_FILE, REFINER_SUBFOLDER

    from terra_cli.refiner.compiled import check_compile_mode
    from terra_cli.refiner.fp8 import check_refiner_dtype

    check_compile_mode(options.compile)
    check_refiner_dtype(options.dtype)
    if options.batch_windows < 1:
        raise InputError(f"--refiner-windows must be at least 1, got {options.batch_windows}")
    decoder = decoder.strip().lower()
    if decoder not in DECODERS:
        raise InputError(f"--decoder must be frames or refiner, got {decoder!r}")
    if decoder == "frames":
        if refiner is not None:
            raise InputError(f"{flag} works with --decoder refiner")
        if options.dtype != RefinerOptions().dtype:
            raise InputError("--refiner-dtype works with --decoder refiner")
        if options != RefinerOptions():
            raise InputError("--refiner-compile and --refiner-windows work with --decoder refiner")
        return None
    if refiner is None and model is not None:
        if model.strip("/") == TERRA_HUB_ID or (Path(model).expanduser() / REFINER_SUBFOLDER).is_dir():
            refiner = model
    if refiner is None:
        raise InputError(f"--decoder refiner has no weights: pass {flag} PATH_OR_HUB_ID (Terra's is "
                         f"{TERRA_HUB_ID}, file {REFINER_SUBFOLDER}/{REFINER_FILE})")
    return RefinerChoice(refiner, device, dtype, allow_slow, options)


def load_refiner(choice: RefinerChoice, frame_counts: list[int]) -> VideoRefiner:
    """Check and load the refiner before any world model runs: frames enough for a window, the
    weights strictly, and on a CPU the time it would take. Weights stay on the CPU until
    `VideoRefiner.to(device)` (a world model may still need the GPU)."""
    from terra_cli.refiner.cost import check_cpu_time
    from terra_cli.refiner.windows import check_frames
    from terra_cli.runtime import resolve_device, resolve_dtype_name

    for frames in frame_counts:
        check_frames(frames)  # Terra's 25-frame window, before reading gigabytes of weights
    device = resolve_device(choice.device)
    if choice.options.dtype == "fp8":
        from terra_cli.refiner.fp8 import check_fp8_device

        check_fp8_device(device)
    refiner = VideoRefiner.from_checkpoint(choice.spec, device="cpu", dtype=resolve_dtype_name(choice.dtype, device),
                                           options=choice.options)
    for frames in frame_counts:
        check_frames(frames, refiner.config.window)
    check_cpu_time(refiner.config, frame_counts, device, choice.allow_slow)
    refiner.target_device = device
    return refiner


def engine_refiner(choice: RefinerChoice, frame_counts: list[int], tokenizer, engine_options: dict) -> RefinerDecoder:
    """The refiner of a scenario engine (one engine, or one Ray actor), loaded before the engine,
    which then leaves it room on the GPU (`gpu_share` in `engine_options`)."""
    refiner = load_refiner(choice, frame_counts)
    if refiner.target_device.startswith("cuda"):
        engine_options.setdefault("gpu_share", vllm_memory_share(refiner.target_device))
    return RefinerDecoder(refiner, tokenizer)


# GPU memory the refiner keeps beside vLLM in `--scenarios`: bf16 UNet (3.0 GB), VAE, and one
# window's activations; sized from `terra bench --refiner`'s peak with room to spare.
REFINER_GPU_RESERVE_BYTES = 16 * 2 ** 30


def vllm_memory_share(device: str) -> float:
    """vLLM's gpu_memory_utilization when the refiner shares the GPU: what is left after the
    refiner's reserve (and 2% slack), at most vLLM's usual 0.85."""
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return round(max(0.3, min(0.85, 1.0 - REFINER_GPU_RESERVE_BYTES / total - 0.02)), 3)
