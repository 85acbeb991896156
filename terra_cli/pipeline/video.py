"""`generate_video`: the one library entry point from context and actions to written files.

encode context -> generate tokens round by round -> decode frames -> write outputs, on a loaded
`WorldModel` (pipeline/world_model.py) that the caller may keep for many videos. `terra generate`
calls it; the CLI only parses options and reports through an `Observer`. Everything that can be checked without a model is checked in `VideoRequest.check`
before anything loads.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError
from terra_cli.models.resolve import ModelChoice
from terra_cli.pipeline import inputs
from terra_cli.pipeline.outputs import Outputs
from terra_cli.pipeline.rounds import RESEED_FRAMES, generate_tokens, plan_rounds
from terra_cli.pipeline.world_model import Engine, WorldModel, load_world_model

VIDEO_FPS = 10  # Terra's frame rate


class Observer:
    """What `generate_video` reports while it works. This base reports nothing; the CLI prints
    messages and draws progress bars."""

    def message(self, text: str) -> None:
        pass

    def startup(self, phases: dict) -> None:
        """The engine's start-up in phases (vLLM backend only; see backends/vllm_startup.py)."""

    def timing(self, what: str, seconds: float) -> None:
        """How long a step outside generation took (config, engine shutdown, writing)."""

    @contextlib.contextmanager
    def steps(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """Encoding / decoding: yields advance(n_frames)."""
        yield lambda n: None

    @contextlib.contextmanager
    def frames(self, total: int, tokens_per_frame: int) -> Iterator[Callable[[int, np.ndarray], None]]:
        """Generation: yields frame_done(index, tokens) for each generated frame."""
        yield lambda index, tokens: None


class TokenBuffer:
    """The one array of a video's tokens (frames, T): context first, then each finished frame.

    The caller makes it and keeps it, so an interrupted run can save what is finished without
    another copy of the frames.
    """

    def __init__(self) -> None:
        self.tokens: np.ndarray | None = None
        self.done = 0

    def start(self, context: np.ndarray, total_frames: int) -> None:
        self.tokens = np.zeros((total_frames, context.shape[1]), dtype=np.int64)
        self.tokens[: context.shape[0]] = context
        self.done = context.shape[0]

    def frame_done(self, index: int, frame_tokens: np.ndarray) -> None:
        self.tokens[index] = np.asarray(frame_tokens).reshape(-1, self.tokens.shape[1])[0]
        self.done = max(self.done, index + 1)

    def finished(self) -> np.ndarray:
        """(n, T) int64 view: the context and the frames finished so far."""
        return np.zeros((0, 0), np.int64) if self.tokens is None else self.tokens[: self.done]


@dataclass(frozen=True)
class VideoRequest:
    """One video: context (images, tokens, or the embedded sample road when neither), per-frame
    action waypoints (frames, 6, 3), how many frames in all, sampling, and where to write."""

    actions: np.ndarray
    frames: int
    outputs: Outputs
    sampling: Sampling = field(default_factory=Sampling)
    context_images: list[np.ndarray] | None = None
    context_tokens: np.ndarray | None = None
    context_frames: int | None = None  # for the embedded sample road: how many frames of it
    context_label: str = ""

    def check(self) -> None:
        if self.context_images is not None and self.context_tokens is not None:
            raise InputError("give context images or context tokens, not both")
        inputs.check_frame_count(self.frames, self.context_count)
        inputs.check_actions_cover(self.actions, self.frames)
        if not np.isfinite(np.asarray(self.actions, dtype=np.float64)).all():
            raise InputError("actions contain NaN or inf")

    @property
    def context_count(self) -> int:
        if self.context_tokens is not None:
            return int(self.context_tokens.shape[0])
        if self.context_images is not None:
            return len(self.context_images)
        # The embedded road is rendered to any length, so its count is known before any model loads.
        return self.context_frames or inputs.DEFAULT_CONTEXT_FRAMES


@dataclass
class VideoResult:
    tokens: np.ndarray  # (frames, T) int64, context included
    context_frames: int
    rounds: int
    generation_seconds: float
    backend: str
    written: list[str]

    @property
    def generated_frames(self) -> int:
        return self.tokens.shape[0] - self.context_frames

    @property
    def seconds_per_frame(self) -> float:
        return self.generation_seconds / max(self.generated_frames, 1)


def generate_video(
    request: VideoRequest,
    model: ModelChoice,
    engine: Engine = Engine(),
    *,
    world: WorldModel | None = None,
    buffer: TokenBuffer | None = None,
    observer: Observer | None = None,
    refiner=None,
) -> VideoResult:
    """Run one video end to end and write its outputs atomically. Raises TerraError subclasses
    for anything the user can fix; KeyboardInterrupt leaves `buffer` holding the finished frames.

    `world`: a loaded world model (pipeline/world_model.py) to run on and leave open; without it,
    one is loaded for this video and closed after it. `refiner` (a `refiner.decoder.RefinerChoice`):
    decode with Terra's video refiner instead of frame by frame; it is checked and loaded before
    the world model runs."""
    from dataclasses import replace

    from terra_cli.backends.base import weights_note
    from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name
    from terra_cli.models.checkpoint import load_config
    from terra_cli.runtime import generation_threads, resolve_device, resolve_dtype_name

    observer = observer or Observer()
    buffer = buffer if buffer is not None else TokenBuffer()
    request.check()
    outputs = request.outputs
    device = resolve_device(engine.device)
    resolve_dtype_name(engine.dtype, device)  # a bad --dtype fails before anything loads
    backend_name = resolve_backend_name(engine.backend, rollouts=1, device=device, options=engine.options)
    check_backend_options(backend_name, engine.options, device)

    config = load_config(model.world_model_dir)
    layout = config.layout
    video_refiner = _load_refiner(refiner, request, observer)
    needs_tokenizer = outputs.decode or request.context_tokens is None
    if needs_tokenizer and model.tokenizer is None:
        raise InputError(
            f"--model {model.label} comes without an image tokenizer: pass --tokenizer DIR_OR_HUB_ID "
            "(or --no-decode with --context-tokens to stay in tokens)"
        )
    if request.context_tokens is not None:
        _check_context_tokens(request.context_tokens, layout)
    plan_rounds(request.context_count, request.frames, layout.max_frames)  # the round rules, before anything loads
    observer.message(f"model: {model.label}")
    owns_world = world is None
    if owns_world:
        # The reference's loop threads are this call's business (generation_threads below).
        world = load_world_model(model, replace(engine, backend=backend_name, threads=0),
                                 needs_tokenizer=needs_tokenizer)
    elif needs_tokenizer and world.tokenizer is None:
        raise InputError("this loaded world model has no image tokenizer, which this video needs")
    tokenizer = world.tokenizer
    if tokenizer is not None and owns_world:
        observer.message(f"tokenizer: {tokenizer.source}  ({world.tokenizer_seconds:.1f} s to load)")
    import torch

    default_threads = torch.get_num_threads()
    loop_threads = generation_threads(engine.threads, config.hidden_size, world.backend.name, world.device)
    auto = " (auto)" if engine.backend == "auto" else ""
    weights = weights_note(getattr(world.backend, "quantization", None))
    observer.message(
        f"backend: {world.backend.name}{auto}{weights}  model: {model.world_model_dir}  "
        f"({world.load_seconds:.1f} s to load)"
        + (f", {loop_threads} CPU thread(s)" if loop_threads else "")
    )
    if world.startup and owns_world:
        observer.startup(world.startup)
    try:
        context = _context_tokens(request, tokenizer, layout, observer)
        k = context.shape[0]
        rounds = plan_rounds(k, request.frames, layout.max_frames)
        if len(rounds) > 1:
            observer.message(f"{request.frames} frames in {len(rounds)} rounds of at most {layout.max_frames} "
                             f"(each re-seeded with the last {RESEED_FRAMES} frames)")
        buffer.start(context, request.frames)
        generated = request.frames - k
        try:
            if loop_threads:
                torch.set_num_threads(loop_threads)
            with observer.frames(generated, layout.image_tokens) as frame_done:
                started = time.perf_counter()

                def on_frame(index: int, tokens: np.ndarray) -> None:
                    buffer.frame_done(index, tokens)
                    frame_done(index, tokens)

                generate_tokens(world.backend, context, request.actions, request.frames, request.sampling,
                                on_frame=on_frame)
                seconds = time.perf_counter() - started
        finally:
            torch.set_num_threads(default_threads)  # decoding images is convolutions: all threads again
    finally:
        backend_name = world.backend.name
        if owns_world:
            closing = time.perf_counter()
            world.close()
            observer.timing("engine shutdown", time.perf_counter() - closing)
    tokens = buffer.finished()
    writing = time.perf_counter()
    decoder = tokenizer
    if video_refiner is not None:
        from terra_cli.refiner.decoder import RefinerDecoder

        decoder = RefinerDecoder(video_refiner.to(video_refiner.target_device), tokenizer, request.sampling.seed)
    written = write_outputs(outputs, tokens, decoder, observer)
    observer.timing("writing outputs", time.perf_counter() - writing)
    return VideoResult(tokens, k, len(rounds), seconds, backend_name, written)


def _check_context_tokens(tokens: np.ndarray, layout) -> None:
    """The request's context tokens against the model's layout and codes, before anything loads."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] != layout.image_tokens:
        raise InputError(f"context tokens must have shape (frames, {layout.image_tokens}) for this model, "
                         f"got {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(f"context tokens must be integers, got {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= layout.image_vocab_size):
        raise InputError(f"context tokens must be image codes in [0, {layout.image_vocab_size - 1}], "
                         f"found {int(tokens.min())}..{int(tokens.max())}")


def _load_refiner(choice, request: VideoRequest, observer: Observer):
    if choice is None:
        return None
    if not request.outputs.decode:
        raise InputError("--decoder refiner makes frames: drop --no-decode (or use --decoder frames)")
    from terra_cli.refiner.decoder import load_refiner

    started = time.perf_counter()
    refiner = load_refiner(choice, [request.frames])
    observer.message(f"refiner: {refiner.source}  ({time.perf_counter() - started:.1f} s to load; "
                     f"{refiner.config.height}x{refiner.config.width}, {refiner.config.steps} steps per "
                     f"{refiner.config.window}-frame window)")
    return refiner


def _context_tokens(request: VideoRequest, tokenizer, layout, observer: Observer) -> np.ndarray:
    if request.context_tokens is not None:
        tokens = np.asarray(request.context_tokens)
        observer.message(f"context: {tokens.shape[0]} frame(s) of tokens{request.context_label}")
        return tokens.astype(np.int64)
    images = request.context_images
    if images is None:
        from terra_cli.models.default import sample_context_frames

        images = list(sample_context_frames(request.context_frames or inputs.DEFAULT_CONTEXT_FRAMES))
        observer.message(f"context: {len(images)} frame(s) of the embedded sample road")
    else:
        observer.message(f"context: last {len(images)} frame(s){request.context_label}")
    with observer.steps("encoding", len(images)) as advance:
        tokens = tokenizer.tokenize(images, on_batch=advance)
    inputs.check_frame_count(request.frames, tokens.shape[0])
    return tokens


def write_outputs(outputs: Outputs, tokens: np.ndarray, decoder, observer: Observer) -> list[str]:
    """Tokens first (cheapest), then decoded frames and the video, each atomically. `decoder` is the
    frame-wise tokenizer or a `RefinerDecoder`: anything with `decode_tokens(tokens, on_batch=...)`."""
    from terra_cli.media.atomic import atomic_save_npy
    from terra_cli.media.frames import write_frame_folder, write_video

    written = []
    if outputs.tokens is not None:
        atomic_save_npy(outputs.tokens, tokens, overwrite=outputs.overwrite)
        written.append(f"tokens -> {outputs.tokens}")
    if outputs.decode:
        label = "refining" if getattr(decoder, "seeded", False) else "decoding"
        with observer.steps(label, len(tokens)) as advance:
            pictures = list(decoder.decode_tokens(tokens, on_batch=advance))
        if outputs.frames_dir is not None:
            write_frame_folder(outputs.frames_dir, pictures, overwrite=outputs.overwrite)
            written.insert(0, f"frames -> {outputs.frames_dir}/")
        if outputs.video is not None:
            write_video(outputs.video, pictures, fps=VIDEO_FPS, overwrite=outputs.overwrite)
            written.insert(0, f"video -> {outputs.video}")
    return written
