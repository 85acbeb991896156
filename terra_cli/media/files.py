"""Reading user files safely: the one input check, and .npy arrays checked from their header.

`check_input_file` ("a regular, readable, bounded file", never opening it, so a named pipe cannot
hang a run) is defined in `tokenizer_decoder.files`, whose checkpoint reader needs it too, and
re-exported here for terra's readers: frames, videos, context tokens, actions, scenario files,
the server and the Ray runners all call it before any `open()`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from terra_cli.errors import InputError, UserError
from tokenizer_decoder.files import InputFileError, check_input_file, path_problem, shown  # noqa: F401  (re-exported)


def resolve_path(path: str | os.PathLike, what: str, *, error: type[UserError] = InputError) -> Path:
    """`path` made absolute with its symbolic links followed, or one `error` line naming `what`: a
    NUL byte, an over-long name and a symbolic link loop stop the OS, not only this program."""
    problem = path_problem(path)
    if problem:
        raise error(f"{what} {shown(path)} {problem}")
    try:
        return Path(os.path.abspath(path)).resolve()
    except RuntimeError:  # Python < 3.13 reports a loop so
        raise error(f"{what} {shown(path)} is a symbolic link loop (it never reaches a file)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{what} {shown(path)} is a symbolic link loop (it never reaches a file)") from None
        raise error(f"cannot use {what} {shown(path)}: {exc.strerror or exc}") from None


def read_npy(path: str | os.PathLike, what: str, *, max_items: int | None = None,
             error: type[UserError] = InputError) -> np.ndarray:
    """A plain (non-object) .npy array, with everything a user can get wrong as one `error` line
    naming `what` and `path`: not a regular file, a header numpy cannot parse, an object dtype
    (pickles are never loaded), more than `max_items` elements, or less data than the header
    claims. The header is read and checked before any array memory is allocated."""
    path = Path(path)
    size = check_input_file(path, what, error=error)
    if size == 0:
        raise error(f"{what} {path} is empty")
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"format version {version}")
            data_start = f.tell()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # numpy parses the header with ast: ValueError, SyntaxError, TokenError, ...
        raise error(f"cannot read {what} {path} as a .npy array: its header is damaged "
                    f"({' '.join(str(exc).split())[:120] or type(exc).__name__})") from exc
    if dtype.hasobject:
        raise error(f"cannot read {what} {path}: it holds Python objects (dtype {dtype}); "
                    "terra reads only numeric arrays and never unpickles")
    items = 1
    for d in shape:
        items *= int(d)
    if max_items is not None and items > max_items:
        raise error(f"{what} {path} holds an array of shape {shape}, more than terra reads here "
                    f"(at most {max_items} numbers)")
    needed = items * dtype.itemsize
    if data_start + needed > size:
        raise error(f"{what} {path} is truncated: its header promises {needed} bytes of data "
                    f"(shape {shape}, {dtype}), the file holds {size - data_start}")
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise error(f"cannot read {what} {path} as a .npy array: {' '.join(str(exc).split())[:200]}") from exc
    if not isinstance(array, np.ndarray):  # an .npz archive under a .npy name
        raise error(f"cannot read {what} {path} as a .npy array: it is an .npz archive")
    return array
