"""Up-front checks of a scenario's context files: read headers only, never decode, never block.

Every path goes through the one input check (`terra_cli.media.files.check_input_file`) before it
is opened: a FIFO (or a device) would block `open()` forever, so only regular files (and folders
of them) are read. Images and videos are checked against the pixel cap from their headers; token
files from their .npy header, and against the model's code range once its config is known
(`check_token_values`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from terra_cli.errors import InputError
from terra_cli.media.files import NPY_HEADER_LOCK, check_input_file
from terra_cli.pipeline.inputs import MAX_TOKEN_ITEMS


def check_regular_file(path: Path, what: str) -> None:
    """The one input check (terra_cli.media.files), as an InputError: stat only, never open()."""
    check_input_file(path, what, error=InputError)


def check_tokens_file(path: Path, count: int) -> int:
    """Header-only check (shape, dtype) of a tokens .npy; returns how many rows will be used."""
    array = _open_tokens(path)
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{path.name}: context tokens must be an int array (frames, 576), got {array.dtype} {array.shape}")
    if array.shape[0] < 1:
        raise InputError(f"{path.name} holds no frames")
    if array.size > MAX_TOKEN_ITEMS:
        raise InputError(f"{path.name} holds {array.size} tokens; a context is at most {MAX_TOKEN_ITEMS}")
    return min(count, array.shape[0])


def _open_tokens(path: Path) -> np.ndarray:
    check_regular_file(path, "context tokens")
    try:
        with NPY_HEADER_LOCK:  # numpy's header parse is not thread-safe on CPython 3.11 (media/files.py)
            return np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy parses the header with ast: ValueError, SyntaxError, TokenError, ...
        message = " ".join(str(exc).split())[:200]
        raise InputError(f"cannot read {path.name} as a .npy array: {message}") from exc


def check_token_values(path: Path, rows: int, image_tokens: int, image_vocab: int) -> None:
    """The last `rows` rows of a tokens file against the model's layout: width and code range."""
    array = _open_tokens(path)
    if array.ndim != 2 or array.shape[1] != image_tokens:
        raise InputError(f"context tokens {path.name} have shape {array.shape}; this model takes (frames, {image_tokens})")
    used = np.asarray(array[array.shape[0] - rows:])
    if used.size and (used.min() < 0 or used.max() >= image_vocab):
        raise InputError(f"context tokens {path.name} hold values {int(used.min())}..{int(used.max())}; this model's "
                         f"image codes are 0..{image_vocab - 1}")


def check_images(paths: list[Path], count: int) -> int:
    """Images are opened header-only (size, readable), videos from their header, folders image by
    image. Returns the number of context frames that will be used (the last `count`)."""
    from terra_cli.media.frames import count_frames, is_video, list_images

    total = 0
    for path in paths:
        if path.is_dir():
            files = list_images(path)
            if not files:
                raise InputError(f"context folder {path.name} holds no images")
            for file in files:  # every image of a folder is decoded when the context is read
                _check_image(file)
            total += len(files)
        elif is_video(path):
            check_regular_file(path, "context video")
            _check_video(path)
            total += count_frames(path) or 0
        else:
            check_regular_file(path, "context image")
            _check_image(path)
            total += 1
    if total < 1:
        raise InputError("context holds no frames")
    return min(count, total)


def _check_image(path: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    from terra_cli.media.frames import MAX_IMAGE_PIXELS

    try:
        with Image.open(path) as image:  # the header first: the size is known before any decoding
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InputError(f"context image {path.name} is {width}x{height} pixels, above the limit of "
                                 "8192x8192; resize it first (Terra uses 512x288)")
            _check_complete(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"context image {path.name} is too large to decode safely; resize it to at most "
                         "8192x8192 (Terra uses 512x288)") from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError) as exc:
        raise InputError(f"context image {path.name} cannot be read: {' '.join(str(exc).split())[:200]}") from None


def _check_complete(image) -> None:
    """A truncated or damaged image fails here, at line validation, not after the model has loaded;
    without a full decode: a PNG's chunks are walked and their checksums checked, a JPEG is decoded
    at 1/8 scale (its DCT scaling still reads every byte of the entropy-coded data)."""
    if image.format == "JPEG":
        image.draft("RGB", (max(image.size[0] // 8, 1), max(image.size[1] // 8, 1)))
        image.load()
    else:
        image.verify()


def _check_video(path: Path) -> None:
    import imageio.v2 as iio

    from terra_cli.media.frames import MAX_IMAGE_PIXELS

    try:
        reader = iio.get_reader(str(path), format="FFMPEG")
    except Exception as exc:  # imageio/ffmpeg raise many kinds of errors for unreadable files
        raise InputError(f"context video {path.name} cannot be read: {' '.join(str(exc).split())[:200]}") from None
    try:
        width, height = reader.get_meta_data().get("size") or (0, 0)
    except Exception:
        width = height = 0
    finally:
        reader.close()
    if width * height > MAX_IMAGE_PIXELS:
        raise InputError(f"context video {path.name} is {width}x{height} pixels, above the limit of 8192x8192")
