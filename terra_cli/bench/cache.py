"""Folders the bench builds once and reuses (random Terra-size weights, a random tokenizer), safe
when several runs build the same one at once: one bench per GPU of a host is the normal thing.

Each run builds into its own temporary folder beside the entry and renames it into place. A
complete entry is only ever placed by that rename, so when another run placed it first, that
entry is as good as ours: ours is dropped and theirs used (no lock to go stale after a kill).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Callable

from terra_cli.errors import InputError

COMPLETE_MARKER = "config.json"  # every entry holds one, and holds it only once it is in place


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file()


def foreign_files(target: Path) -> str:
    return f"{target} holds files terra did not write; move them away or point TERRA_CACHE at another folder"


def cached_folder(target: Path, build: Callable[[Path], None], log: Callable[[str], None], what: str) -> Path:
    """`target`, built by `build(folder)` unless a complete entry is there (or arrives while we build)."""
    if is_complete(target):
        log(f"{what}: {target} (reused)")
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        # Not an entry of ours (those only ever arrive complete): someone else's files, never replaced.
        raise InputError(foreign_files(target))
    log(f"building {what} -> {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        built = Path(tmp) / "entry"
        build(built)
        try:
            os.replace(built, target)
        except OSError as exc:
            # ENOTEMPTY / EEXIST: a non-empty folder is already there, which only another run's rename puts
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not is_complete(target):  # foreign files arrived while we built
                raise InputError(foreign_files(target)) from exc
            log(f"{what}: another run placed {target} first; using it")
    return target
