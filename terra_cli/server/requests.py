"""Request bodies: a video job is a scenario line (scenarios/spec.py) sent as JSON, a session is
its context; both are checked here into arrays before anything reaches the engine.

Contexts arrive as data, never as server paths: absent or "sample" (the embedded sample road),
{"images": [base64 PNG/JPEG, ...]}, {"video": base64 mp4}, or {"tokens": [[576 ints], ...]}.
Path strings (a scenario line's own form) are accepted only when the operator gave --data-root,
and only inside it. Every problem raises `FieldError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from terra_cli.actions import PRESETS, ActionsError, instruction_trajs_to_actions, normalize_actions, resolve_actions
from terra_cli.backends.base import Sampling
from terra_cli.errors import TerraError
from terra_cli.pipeline import inputs
from terra_cli.scenarios.spec import TERRA_FRAMES, _check_id

SAMPLE = "sample"


class FieldError(Exception):
    """A request field that cannot be used: answered as 4xx JSON naming the field."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(message)
        self.field, self.message, self.status = field, " ".join(str(message).split()), status


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (operator caps)."""

    max_frames: int = 100
    max_image_pixels: int = 4096 * 4096
    max_context_images: int = 24
    data_root: Path | None = None


def _not_a_bool(value):
    if isinstance(value, bool):  # pydantic would take true as 1: a label "1", a seed 1
        raise ValueError("must be a number, not true or false")
    return value


# Numbers (and a job's label) that refuse JSON's true and false.
Whole = Annotated[int, BeforeValidator(_not_a_bool)]
Real = Annotated[float, BeforeValidator(_not_a_bool)]
Label = Annotated[str | int, BeforeValidator(_not_a_bool)]


class VideoBody(BaseModel):
    """A scenario line (terra's format) plus sampling: `POST /v1/videos`."""

    model_config = ConfigDict(extra="forbid")
    id: Label | None = Field(None, description="Your label for the job (letters, digits, . _ -).")
    context: Any = Field(None, description='"sample" (default), {"images": [base64]}, {"video": base64 mp4}, '
                                           '{"tokens": [[576 ints]...]}, or paths under the server\'s --data-root.')
    context_frames: Whole | None = Field(None, description="Use the last K context frames (default 3).")
    actions: Any = Field(..., description=f"A preset ({', '.join(PRESETS)}), a (frames, 6, 3) array, "
                                          '{"instruction_trajs": [...]} (ACT-Bench), or a path under --data-root.')
    frames: Whole = Field(TERRA_FRAMES, description="Total frames, context included.")
    seed: Whole = 0
    speed: Real = Field(30.0, description="km/h for preset actions.")
    temperature: Real = 0.9
    top_k: Whole = 0
    top_p: Real = 1.0
    tokens: bool = Field(False, description="Keep the tokens too (GET .../content?format=npy).")


class SessionBody(BaseModel):
    """`POST /v1/sessions`: a context to drive from."""

    model_config = ConfigDict(extra="forbid")
    context: Any = None
    context_frames: Whole | None = None
    seed: Whole = 0
    speed: Real = Field(30.0, description="Starting speed in km/h.")
    temperature: Real = 0.9
    top_k: Whole = 0
    top_p: Real = 1.0


MANOEUVRES = ("straight", "left", "right", "faster", "brake")
PICTURE_FORMATS = ("jpeg", "png")
STEP_FORMATS = (*PICTURE_FORMATS, "tokens")  # tokens: the frame's codes, no picture decoded


def check_format(value: str, formats: tuple[str, ...]) -> str:
    """`value` if it is one of `formats`, else the FieldError naming them: a frame's picture and a step's
    answer are checked, and refused, alike."""
    if value not in formats:
        raise FieldError("format", f"format must be {', '.join(formats[:-1])} or {formats[-1]}, got {value!r}")
    return value


class StepBody(BaseModel):
    """`POST /v1/sessions/{id}/step`: the next frame(s)' action."""

    model_config = ConfigDict(extra="forbid")
    action: str | list = Field("straight", description=f"{', '.join(MANOEUVRES)}, or one frame's (6, 3) waypoints.")
    frames: Whole = Field(1, description="How many frames to generate with it.")
    format: str = Field("jpeg", description="jpeg or png: each frame's picture; tokens: each frame's codes instead, "
                                            "no picture decoded (GET .../frames/{index} decodes one later).")


@dataclass(frozen=True)
class Context:
    """Images (RGB uint8) to encode, or tokens, or neither (the sample road, `count` frames)."""

    count: int
    images: list[np.ndarray] | None = None
    tokens: np.ndarray | None = None
    field: str = "context"  # where the tokens came from, for errors: context.tokens, or a .npy path's context


def check_context(context: Context, layout) -> None:
    """The one check of a context against the model, for video jobs and sessions alike: before a
    202, not as a job that fails afterwards."""
    if context.count >= layout.max_frames:  # a round must have room for a generated frame
        raise FieldError("context_frames", f"at most {layout.max_frames - 1} context frames, got {context.count}")
    tokens = context.tokens
    if tokens is None:
        return
    if tokens.shape[1] != layout.image_tokens or tokens.min() < 0 or tokens.max() >= layout.image_vocab_size:
        raise FieldError(context.field, f"{context.field} must be codes in [0, {layout.image_vocab_size - 1}] of shape "
                                        f"(frames, {layout.image_tokens}); got shape {tuple(tokens.shape)} with codes "
                                        f"from {tokens.min()} to {tokens.max()}")


@dataclass(frozen=True)
class VideoSpec:
    label: str
    context: Context
    actions: np.ndarray
    frames: int
    sampling: Sampling
    keep_tokens: bool


def sampling_of(body, seed_field: str = "seed") -> Sampling:
    try:
        return Sampling(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
    except TerraError as exc:
        text = str(exc)
        field = next((f for f in ("temperature", "top_k", "top_p") if f"--{f.replace('_', '-')}" in text), seed_field)
        raise FieldError(field, text.replace("--", "")) from None


def parse_video(body: VideoBody, limits: Limits) -> VideoSpec:
    label = ""
    if body.id is not None:
        try:
            label = _check_id(body.id)
        except TerraError as exc:
            raise FieldError("id", str(exc)) from None
    frames = body.frames
    if not 2 <= frames <= limits.max_frames:
        raise FieldError("frames", f"frames must be from 2 to {limits.max_frames} (this server's cap), got {frames}")
    sampling = sampling_of(body)
    if not (np.isfinite(body.speed) and 0 <= body.speed <= 200):
        raise FieldError("speed", f"speed must be from 0 to 200 km/h, got {body.speed}")
    context = parse_context(body.context, body.context_frames, limits)
    if frames <= context.count:
        raise FieldError("frames", f"frames ({frames}) must be more than the {context.count} context frame(s)")
    actions = parse_actions(body.actions, frames, body.speed, limits)
    try:
        inputs.check_actions_cover(actions, frames)
    except TerraError as exc:
        raise FieldError("actions", str(exc)) from None
    return VideoSpec(label, context, actions, frames, sampling, body.tokens)


def parse_actions(value, frames: int, speed: float, limits: Limits) -> np.ndarray:
    try:
        if isinstance(value, str) and value.strip().lower() in PRESETS:
            return resolve_actions(value, frames=frames, speed_kmh=speed)
        if isinstance(value, list):
            try:
                array = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):  # an integer past float64's range overflows
                raise FieldError("actions", "inline actions must be numbers of shape (frames, 6, 3)") from None
            return normalize_actions(array, "inline actions")
        if isinstance(value, dict) and set(value) == {"instruction_trajs"}:
            return instruction_trajs_to_actions(value["instruction_trajs"], "instruction_trajs")
        if isinstance(value, str):
            if limits.data_root is None:  # so the string can only have meant a preset
                raise FieldError("actions", f"{value[:40]!r} is not a preset ({', '.join(PRESETS)}), and this server "
                                            "takes no paths (it was started without --data-root)")
            return resolve_actions(str(confined(value, limits, "actions")), frames=frames, speed_kmh=speed)
    except (ActionsError, TerraError) as exc:
        raise FieldError("actions", str(exc)) from None
    raise FieldError("actions", f"actions must be a preset ({', '.join(PRESETS)}), an array of shape (frames, 6, 3) "
                                'or {"instruction_trajs": [...]}')


def confined(value: str, limits: Limits, field: str) -> Path:
    """A client's path, allowed only under the operator's --data-root."""
    if limits.data_root is None:
        raise FieldError(field, "paths are not accepted by this server (it was started without --data-root); "
                                "send the data instead")
    from terra_cli.media.files import path_problem, resolve_path, shown

    problem = path_problem(value)
    if problem:
        raise FieldError(field, f"{shown(value)!r} {problem}")
    root = limits.data_root.resolve()
    try:
        path = resolve_path(root / value, repr(value))
    except TerraError as exc:  # a symbolic link loop
        raise FieldError(field, str(exc)) from None
    if not path.is_relative_to(root):
        raise FieldError(field, f"{value!r} is outside the server's --data-root", 403)
    try:
        path.stat()
    except FileNotFoundError:
        raise FieldError(field, f"{value!r} does not exist under the server's --data-root", 404) from None
    except OSError as exc:  # a loop or an over-long name met only now, or no permission
        raise FieldError(field, f"{shown(value)!r} cannot be read under the server's --data-root: "
                                f"{exc.strerror or exc}") from None
    return path


def parse_context(value, count: int | None, limits: Limits) -> Context:
    if count is not None and not 1 <= count <= limits.max_context_images:
        raise FieldError("context_frames", f"context_frames must be from 1 to {limits.max_context_images}, got {count}")
    if value is None or value == SAMPLE:
        return Context(count or inputs.DEFAULT_CONTEXT_FRAMES)
    if isinstance(value, dict) and len(value) == 1:
        kind, data = next(iter(value.items()))
        if kind == "images":
            if not isinstance(data, list) or not data or not all(isinstance(v, str) for v in data):
                raise FieldError("context.images", "context.images must be a non-empty list of base64 images")
            if len(data) > limits.max_context_images:
                raise FieldError("context.images", f"at most {limits.max_context_images} context images, got {len(data)}", 413)
            images = [decode_image(item, f"context.images[{i}]", limits) for i, item in enumerate(data)]
            return _last(images, count, "context.images")
        if kind == "video":
            return _last(decode_video(data, limits), count, "context.video")
        if kind == "tokens":
            return _tokens_context(data, count, "context.tokens")
    if isinstance(value, (str, list)):
        items = [value] if isinstance(value, str) else value
        if not items or not all(isinstance(v, str) for v in items):
            raise FieldError("context", "context paths must be strings")
        paths = [confined(v, limits, "context") for v in items]
        try:
            if len(paths) == 1 and paths[0].suffix.lower() == ".npy":
                return _tokens_context(inputs.load_context_tokens(paths[0], count), None, "context")
            return _last(inputs.read_context_frames(paths, count), count, "context")
        except TerraError as exc:
            raise FieldError("context", str(exc)) from None
    raise FieldError("context", 'context must be "sample", {"images": [...]}, {"video": "..."} or {"tokens": [[...]]}')


def _last(images: list[np.ndarray], count: int | None, field: str) -> Context:
    keep = count or min(len(images), inputs.DEFAULT_CONTEXT_FRAMES)
    if len(images) < keep:
        raise FieldError(field, f"context_frames {keep} asks for {keep} frames, but the context holds {len(images)}")
    return Context(keep, images=images[len(images) - keep:])


def _tokens_context(data, count: int | None, field: str) -> Context:
    try:
        tokens = np.asarray(data)
    except (TypeError, ValueError):
        tokens = np.zeros((0,))
    if tokens.ndim != 2 or tokens.shape[0] < 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise FieldError("context.tokens", "context.tokens must be integers of shape (frames, 576)")
    if count is not None:
        if tokens.shape[0] < count:
            raise FieldError("context_frames", f"context_frames {count} but context.tokens holds {tokens.shape[0]}")
        tokens = tokens[tokens.shape[0] - count:]
    return Context(int(tokens.shape[0]), tokens=tokens.astype(np.int64), field=field)


def _b64(data, field: str) -> bytes:
    if not isinstance(data, str):
        raise FieldError(field, "must be a base64 string")
    if data.startswith("data:") and "," in data:
        data = data.split(",", 1)[1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(field, "is not valid base64") from None


def decode_image(data, field: str, limits: Limits) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    raw = _b64(data, field)
    try:
        with Image.open(io.BytesIO(raw)) as image:  # header only: the size is known before decoding
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise FieldError(field, f"image is {width}x{height}, above this server's cap of "
                                        f"{limits.max_image_pixels} pixels (Terra uses 512x288)", 413)
            return np.asarray(image.convert("RGB"))
    except FieldError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # PIL's own limit, hit while opening
        raise FieldError(field, f"image is too large to decode safely (this server's cap is "
                                f"{limits.max_image_pixels} pixels; Terra uses 512x288)", 413) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise FieldError(field, f"cannot read the image: {' '.join(str(exc).split())}") from None


def decode_video(data, limits: Limits) -> list[np.ndarray]:
    from terra_cli.media.frames import iter_frames

    raw = _b64(data, "context.video")
    with tempfile.TemporaryDirectory(prefix="terra-upload-") as folder:
        path = Path(folder) / "context.mp4"
        path.write_bytes(raw)
        try:
            frames = []
            for frame in iter_frames(path):
                if frame.shape[0] * frame.shape[1] > limits.max_image_pixels:
                    raise FieldError("context.video", f"video frames above this server's cap of "
                                                      f"{limits.max_image_pixels} pixels", 413)
                frames.append(frame)
                frames = frames[-limits.max_context_images:]
        except TerraError as exc:
            raise FieldError("context.video", str(exc)) from None
    if not frames:
        raise FieldError("context.video", "the video holds no frames")
    return frames
