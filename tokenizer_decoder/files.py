"""The one input check every reader runs before it opens a file: a regular, readable, bounded file.

`open()` on a named pipe (FIFO) blocks until a writer appears, a character device can be endless,
and a folder where a file is expected fails deep inside a library. `os.stat` answers without
blocking, so every reader of terra and of this package (images, videos, .npy tokens and actions,
JSON, configs, safetensors) asks `check_input_file` first. It lives in this package because the
image tokenizer's checkpoint reader needs it and must not import terra_cli; terra re-exports it
from `terra_cli.media.files`.
"""

from __future__ import annotations

import errno
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


MAX_NAME_BYTES = 255  # one name in a path (Linux, macOS)
MAX_PATH_BYTES = 4095  # a whole path (Linux PATH_MAX less the NUL)
SHOWN_CHARS = 160


class InputFileError(UserError, ValueError):
    """An input path that is missing, not a regular file, unreadable or too large."""


def shown(path: str | os.PathLike) -> str:
    """A path for a one-line message: a 5000-character name would fill the screen."""
    text = str(path)
    return text if len(text) <= SHOWN_CHARS else f"{text[:80]}...{text[-60:]} ({len(text)} characters)"


def path_problem(path: str | os.PathLike) -> str | None:
    """Why no file can have this name (the OS would refuse even to look it up), or None."""
    text = os.fsdecode(path)
    if "\0" in text:
        return "contains a NUL byte, which no file name can hold"
    encoded = os.fsencode(text)
    if any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"is too long: a name in it is longer than {MAX_NAME_BYTES} bytes"
    if len(encoded) > MAX_PATH_BYTES:
        return f"is too long: more than {MAX_PATH_BYTES} bytes"
    return None


def check_input_file(path: str | os.PathLike, what: str = "input", *, max_bytes: int | None = None,
                     error: type[UserError] = InputFileError) -> int:
    """Raise `error` (one line naming `what` and `path`) unless `path` is a regular file (after
    symlinks) that this process may read and, with `max_bytes`, is at most that large. Returns
    its size in bytes. Never opens the file, so it never blocks."""
    problem = path_problem(path)
    if problem:
        raise error(f"{what} {shown(path)} {problem}")
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except NotADirectoryError:
        raise error(f"{what} {path} does not exist (a part of the path is a file, not a folder)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{what} {path} is a symbolic link loop (it never reaches a file)") from None
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
