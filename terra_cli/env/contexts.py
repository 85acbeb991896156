"""What `reset(options=...)` accepts as an environment's context, turned into tokens (K, T).

A context is one of:
- None or "sample": the embedded sample road (terra_cli/models/default.py), `context_frames` frames;
- a path (str or Path): images, a folder of images or a video; its last `context_frames` frames;
- images: a (K, H, W, 3) uint8 array or a list of (H, W, 3) arrays (any size: the tokenizer resizes);
- tokens: a (K, T) integer array of image codes (needs no tokenizer);
- a dict with one of "tokens", "images", "video" (a path), "sample" (True), to say which explicitly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from terra_cli.errors import InputError

DEFAULT_CONTEXT_FRAMES = 3


def _kind(context):
    if context is None or (isinstance(context, str) and context == "sample"):
        return "sample", None
    if isinstance(context, dict):
        keys = [k for k in ("tokens", "images", "video", "sample") if k in context]
        if len(keys) != 1 or len(context) != 1:
            raise InputError(f"a context dict holds exactly one of tokens, images, video, sample; got {sorted(context)}")
        return keys[0], context[keys[0]]
    if isinstance(context, (str, Path)):
        return "video", context
    array = np.asarray(context) if not isinstance(context, (list, tuple)) else None
    if array is not None and array.ndim == 2:
        return "tokens", context
    return "images", context


def context_tokens(context, count: int | None, tokenizer, layout, cache: dict) -> np.ndarray:
    """One environment's context as int64 tokens (K, T), checked against the model's layout.
    `cache` keeps the encoded sample road between resets."""
    kind, value = _kind(context)
    if kind == "tokens":
        tokens = np.asarray(value)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise InputError(f"context tokens must be integer codes (frames, {layout.image_tokens}), "
                             f"got {tokens.dtype} {tokens.shape}")
        if count is not None:
            tokens = tokens[max(0, tokens.shape[0] - count):]
    else:
        if tokenizer is None:
            raise InputError(f"a {kind} context needs an image tokenizer: pass tokenizer= or give context tokens")
        if kind == "sample":
            frames = count or DEFAULT_CONTEXT_FRAMES
            if ("sample", frames) not in cache:
                from terra_cli.models.default import sample_context_frames

                cache["sample", frames] = tokenizer.tokenize(list(sample_context_frames(frames)))
            tokens = cache["sample", frames]
        elif kind == "video":
            from terra_cli.pipeline.inputs import read_context_frames

            tokens = tokenizer.tokenize(read_context_frames([Path(value)], count))
        else:
            images = [np.asarray(image) for image in value]
            if not images or any(image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8 for image in images):
                raise InputError("context images must be (H, W, 3) uint8 arrays (or one (K, H, W, 3) array)")
            tokens = tokenizer.tokenize(images[len(images) - count:] if count else images)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 2 or tokens.shape[1] != layout.image_tokens or tokens.shape[0] < 1:
        raise InputError(f"context tokens must have shape (frames >= 1, {layout.image_tokens}), got {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= layout.image_vocab_size:
        raise InputError(f"context tokens must be image codes in [0, {layout.image_vocab_size - 1}]")
    if tokens.shape[0] >= layout.max_frames:
        raise InputError(f"at most {layout.max_frames - 1} context frames (a round holds {layout.max_frames}), "
                         f"got {tokens.shape[0]}")
    return tokens


def context_actions(value, frames: int, speed_kmh: float = 30.0) -> np.ndarray | None:
    """The waypoints between one environment's K context frames: (K - 1, 6, 3) float32, or None
    (the first step's action is used, as server sessions do). `value`: an array of that shape, or
    a preset name driven at `speed_kmh`."""
    if value is None or frames == 1:
        return None
    from terra_cli.actions import ActionsError, normalize_actions, preset_actions

    try:
        if isinstance(value, str):
            return preset_actions(value, frames - 1, speed_kmh)
        actions = normalize_actions(np.asarray(value), "context_actions")
    except ActionsError as exc:
        raise InputError(str(exc)) from None
    if actions.shape[0] != frames - 1:
        raise InputError(f"context_actions must hold {frames - 1} rows for {frames} context frames, "
                         f"got {actions.shape[0]}")
    return actions
