"""Where a run writes: every output path resolved and checked before anything loads.

`OutputPlan` is the one output planner. A command registers its inputs and each of its outputs
(files and folders) before any model loads; the plan refuses, with one line naming the options:
- an output that exists (without --overwrite), is a folder where a file goes (or the reverse), or
  cannot be created;
- two outputs that are the same path, or one inside the other (an output folder holding another
  output);
- an output folder that is, or contains, the working directory or an input;
- an output file that is also an input.
While the run writes, `may_replace(path)` says whether a write may replace what is there: with
--overwrite, or when this run made the file itself (a bench saving its partial results). Folders
are placed by `media.atomic.atomic_directory`, which deletes nothing the run did not make. The
scenario runner, the server and the Ray runner build their plans the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from terra_cli.errors import InputError, OutputError
from terra_cli.media.atomic import check_name_length, check_writable, unwritable_ancestor

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".m4v")


def _resolved(path: Path, label: str = "output", error: type = OutputError) -> Path:
    from terra_cli.media.files import resolve_path

    return resolve_path(path, label, error=error)


CHECKPOINT_INPUTS = ("--model", "--tokenizer", "--refiner", "--refiner-weights")


def _inside(inner: Path, outer: Path) -> bool:
    """`inner` is `outer` or lies somewhere under it (both resolved)."""
    return inner == outer or outer in inner.parents


@dataclass
class OutputPlan:
    overwrite: bool
    _inputs: list[tuple[str, Path, Path]] = field(default_factory=list)  # (label, given, resolved)
    _outputs: list[tuple[str, Path, Path, bool]] = field(default_factory=list)  # (..., is a folder)
    _made: set[Path] = field(default_factory=set)

    def input(self, label: str, path: str | os.PathLike | None) -> None:
        """An input of the run (file or folder): no output may replace it or a folder hold it."""
        if path is None:
            return
        given = Path(path)
        resolved = _resolved(given, label, InputError)
        for out_label, out_given, out_resolved, is_folder in self._outputs:
            self._check_against_input(out_label, out_given, out_resolved, is_folder, label, given, resolved)
        self._inputs.append((label, given, resolved))

    def file(self, label: str, path: str | os.PathLike, suffixes: tuple[str, ...] = ()) -> Path:
        """An output file: right suffix, not a folder, absent unless --overwrite, creatable."""
        path = Path(path)
        check_name_length(path)
        _resolved(path, label)  # a NUL byte or a link loop: one line before anything probes the disk
        if suffixes and path.suffix.lower() not in suffixes:
            raise OutputError(f"{label} {path} must end in {' or '.join(suffixes)}")
        if path.is_dir():
            raise OutputError(f"{label} {path} is a directory; give a file name")
        self._check_collisions(label, path, is_folder=False)  # before any probe touches the disk
        check_writable(path, self.overwrite)
        self._outputs.append((label, path, _resolved(path), False))
        return path

    def folder(self, label: str, path: str | os.PathLike) -> Path:
        """An output folder whose files the run places (see `atomic_directory`): not a file, empty
        or absent unless --overwrite, creatable, and holding neither the working directory nor
        an input nor another output."""
        path = Path(path)
        check_name_length(path)
        _resolved(path, label)
        if path.exists() and not path.is_dir():
            raise OutputError(f"{label} {path} is a file; pass a folder")
        if path.is_symlink() and not path.exists():
            raise OutputError(f"{label} {path} is a symbolic link to nothing; pass a folder")
        resolved = _resolved(path)
        if _inside(_resolved(Path.cwd()), resolved):
            raise OutputError(f"{label} {path} is or contains the working directory; name a new folder for the output")
        self._check_collisions(label, path, is_folder=True)
        if path.is_dir() and not self.overwrite and any(path.iterdir()):
            raise OutputError(f"{label} {path} is not empty; pass --overwrite to write into it (files of the "
                              "names this run writes are replaced, other files left alone), or name a new folder")
        blocker = unwritable_ancestor(path)
        if blocker is not None:
            raise OutputError(f"cannot write into {label} {path}: {blocker} is not writable")
        self._outputs.append((label, path, resolved, True))
        return path

    def may_replace(self, path: str | os.PathLike) -> bool:
        """Whether a write to `path` may replace a file there: --overwrite, or this run made it."""
        return self.overwrite or _resolved(Path(path)) in self._made

    def made(self, path: str | os.PathLike) -> None:
        """Record that this run wrote `path` (it may replace it later without --overwrite)."""
        self._made.add(_resolved(Path(path)))

    def _check_collisions(self, label: str, given: Path, is_folder: bool) -> None:
        resolved = _resolved(given)
        for other_label, other_given, other_resolved, other_folder in self._outputs:
            if resolved == other_resolved:
                raise OutputError(f"{label} and {other_label} are the same path ({given}); give each output its own")
            if other_folder and _inside(resolved, other_resolved):
                raise OutputError(f"{label} {given} lies inside {other_label} {other_given}; put it elsewhere")
            if is_folder and _inside(other_resolved, resolved):
                raise OutputError(f"{other_label} {other_given} lies inside {label} {given}; put it elsewhere")
        for in_label, in_given, in_resolved in self._inputs:
            self._check_against_input(label, given, resolved, is_folder, in_label, in_given, in_resolved)

    @staticmethod
    def _check_against_input(label, given, resolved, is_folder, in_label, in_given, in_resolved) -> None:
        if resolved == in_resolved:
            raise OutputError(f"{label} {given} is also the input {in_label}; write to another path")
        if is_folder and _inside(in_resolved, resolved):
            raise OutputError(f"{label} {given} holds the input {in_label} {in_given}; name another folder")
        if in_label in CHECKPOINT_INPUTS and _inside(resolved, in_resolved):
            # every file of a checkpoint folder is read (config, weights, tokenizer): none may be replaced
            raise OutputError(f"{label} {given} lies inside the checkpoint {in_label} {in_given}; write elsewhere")


@dataclass(frozen=True)
class Outputs:
    video: Path | None
    frames_dir: Path | None
    tokens: Path | None
    overwrite: bool

    @property
    def decode(self) -> bool:
        return self.video is not None or self.frames_dir is not None


def check_outputs(video: Path | None, frames_dir: Path | None, tokens: Path | None, *, no_decode: bool, overwrite: bool,
                  inputs: Sequence[tuple[str, Path | None]] = ()) -> Outputs:
    """`terra generate`'s outputs, checked before anything is loaded: what to write, that it may
    be written, and that no output collides with another or with an input (`inputs`: (label,
    path) pairs, path None for absent ones)."""
    from terra_cli.media.frames import check_video_writer

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
    plan = OutputPlan(overwrite)
    for label, path in inputs:
        plan.input(label, path)
    if video is not None:
        if video.suffix.lower() not in VIDEO_SUFFIXES:
            raise OutputError(f"OUTPUT {video} must end in {', '.join(VIDEO_SUFFIXES)} (an H.264 video)")
        if video.is_dir():
            raise OutputError(f"OUTPUT {video} is a directory; give a video file name such as out.mp4")
        plan.file("OUTPUT", video)
        check_video_writer()
    if tokens is not None:
        if tokens.suffix.lower() != ".npy":
            raise OutputError(f"--save-tokens {tokens} must end in .npy")
        if tokens.is_dir():
            raise OutputError(f"--save-tokens {tokens} is a directory; give a file name such as tokens.npy")
        plan.file("--save-tokens", tokens)
    if frames_dir is not None:
        plan.folder("--save-frames", frames_dir)
    return Outputs(video, frames_dir, tokens, overwrite)
