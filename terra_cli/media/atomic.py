"""Atomic writes and output checks: a failed, interrupted or concurrent run never leaves a
half-written file, and never replaces a file it was not allowed to.

Files are written beside their target under a hidden `.NAME.*.partial` name and placed at the end:
with `overwrite`, by rename (the last complete file wins); without it (the default), by hard link,
which fails if the target appeared meanwhile (another run), so that run's output is never replaced.
Folders of frames are built beside their target and renamed into place when new; into an existing
folder only their files are moved (`atomic_directory`): nothing the run did not make is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
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
def atomic_path(path: Path, overwrite: bool = False) -> Iterator[Path]:
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
        os.chmod(tmp_path, 0o666 & ~_umask())
        yield tmp_path
        place_file(tmp_path, path, overwrite)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, path)) from exc
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def atomic_save_npy(path: Path, array: np.ndarray, overwrite: bool = False) -> None:
    with atomic_path(Path(path), overwrite) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str, overwrite: bool = False) -> None:
    with atomic_path(Path(path), overwrite) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_json(path: Path, data, overwrite: bool = False) -> None:
    """JSON (indent 2) written atomically: bench, eval and scenario results all go through here."""
    atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n", overwrite)


# Written into every folder of files terra places (frames): which files this run made, with their
# size and modification time, so that a later run removes only those, and only while unchanged.
MANIFEST_NAME = ".terra-made.json"


@contextlib.contextmanager
def atomic_directory(directory: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary folder beside `directory` to write files into; when the block
    succeeds they are placed in `directory`, and nothing the run did not create is ever deleted.

    - `directory` absent: the temporary folder is renamed into place whole (a failure or Ctrl-C
      leaves no folder).
    - `directory` present: each file is moved in; one of the same name is replaced only with
      `overwrite` (without it, a folder that is not empty is refused and nothing is placed).
      Files that an earlier run listed in the folder's manifest (`MANIFEST_NAME`), that this run
      does not write again and that are unchanged since (same size and time) are removed, so the
      folder holds one run's frames; every other file in it is left alone.
    """
    directory = Path(directory)
    tmp = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temporary_folder(directory)
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        _write_manifest(tmp, names)
        if not directory.exists():
            try:
                os.rename(tmp, directory)
                tmp = None
                return
            except OSError as exc:  # made meanwhile (another run): merge below
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        _merge_into(tmp, directory, names, overwrite)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, directory)) from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # the run's own temporary folder


def make_temporary_folder(target: Path) -> Path:
    """A new hidden folder beside `target`, with the permissions `mkdir` would give it (mkdtemp
    makes 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{Path(target).name[:MAX_NAME_BYTES]}.", suffix=".partial",
                                dir=Path(target).parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask() -> int:
    """The process umask. Linux reports it in /proc; elsewhere it is read by setting it, which
    briefly leaves other threads (the scenario writer) with umask 0."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _merge_into(tmp: Path, directory: Path, names: list[str], overwrite: bool) -> None:
    if not directory.is_dir():
        raise OutputError(f"cannot write into {directory}: it is not a folder")
    if not overwrite and any(directory.iterdir()):
        raise OutputError(f"{directory} was filled while this run was writing (another run?); "
                          "nothing was replaced: pass --overwrite to replace its files")
    for name in names:
        if name != MANIFEST_NAME and (directory / name).is_dir() and not (directory / name).is_symlink():
            raise OutputError(f"cannot write {directory / name}: it is a folder")
    earlier = read_manifest(directory)
    for name in names:
        if name != MANIFEST_NAME:
            place_file(tmp / name, directory / name, overwrite)
    for name, (size, mtime_ns) in earlier.items():
        if name in names:
            continue
        try:
            info = os.lstat(directory / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size == size and info.st_mtime_ns == mtime_ns:
            os.unlink(directory / name)
    os.replace(tmp / MANIFEST_NAME, directory / MANIFEST_NAME)


def _write_manifest(folder: Path, names: list[str]) -> None:
    files = {}
    for name in names:
        info = os.lstat(folder / name)
        files[name] = [info.st_size, info.st_mtime_ns]
    (folder / MANIFEST_NAME).write_text(json.dumps({"written_by": "terra", "files": files}) + "\n")


def read_manifest(directory: Path) -> dict[str, tuple[int, int]]:
    """The files an earlier terra run placed in `directory` (name -> (size, mtime_ns)); empty when
    there is no manifest or it is not one of terra's. Only plain names inside the folder count."""
    path = Path(directory) / MANIFEST_NAME
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > 4 * 2**20:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("written_by") != "terra" or not isinstance(data.get("files"), dict):
        return {}
    found = {}
    for name, entry in data["files"].items():
        if (isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..", MANIFEST_NAME)
                and isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, int) for v in entry)):
            found[name] = (entry[0], entry[1])
    return found


def save_figure(fig, path: Path, overwrite: bool, dpi: int = 110) -> None:
    """A matplotlib figure, atomically, in the format its suffix names (png, jpg, svg, pdf), the same
    bytes for the same figure: svg and pdf would carry the date and random ids."""
    import matplotlib

    fmt = Path(path).suffix.lower().lstrip(".").replace("jpg", "jpeg") or "png"
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
    with matplotlib.rc_context({"svg.hashsalt": "terra"}), atomic_path(Path(path), overwrite) as tmp:
        fig.savefig(tmp, format=fmt, dpi=dpi, metadata=metadata)
