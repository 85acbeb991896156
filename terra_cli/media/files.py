"""Reading user files safely: the one input check, and .npy arrays checked from their header.

`check_input_file` ("a regular, readable, bounded file", never opening it, so a named pipe cannot
hang a run) is defined in `tokenizer_decoder.files`, whose checkpoint reader needs it too, and
re-exported here for terra's readers: frames, videos, context tokens, actions, scenario files,
the server and the Ray runners all call it before any `open()`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
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


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11 before 3.11.8 keeps the AST builder's
# recursion depth per interpreter, not per thread: two headers parsed at once (the read-ahead threads) can
# fail with "SystemError: AST constructor recursion depth mismatch" (python/cpython gh-106905; it failed
# this project's CI on 3.11.7, 2026-12-06). terra's header parses take turns.
NPY_HEADER_LOCK = threading.Lock()


def read_npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy file open at its start in `f`, which is left at its data.
    ValueError for anything but a version 1.0 or 2.0 header numpy can parse."""
    with NPY_HEADER_LOCK:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"format version {version}")


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
    with _opened(path, what, error) as f:
        try:
            shape, fortran, dtype = read_npy_header(f)
        except OSError:
            raise
        except Exception as exc:  # numpy parses the header with ast: ValueError, SyntaxError, TokenError, ...
            f.seek(0)
            if f.read(4) == b"PK\x03\x04":  # a zip: np.savez's archive under a .npy name
                raise error(f"cannot read {what} {path} as a .npy array: it is an .npz archive (save one array "
                            "with numpy.save)") from None
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
        if f.tell() + needed > size:
            raise error(f"{what} {path} is truncated: its header promises {needed} bytes of data "
                        f"(shape {shape}, {dtype}), the file holds {size - f.tell()}")
        # The data after the header just read (numpy's own load would parse the header again).
        array = np.fromfile(f, dtype=dtype, count=items)
    if array.size != items:  # the file shrank since its size was checked
        raise error(f"{what} {path} is truncated: its header promises {needed} bytes of data")
    return array.reshape(shape[::-1]).transpose() if fortran else array.reshape(shape)


@contextlib.contextmanager
def _opened(path: Path, what: str, error: type[UserError]):
    """`path` open for reading, an OSError on the way (opening or reading) as one `error` line."""
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
