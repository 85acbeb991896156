"""Atomic writes and output checks: a failed, interrupted or concurrent run never leaves a
half-written file, and never replaces a file it was not allowed to.

Files are written beside their target under a hidden `.NAME.*.partial` name and placed at the end:
with `overwrite`, by rename (the last complete file wins); without it, by hard link, which fails
if the target appeared meanwhile (another run), so that run's output is never replaced.
Folders of frames are built beside their target and swapped in whole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from terra_cli.errors import OutputError

# Names longer than this are refused up front (most file systems stop at 255 bytes; the
# temporary name adds a prefix and suffix).
MAX_NAME_BYTES = 200


def check_name_length(path: Path) -> None:
    """Before anything else touches `path`: the OS refuses even to stat an over-long name."""
    if len(Path(path).name.encode()) > MAX_NAME_BYTES:
        raise OutputError(f"cannot write {str(path)[:80]}...: the file name is longer than {MAX_NAME_BYTES} bytes")


def check_writable(path: Path, overwrite: bool) -> None:
    """Fail before any work if `path` exists (and may not be replaced) or cannot be created."""
    path = Path(path)
    check_name_length(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory")
    if path.exists() and not overwrite:
        raise OutputError(f"{path} already exists; pass --overwrite to replace it")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"cannot write {path}: {parent} is not a directory")
    blocker = unwritable_ancestor(parent)
    if blocker is not None:
        raise OutputError(f"cannot write {path}: {blocker} is not writable")


def unwritable_ancestor(directory: Path) -> Path | None:
    """The nearest existing path at or above `directory` if we cannot create files under it."""
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return probe
    if not os.access(probe, os.W_OK | os.X_OK):
        return probe
    # /proc, /sys and read-only mounts pass os.access for root: ask the file system itself.
    try:
        fd, name = tempfile.mkstemp(prefix=".terra-probe-", dir=probe)
    except OSError:
        return probe
    os.close(fd)
    os.unlink(name)
    return None


def describe_os_error(exc: OSError, path: Path) -> str:
    # numpy's tofile reports a short write ("N requested and M written") with no errno: on a local
    # file that is a full disk (or quota).
    if exc.errno is None and "requested and" in str(exc):
        return f"cannot write {path}: no space left on the device (the write stopped short)"
    if exc.errno == errno.ENOSPC:
        return f"cannot write {path}: no space left on the device"
    if exc.errno == errno.EDQUOT:
        return f"cannot write {path}: disk quota exceeded"
    if exc.errno == errno.ENAMETOOLONG:
        return f"cannot write {path}: the name is too long for the file system"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {path}: permission denied (or a read-only file system)"
    return f"cannot write {path}: {exc.strerror or exc}"


def place_file(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move a complete temporary file to `path`; without `overwrite`, never replace what is there."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputError(f"{path} appeared while this run was writing it (another run?); "
                          "nothing was replaced: pass --overwrite to replace it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        # No hard links on this file system: re-check, then rename (a narrow window remains).
        if path.exists():
            raise OutputError(f"{path} appeared while this run was writing it (another run?); "
                              "nothing was replaced: pass --overwrite to replace it") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; move it into place only if the block succeeds.

    OSErrors (a full disk, permissions) become one-line OutputErrors naming `path`; the
    temporary file is removed on every way out, Ctrl-C and SIGTERM (as KeyboardInterrupt) included.
    """
    path = Path(path)
    tmp_path = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:MAX_NAME_BYTES]}.", suffix=f".partial{path.suffix}",
                                   dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        # mkstemp creates 0600; give the result the permissions a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        yield tmp_path
        place_file(tmp_path, path, overwrite)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, path)) from exc
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def atomic_save_npy(path: Path, array: np.ndarray, overwrite: bool = True) -> None:
    with atomic_path(Path(path), overwrite) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str, overwrite: bool = True) -> None:
    with atomic_path(Path(path), overwrite) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_json(path: Path, data, overwrite: bool = True) -> None:
    """JSON (indent 2) written atomically: bench, eval and scenario results all go through here."""
    atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n", overwrite)


@contextlib.contextmanager
def atomic_directory(directory: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary folder beside `directory`; when the block succeeds it becomes
    `directory`. An existing `directory` is replaced whole with `overwrite` (the old one is kept
    until the new one is in place), and must be empty or absent without it."""
    directory = Path(directory)
    tmp = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name[:MAX_NAME_BYTES]}.", suffix=".partial",
                                    dir=directory.parent))
        yield tmp
        if directory.is_dir() and any(directory.iterdir()):
            if not overwrite:
                raise OutputError(f"{directory} was filled while this run was writing (another run?); "
                                  "nothing was replaced: pass --overwrite to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name[:MAX_NAME_BYTES]}.", suffix=".old", dir=directory.parent))
            os.rmdir(old)
            os.rename(directory, old)
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if directory.is_dir():
                os.rmdir(directory)
            os.rename(tmp, directory)
        tmp = None
    except OSError as exc:
        raise OutputError(describe_os_error(exc, directory)) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
