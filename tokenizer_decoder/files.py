"""The one input check every reader runs before it opens a file: a regular, readable, bounded file.

`open()` on a named pipe (FIFO) blocks until a writer appears, a character device can be endless,
and a folder where a file is expected fails deep inside a library. `os.stat` answers without
blocking, so every reader of terra and of this package (images, videos, .npy tokens and actions,
JSON, configs, safetensors) asks `check_input_file` first. It lives in this package because the
image tokenizer's checkpoint reader needs it and must not import terra_cli; terra re-exports it
from `terra_cli.media.files`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import UserError

# The kinds of file that are not regular, as a user would name them.
_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class InputFileError(UserError, ValueError):
    """An input path that is missing, not a regular file, unreadable or too large."""


def check_input_file(path: str | os.PathLike, what: str = "input", *, max_bytes: int | None = None,
                     error: type[UserError] = InputFileError) -> int:
    """Raise `error` (one line naming `what` and `path`) unless `path` is a regular file (after
    symlinks) that this process may read and, with `max_bytes`, is at most that large. Returns
    its size in bytes. Never opens the file, so it never blocks."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except NotADirectoryError:
        raise error(f"{what} {path} does not exist (a part of the path is a file, not a folder)") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise error(f"{what} {path} is {kind}; terra reads only regular files")
    if not os.access(path, os.R_OK):
        raise error(f"cannot read {what} {path}: permission denied")
    if max_bytes is not None and info.st_size > max_bytes:
        raise error(f"{what} {path} is {info.st_size} bytes, above the limit of {max_bytes}: is it the right file?")
    return info.st_size
