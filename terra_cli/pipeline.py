"""The generation pipeline as plain functions: encode -> generate per frame -> decode -> write.

The token part (rounds of frames through a backend) comes first; then the steps `terra generate`
runs around it: output checks, model choice, context reading, and a recorder of finished frames.
Media and the image tokenizer come in through `media.py` and `tokenizer_decoder`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import TerraError
from .io_utils import unwritable_ancestor
from .world_model import FrameCallback, InputError, Sampling, WorldModelBackend

# Terra's long-video schedule: each new round re-seeds with this many frames of the last one.
RESEED_FRAMES = 3
MAX_TOTAL_FRAMES = 100


@dataclass(frozen=True)
class Round:
    first_frame: int  # global index of the round's first (context) frame
    context_frames: int
    num_frames: int  # context included

    @property
    def end(self) -> int:
        return self.first_frame + self.num_frames


def plan_rounds(context_frames: int, total_frames: int, frames_per_round: int) -> list[Round]:
    """Rounds of at most `frames_per_round` frames; temporal positions restart every round."""
    if total_frames > MAX_TOTAL_FRAMES:
        raise InputError(f"--frames {total_frames} is above the supported maximum of {MAX_TOTAL_FRAMES}")
    if total_frames <= context_frames:
        raise InputError(f"--frames ({total_frames}) must be more than the {context_frames} context frame(s)")
    if context_frames >= frames_per_round:
        raise InputError(f"{context_frames} context frames leave no room in a {frames_per_round}-frame round")
    rounds = [Round(0, context_frames, min(total_frames, frames_per_round))]
    reseed = min(RESEED_FRAMES, frames_per_round - 1)
    while rounds[-1].end < total_frames:
        start = rounds[-1].end - reseed
        rounds.append(Round(start, reseed, min(total_frames - start, frames_per_round)))
    return rounds


def generate_tokens(
    backend: WorldModelBackend,
    context_tokens: np.ndarray,
    action_waypoints: np.ndarray,
    total_frames: int,
    sampling: Sampling,
    on_frame: FrameCallback | None = None,
) -> np.ndarray:
    """All frames' tokens (R, total_frames, T), context included, over as many rounds as needed.

    `context_tokens` (R, K, T) or (K, T); `action_waypoints` (R, F, A, 3) or (F, A, 3) with
    F >= total_frames - 1, indexed by global frame number.
    """
    layout = backend.config.layout
    context = np.asarray(context_tokens)
    if context.ndim == 2:
        context = context[None]
    actions = np.asarray(action_waypoints, dtype=np.float32)
    if actions.ndim == 3:
        actions = actions[None]
    if actions.ndim == 4 and actions.shape[1] < total_frames - 1:
        raise InputError(
            f"{total_frames} frames need actions for at least {total_frames - 1} frames "
            f"(the last frame's is never used), got {actions.shape[1]}"
        )
    rollouts = max(context.shape[0], actions.shape[0] if actions.ndim == 4 else 1)
    frames = np.zeros((rollouts, total_frames, layout.image_tokens), dtype=np.int64)
    k = context.shape[1]
    frames[:, :k] = context
    for round_index, rnd in enumerate(plan_rounds(k, total_frames, layout.max_frames)):
        round_context = frames[:, rnd.first_frame : rnd.first_frame + rnd.context_frames] if rnd.first_frame else context
        round_actions = actions[:, rnd.first_frame : rnd.end - 1] if actions.ndim == 4 else actions

        def forward_frame(local_index: int, tokens: np.ndarray, _offset=rnd.first_frame) -> None:
            if on_frame is not None:
                on_frame(_offset + local_index, tokens)

        # A fresh random stream per round, still fully determined by --seed.
        round_sampling = replace(sampling, seed=sampling.seed + 100_003 * round_index)
        out = backend.generate(round_context, round_actions, rnd.num_frames, round_sampling, on_frame=forward_frame)
        frames[:, rnd.first_frame : rnd.end] = out
    return frames


# ---------------------------------------------------------------------------------------------
# The end-to-end pipeline: outputs -> model choice -> context -> generate -> decode -> write.
# Every step is a plain function; the CLI parses options, calls these in order and reports.

DEFAULT_CONTEXT_FRAMES = 3
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".m4v")
VARIANTS = ("world_model", "world_model_v2")
# Terra's released checkpoints pair each world model with the tokenizer it was trained on.
PAIRED_TOKENIZER = {"world_model": "lfq_tokenizer_B_256", "world_model_v2": "lfq_tokenizer_B_256_ema"}


class GenerateOptionError(TerraError):
    """Options of `terra generate` that do not fit together, or outputs that cannot be written."""


@dataclass(frozen=True)
class Outputs:
    video: Path | None
    frames_dir: Path | None
    tokens: Path | None
    overwrite: bool

    @property
    def decode(self) -> bool:
        return self.video is not None or self.frames_dir is not None


def check_outputs(video: Path | None, frames_dir: Path | None, tokens: Path | None, *, no_decode: bool, overwrite: bool) -> Outputs:
    """Validate every output before anything is loaded: what to write, and that it may be written."""
    from .io_utils import check_writable

    if no_decode:
        if video is not None:
            raise GenerateOptionError(f"--no-decode writes no video: drop OUTPUT ({video}) or --no-decode")
        if frames_dir is not None:
            raise GenerateOptionError("--no-decode writes no frames: drop --save-frames or --no-decode")
        if tokens is None:
            raise GenerateOptionError("--no-decode needs --save-tokens FILE.npy, or there is nothing to write")
    elif video is None:
        raise GenerateOptionError("no OUTPUT video given: pass OUTPUT.mp4 (or --no-decode --save-tokens FILE.npy)")
    if video is not None:
        if video.suffix.lower() not in VIDEO_SUFFIXES:
            raise GenerateOptionError(f"OUTPUT {video} must end in {', '.join(VIDEO_SUFFIXES)} (an H.264 video)")
        if video.is_dir():
            raise GenerateOptionError(f"OUTPUT {video} is a directory; give a video file name such as out.mp4")
        check_writable(video, overwrite)
    if tokens is not None:
        if tokens.suffix.lower() != ".npy":
            raise GenerateOptionError(f"--save-tokens {tokens} must end in .npy")
        if tokens.is_dir():
            raise GenerateOptionError(f"--save-tokens {tokens} is a directory; give a file name such as tokens.npy")
        check_writable(tokens, overwrite)
    if frames_dir is not None:
        check_frames_dir(frames_dir, overwrite)
    paths = [p.resolve() for p in (video, frames_dir, tokens) if p is not None]
    if len(set(paths)) != len(paths):
        raise GenerateOptionError("OUTPUT, --save-frames and --save-tokens must be different paths")
    return Outputs(video, frames_dir, tokens, overwrite)


def check_frames_dir(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise GenerateOptionError(f"--save-frames {directory} is a file; pass a folder for the PNG frames")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise GenerateOptionError(f"--save-frames {directory} is not empty; pass --overwrite to write into it")
    blocker = unwritable_ancestor(directory)
    if blocker is not None:
        raise GenerateOptionError(f"cannot write frames into {directory}: {blocker} is not writable")


# -- which model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelChoice:
    world_model_dir: Path
    tokenizer: tuple[str, str | None] | None  # (dir or hub id, subfolder), None when there is none
    label: str
    is_default: bool


def resolve_model(model: str | None, variant: str, tokenizer: str | None) -> ModelChoice:
    """The world-model directory and its tokenizer: the embedded default, a local dir or a hub id."""
    from .checkpoint import TERRA_HUB_ID, looks_like_hub_id, resolve_checkpoint_dir
    from .default_model import DEFAULT_MODEL_LABEL, default_tokenizer_dir, default_world_model_dir

    if variant not in VARIANTS:
        raise GenerateOptionError(f"--variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    tok_override = split_tokenizer_spec(tokenizer, PAIRED_TOKENIZER[variant]) if tokenizer is not None else None
    if model is None:
        return ModelChoice(
            default_world_model_dir(), tok_override or (str(default_tokenizer_dir()), None), DEFAULT_MODEL_LABEL, True
        )
    path = Path(model).expanduser()
    if path.exists() or not looks_like_hub_id(model):
        world_dir = resolve_checkpoint_dir(model, variant)
        paired = None
        # A local snapshot of turing-motors/Terra: DIR/world_model(_v2) next to DIR/lfq_tokenizer_*.
        if world_dir.resolve() != path.resolve():
            candidate = path / PAIRED_TOKENIZER[variant]
            if (candidate / "config.json").is_file():
                paired = (str(candidate), None)
        return ModelChoice(world_dir, tok_override or paired, str(world_dir), False)
    if model.strip("/") == TERRA_HUB_ID:
        world_dir = resolve_checkpoint_dir(TERRA_HUB_ID, variant)
        paired = (TERRA_HUB_ID, PAIRED_TOKENIZER[variant])
        return ModelChoice(world_dir, tok_override or paired, f"{TERRA_HUB_ID}/{variant}", False)
    repo, sub = _split_hub(model)
    world_dir = resolve_checkpoint_dir(repo, sub)
    return ModelChoice(world_dir, tok_override, model, False)


def _split_hub(spec: str) -> tuple[str, str | None]:
    parts = spec.strip("/").split("/")
    return "/".join(parts[:2]), ("/".join(parts[2:]) or None)


def split_tokenizer_spec(spec: str, terra_subfolder: str) -> tuple[str, str | None]:
    """--tokenizer: a local dir (DIR/<terra_subfolder> is tried first, then DIR) or `owner/name[/subfolder]`."""
    from .checkpoint import TERRA_HUB_ID

    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return spec, terra_subfolder
    repo, sub = _split_hub(spec)
    if sub is None and repo == TERRA_HUB_ID:
        sub = terra_subfolder
    return repo, sub


def load_tokenizer(choice: ModelChoice, device: str):
    from tokenizer_decoder import ImageTokenizer

    spec, subfolder = choice.tokenizer
    return ImageTokenizer.from_pretrained(spec, subfolder, device=device)


def check_tokenizer_matches(tokenizer, config) -> None:
    layout = config.layout
    if tokenizer.codebook_size != layout.image_vocab_size:
        raise GenerateOptionError(
            f"tokenizer {tokenizer.source} has {tokenizer.codebook_size} codes but the world model expects "
            f"{layout.image_vocab_size} (vocab_size - 1); pass the tokenizer it was trained with (--tokenizer)"
        )
    if tokenizer.tokens_per_frame != layout.image_tokens:
        raise GenerateOptionError(
            f"tokenizer {tokenizer.source} makes {tokenizer.tokens_per_frame} tokens per frame but the world model "
            f"expects {layout.image_tokens}"
        )


# -- context -----------------------------------------------------------------------------------
def read_context_frames(sources: Sequence[Path], count: int | None) -> list[np.ndarray]:
    """The LAST `count` frames (the most recent) of the given images / folders / videos, in order.

    Several sources are read one after the other, as one sequence. `count` None: up to
    DEFAULT_CONTEXT_FRAMES, fewer when fewer are given. An explicit `count` needs that many.
    """
    from .media import MediaError, iter_frames

    keep = count if count is not None else DEFAULT_CONTEXT_FRAMES
    recent: deque = deque(maxlen=keep)
    for source in sources:
        source = Path(source)
        if not source.exists():
            raise MediaError(f"context {source} does not exist")
        recent.extend(iter_frames(source))  # streams: a long video is never held whole
    if count is not None and len(recent) < count:
        raise MediaError(f"--context-frames {count} asks for {count} frames, but --context gave only {len(recent)}")
    return list(recent)


def load_context_tokens(path: Path, count: int | None) -> np.ndarray:
    """int (K, T) tokens from a .npy; with `count`, the last `count` rows."""
    if not path.is_file():
        raise InputError(f"context tokens file {path} does not exist")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} as a .npy array: {exc}") from exc
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: context tokens must be an int array (frames, 576), got {arr.dtype} {arr.shape}")
    if count is not None:
        if arr.shape[0] < count:
            raise InputError(f"--context-frames {count} asks for {count} frames, but {path} holds {arr.shape[0]}")
        arr = arr[arr.shape[0] - count :]
    return arr.astype(np.int64)


def check_actions_cover(actions: np.ndarray, total_frames: int) -> None:
    """Before any model loads: the actions must reach frame total_frames - 2 (the last frame's is unused)."""
    if actions.shape[0] < total_frames - 1:
        raise InputError(
            f"{total_frames} frames need actions for at least {total_frames - 1} frames "
            f"(the last frame's is never used), got {actions.shape[0]}"
        )


def check_frame_count(total_frames: int, context_frames: int | None = None) -> None:
    if total_frames > MAX_TOTAL_FRAMES:
        raise InputError(f"--frames {total_frames} is above the supported maximum of {MAX_TOTAL_FRAMES}")
    if total_frames < 2:
        raise InputError(f"--frames must be at least 2 (context + one generated frame), got {total_frames}")
    if context_frames is not None and total_frames <= context_frames:
        raise InputError(f"--frames ({total_frames}) must be more than the {context_frames} context frame(s)")


# -- generation with a record of what is done --------------------------------------------------
class TokenRecorder:
    """Keeps the context and every finished frame, so an interrupted run can still save them."""

    def __init__(self, context: np.ndarray, total_frames: int, on_frame: FrameCallback | None = None):
        self.tokens = np.zeros((total_frames, context.shape[1]), dtype=np.int64)
        self.tokens[: context.shape[0]] = context
        self.done = context.shape[0]
        self.on_frame = on_frame

    def frame_done(self, index: int, frame_tokens: np.ndarray) -> None:
        self.tokens[index] = np.asarray(frame_tokens)[0]
        self.done = max(self.done, index + 1)
        if self.on_frame is not None:
            self.on_frame(index, frame_tokens)

    def finished(self) -> np.ndarray:
        """(n, T) int64: the context and the frames finished so far."""
        return self.tokens[: self.done].copy()


# Small decoders on the CPU: one token at a time is a chain of tiny matmuls, where a second
# intra-op thread only adds synchronisation, and on a busy machine (a descheduled OpenMP worker)
# it costs 10-20x (measured: terra-mini 111 tok/s on 1 thread vs 6 tok/s on 2 under load).
SMALL_DECODER_HIDDEN = 1024


def generation_threads(requested: int, config, backend_name: str, device: str) -> int | None:
    """CPU threads for the token loop: `requested` when > 0; auto (0) -> 1 for a small model on the
    CPU with the hf backend, else None (leave torch's default)."""
    if requested < 0:
        raise GenerateOptionError(f"--threads must be >= 0 (0: auto), got {requested}")
    if requested:
        return requested
    on_cpu = device == "cpu" or (device == "auto" and not _cuda_available())
    if backend_name == "hf" and on_cpu and config.hidden_size <= SMALL_DECODER_HIDDEN:
        return 1
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
