"""Atomic writes and output checks: a failed or interrupted run never leaves a half-written file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import TerraError


class OutputError(TerraError):
    """An output that exists (without --overwrite) or cannot be written."""


def check_writable(path: Path, overwrite: bool) -> None:
    """Fail before any work if `path` exists (and may not be replaced) or its folder is unwritable."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise OutputError(f"{path} already exists; pass --overwrite to replace it")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"cannot write {path}: {parent} is not a directory")
    blocker = unwritable_ancestor(parent)
    if blocker is not None:
        raise OutputError(f"cannot write {path}: {blocker} is not writable")


def unwritable_ancestor(directory: Path) -> Path | None:
    """The nearest existing folder at or above `directory` if we cannot create files in it."""
    probe = Path(directory)
    while not probe.exists():
        probe = probe.parent
    return None if os.access(probe, os.W_OK) else probe


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; move it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp creates 0600; give the result the permissions a plain open() would have.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
