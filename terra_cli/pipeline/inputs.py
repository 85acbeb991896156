"""What a video is generated from: context frames or tokens, and enough actions, checked early."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np

from terra_cli.errors import InputError
from terra_cli.pipeline.rounds import MAX_TOTAL_FRAMES

DEFAULT_CONTEXT_FRAMES = 3
# A context-tokens file larger than this is not one (Terra's 576 codes x 100 frames is 57,600).
MAX_TOKEN_ITEMS = 16 * 2**20


def read_context_frames(sources: Sequence[Path], count: int | None) -> list[np.ndarray]:
    """The LAST `count` frames (the most recent) of the given images / folders / videos, in order.

    Several sources are read one after the other, as one sequence. `count` None: up to
    DEFAULT_CONTEXT_FRAMES, fewer when fewer are given. An explicit `count` needs that many.
    """
    from terra_cli.media.files import check_input_file
    from terra_cli.media.frames import MediaError, iter_frames

    keep = count if count is not None else DEFAULT_CONTEXT_FRAMES
    recent: deque = deque(maxlen=keep)
    for source in sources:
        source = Path(source)
        if not source.exists():
            raise MediaError(f"context {source} does not exist")
        if not source.is_dir():
            check_input_file(source, "context", error=MediaError)  # a FIFO would block in open()
        recent.extend(iter_frames(source))  # streams: a long video is never held whole
    if count is not None and len(recent) < count:
        raise MediaError(f"--context-frames {count} asks for {count} frames, but --context gave only {len(recent)}")
    return list(recent)


def load_context_tokens(path: Path, count: int | None) -> np.ndarray:
    """int (K, T) tokens from a .npy; with `count`, the last `count` rows."""
    from terra_cli.media.files import read_npy

    arr = read_npy(path, "context tokens file", max_items=MAX_TOKEN_ITEMS)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: context tokens must be an int array (frames, 576), got {arr.dtype} {arr.shape}")
    if arr.shape[0] == 0:
        raise InputError(f"{path} holds no frames (shape {arr.shape}); context tokens are (frames >= 1, 576)")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:  # it would wrap negative below
        raise InputError(f"{path}: context tokens must be image codes, found {int(arr.max())}")
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
