"""Reading frames (image folders, single images, videos) and writing videos / PNG frames.

Frames are RGB uint8 arrays of shape (H, W, 3). Resizing and normalisation belong to the tokenizer
(`tokenizer_decoder.ImageTokenizer.preprocess`). Every user-fixable problem raises `MediaError` with
a one-line message naming the file.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from terra_cli.errors import OutputError, TerraError
from terra_cli.media.atomic import atomic_directory, atomic_path
from terra_cli.media.files import check_input_file

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".ppm"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mov", ".webm", ".gif", ".mkv", ".m4v", ".mpg", ".mpeg"})


class MediaError(TerraError):
    """An input that cannot be read as frames, or frames that cannot be written."""


def natural_key(name: str) -> list:
    """Sort key putting frame2 before frame10: digit runs compare as numbers."""
    return [(0, int(part), part) if part.isdigit() else (1, 0, part.lower()) for part in re.split(r"(\d+)", name)]


def list_images(folder: str | os.PathLike) -> list[Path]:
    """The image files of a folder (not recursive, hidden files skipped), in natural order."""
    folder = Path(folder)
    files = [
        p for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    ]
    return sorted(files, key=lambda p: natural_key(p.name))


# Images above this many pixels are refused before decoding (Terra's frames are 512x288; a
# decompression bomb would take gigabytes).
MAX_IMAGE_PIXELS = 8192 * 8192


def _too_large(path, width: int, height: int) -> str:
    return (f"image {path} is {width}x{height} pixels, above the limit of {MAX_IMAGE_PIXELS} "
            "(8192x8192); resize it first (Terra uses 512x288)")


def is_video(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS


def read_image(path: str | os.PathLike) -> np.ndarray:
    """One image file -> RGB uint8 (H, W, 3)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    check_input_file(path, "image", error=MediaError)
    try:
        with Image.open(path) as im:  # reads the header only: the size is known before decoding
            width, height = im.size
            if width * height > MAX_IMAGE_PIXELS:
                raise MediaError(_too_large(path, width, height))
            return np.asarray(im.convert("RGB"))
    except FileNotFoundError as exc:
        raise MediaError(f"image {path} does not exist") from exc
    except Image.DecompressionBombError as exc:  # PIL's own limit, hit while opening
        raise MediaError(f"image {path} is too large to decode safely ({_short(exc)}); "
                         "resize it to at most 8192x8192 (Terra uses 512x288)") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"cannot read image {path}: {_short(exc)}") from exc


def count_frames(path: str | os.PathLike, max_frames: int | None = None) -> int | None:
    """How many frames `iter_frames` will yield, when that is cheap to know (None for some videos)."""
    path = Path(path)
    if path.is_dir():
        n = len(list_images(path))
    elif path.is_file() and is_video(path):
        n = _video_frame_count(path)
    elif path.is_file():
        n = 1
    else:
        return None
    if n is None:
        return None
    return min(n, max_frames) if max_frames is not None else n


def iter_frames(path: str | os.PathLike, max_frames: int | None = None) -> Iterator[np.ndarray]:
    """Yield RGB uint8 frames from a folder of images, a single image, or a video file."""
    path = Path(path)
    if max_frames is not None and max_frames < 1:
        raise MediaError(f"max frames must be at least 1, got {max_frames}")
    if not path.exists():
        raise MediaError(f"input {path} does not exist")
    if path.is_dir():
        files = list_images(path)
        if not files:
            raise MediaError(f"folder {path} has no images ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        for file in files[:max_frames]:
            yield read_image(file)
        return
    check_input_file(path, "input", error=MediaError)
    if is_video(path):
        yield from _iter_video(path, max_frames)
        return
    yield read_image(path)


def read_frames(path: str | os.PathLike, max_frames: int | None = None) -> list[np.ndarray]:
    """All frames of a folder of images (natural order), a single image, or a video, as RGB uint8 arrays."""
    return list(iter_frames(path, max_frames))


def _iter_video(path: Path, max_frames: int | None) -> Iterator[np.ndarray]:
    import imageio.v2 as iio

    check_input_file(path, "video", error=MediaError)  # ffmpeg would wait forever on a FIFO
    try:
        reader = iio.get_reader(str(path), format="FFMPEG")
    except Exception as exc:  # imageio/ffmpeg raise many kinds of errors for unreadable files
        raise MediaError(f"cannot read video {path}: {_short(exc)}") from exc
    count = 0
    try:
        while max_frames is None or count < max_frames:
            try:
                frame = reader.get_next_data()
            except IndexError:
                break
            except Exception as exc:
                raise MediaError(f"cannot read video {path} (frame {count}): {_short(exc)}") from exc
            count += 1
            frame = np.asarray(frame)
            if frame.ndim >= 2 and frame.shape[0] * frame.shape[1] > MAX_IMAGE_PIXELS:
                raise MediaError(_too_large(path, frame.shape[1], frame.shape[0]))
            yield _as_rgb(frame)
    finally:
        reader.close()
    if count == 0:
        raise MediaError(f"video {path} has no frames")


def _video_frame_count(path: Path) -> int | None:
    """The frames of the video's first stream, read by ffmpeg without decoding them; None if it
    cannot read them. (imageio's reader counts the same way, after starting a second ffmpeg for
    the metadata: one more process per mp4 that a writer process makes and checks.)"""
    try:
        import imageio_ffmpeg

        n, _ = imageio_ffmpeg.count_frames_and_secs(str(path))
    except Exception:
        return None
    return int(n) if n and n > 0 else None


def _as_rgb(frame: np.ndarray) -> np.ndarray:
    if frame.ndim == 2:
        frame = np.stack([frame] * 3, axis=-1)
    if frame.shape[-1] == 4:
        frame = frame[..., :3]
    return np.ascontiguousarray(frame, dtype=np.uint8)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text and text[0] else type(exc).__name__


# ---------------------------------------------------------------------------------------------
def _check_frames(frames: Sequence[np.ndarray], what: str) -> list[np.ndarray]:
    frames = [np.asarray(f) for f in frames]
    if not frames:
        raise MediaError(f"no frames to write to {what}")
    shape = frames[0].shape
    for i, f in enumerate(frames):
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
            raise MediaError(f"{what}: frame {i} is not an RGB uint8 (H, W, 3) array ({f.dtype} {f.shape})")
        if f.shape != shape:
            raise MediaError(f"{what}: frame {i} is {f.shape[1]}x{f.shape[0]}, frame 0 is {shape[1]}x{shape[0]}")
    return frames


def check_video_writer() -> None:
    """Videos are written by the ffmpeg that imageio-ffmpeg ships: find it before a model loads,
    not after minutes of generation."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError) as exc:
        raise MediaError(f"cannot write videos here ({_short(exc)}): pip install imageio-ffmpeg, or write tokens "
                         "only with --no-decode --save-tokens FILE.npy") from exc


# x264's `veryfast`: 0.34 s for a 47-frame 288x512 video on a 2-core CPU, against 1.36 s for its
# default (`medium`), and a smaller file at the same quality setting (benchmarks/README.md, issue 37).
H264_PRESET = "veryfast"
H264_CRF = 10  # what imageio's quality=8 gave: int((1 - 8 / 10) * 51)
# x264's threads per video: a fixed count gives the same bytes on every host (x264's default, 1.5x
# the host's cores, decides differently per core count), and several encoders beside an engine
# then take a bounded share of the CPU instead of every core each.
H264_THREADS = 2
# ffmpeg runs at a lower CPU priority (`nice`, where the host has it): an engine's loop thread in the
# same host, which the GPU waits on every step, goes first when the cores are busy.
ENCODER_NICENESS = 10
PIPE_BYTES = 1 << 20  # ffmpeg's stdin pipe, enlarged where Linux allows: fewer waits per frame


def _encode_h264(path: Path, frames: list[np.ndarray], fps: float) -> None:
    """The mp4 of `frames` at `path`, by the ffmpeg imageio-ffmpeg ships (the command imageio's
    writer ran). terra starts it itself: imageio starts it with a Python pre-exec hook, which
    makes CPython fork the whole calling process instead of spawning. In a vLLM engine's process
    (the writer threads, `scenarios.local_writer`) that is a copy of gigabytes of page tables per
    video, with every thread of the engine stalled on the process's memory map while it runs."""
    import shutil
    import subprocess
    import tempfile
    from fractions import Fraction

    import imageio_ffmpeg

    height, width = frames[0].shape[:2]
    scale = ["-vf", f"scale={width + width % 2}:{height + height % 2}"] if width % 2 or height % 2 else []
    nice = shutil.which("nice")
    cmd = [*([nice, "-n", str(ENCODER_NICENESS)] if nice else []),
           imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}",
           "-pix_fmt", "rgb24", "-r", str(Fraction(fps).limit_denominator()), "-i", "-", "-an",
           "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", str(H264_CRF), *scale, "-v", "error",
           "-preset", H264_PRESET, "-threads", str(H264_THREADS), str(path)]
    with tempfile.TemporaryFile() as errors:
        # process_group=0: Ctrl-C at the terminal reaches terra, which ends the run, not ffmpeg mid-file
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors,
                                process_group=0)
        try:
            _widen_pipe(proc.stdin)
            try:
                for frame in frames:
                    proc.stdin.write(memoryview(np.ascontiguousarray(frame)).cast("B"))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # ffmpeg stopped early: its exit status and message say why
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted while writing
                proc.kill()
                proc.wait()
        if code != 0:
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip().splitlines()
            if any("No space left on device" in line for line in message):  # said as every full disk is
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            raise RuntimeError(f"ffmpeg exited with status {code}" + (f": {message[-1][:200]}" if message else ""))


def _widen_pipe(stream) -> None:
    try:
        import fcntl

        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or above the host's pipe-max-size: the default pipe works
        pass


def write_video(path: str | os.PathLike, frames: Sequence[np.ndarray], fps: float = 10, overwrite: bool = False,
                durable: bool = True) -> Path:
    """Write frames as an H.264 mp4, atomically, and only once the written file reads back as a
    video of every frame: ffmpeg can fail late (a full disk while writing the trailer) and still
    leave a file, which must not replace anything. Like every writer, it replaces a file only
    with `overwrite`. `durable=False` skips the fsync, for a scratch file read back at once."""
    path = Path(path)
    if not overwrite and os.path.lexists(path):  # before the encoding, not after it
        raise OutputError(f"{path} already exists; pass --overwrite to replace it")
    frames = _check_frames(frames, str(path))
    with atomic_path(path, overwrite) as tmp:
        try:
            _encode_h264(tmp, frames, fps)
        except (MediaError, OSError):  # already one line; atomic_path names the path and an OSError's cause
            raise
        except Exception as exc:
            raise MediaError(f"cannot write video {path}: {_short(exc)}") from exc
        written = _video_frame_count(tmp) if tmp.stat().st_size else 0
        if written != len(frames):
            raise MediaError(f"cannot write video {path}: the encoder wrote {written or 'no'} readable frame(s) of "
                             f"{len(frames)} (is the disk full?); nothing was written")
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    return path


def video_bytes(frames: Sequence[np.ndarray], fps: float = 10, folder: str | os.PathLike | None = None) -> bytes:
    """The mp4 `write_video` makes of these frames, as bytes, for a process that encodes videos
    another process places (a Ray engine, a scenario writer process). The file goes through a
    temporary folder (inside `folder` when given) that is removed before this returns.

    That scratch file is not synced to disk: the bytes are read back at once, and the process that
    places them makes its own file durable. On random weights a 47-frame video is about 7 MB of
    noise, and a four-engine wave finishes 1,024 of them within two minutes (benchmarks/README.md)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="terra-video-", dir=folder) as tmp:
        return write_video(Path(tmp) / "video.mp4", frames, fps=fps, durable=False).read_bytes()


def frame_filename(index: int, prefix: str = "frame") -> str:
    return f"{prefix}_{index:04d}.png"


def write_frames(
    directory: str | os.PathLike, frames: Sequence[np.ndarray], prefix: str = "frame", start: int = 0,
    overwrite: bool = False,
) -> list[Path]:
    """Write frames as PNGs `<prefix>_0000.png`, ... (numbered from `start`) into `directory`, each
    atomically (an existing one is replaced only with `overwrite`). For a whole folder of frames,
    write into `atomic_directory` (or call `write_frame_folder`)."""
    from PIL import Image

    directory = Path(directory)
    frames = _check_frames(frames, str(directory))
    if directory.exists() and not directory.is_dir():
        raise MediaError(f"cannot write frames into {directory}: it is a file")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, frame in enumerate(frames, start):
        target = directory / frame_filename(index, prefix)
        with atomic_path(target, overwrite) as tmp:
            Image.fromarray(frame).save(tmp, format="PNG")
        paths.append(target)
    return paths


def write_frame_folder(directory: str | os.PathLike, frames: Sequence[np.ndarray], overwrite: bool = False) -> list[Path]:
    """All frames as `frame_NNNN.png` in `directory`, built beside it first (see `atomic_directory`):
    a new folder appears whole; into an existing one the frame files are moved, replacing those of
    the same name only with `overwrite`, and its other files are left alone. An interrupted run
    leaves the folder as it was."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise MediaError(f"cannot write frames into {directory}: it is a file")
    with atomic_directory(directory, overwrite) as tmp:
        names = [p.name for p in write_frames(tmp, frames)]
    return [directory / name for name in names]
