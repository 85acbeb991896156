"""Where `terra generate` writes: checked before anything loads, so a bad path fails in a second."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from terra_cli.errors import OutputError
from terra_cli.media.atomic import check_name_length, check_writable, unwritable_ancestor
from terra_cli.media.frames import check_video_writer

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".m4v")


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
    for path in (video, frames_dir, tokens):
        if path is not None:
            check_name_length(path)
    if no_decode:
        if video is not None:
            raise OutputError(f"--no-decode writes no video: drop OUTPUT ({video}) or --no-decode")
        if frames_dir is not None:
            raise OutputError("--no-decode writes no frames: drop --save-frames or --no-decode")
        if tokens is None:
            raise OutputError("--no-decode needs --save-tokens FILE.npy, or there is nothing to write")
    elif video is None:
        raise OutputError("no OUTPUT video given: pass OUTPUT.mp4 (or --no-decode --save-tokens FILE.npy)")
    if video is not None:
        if video.suffix.lower() not in VIDEO_SUFFIXES:
            raise OutputError(f"OUTPUT {video} must end in {', '.join(VIDEO_SUFFIXES)} (an H.264 video)")
        if video.is_dir():
            raise OutputError(f"OUTPUT {video} is a directory; give a video file name such as out.mp4")
        check_writable(video, overwrite)
        check_video_writer()
    if tokens is not None:
        if tokens.suffix.lower() != ".npy":
            raise OutputError(f"--save-tokens {tokens} must end in .npy")
        if tokens.is_dir():
            raise OutputError(f"--save-tokens {tokens} is a directory; give a file name such as tokens.npy")
        check_writable(tokens, overwrite)
    if frames_dir is not None:
        check_frames_dir(frames_dir, overwrite)
    paths = [p.resolve() for p in (video, frames_dir, tokens) if p is not None]
    if len(set(paths)) != len(paths):
        raise OutputError("OUTPUT, --save-frames and --save-tokens must be different paths")
    return Outputs(video, frames_dir, tokens, overwrite)


def check_frames_dir(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"--save-frames {directory} is a file; pass a folder for the PNG frames")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise OutputError(f"--save-frames {directory} is not empty; pass --overwrite to write into it")
    blocker = unwritable_ancestor(directory)
    if blocker is not None:
        raise OutputError(f"cannot write frames into {directory}: {blocker} is not writable")
