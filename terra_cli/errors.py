"""Errors a user can fix. The CLI prints these as one line and exits 2, no traceback.

`TerraError` derives from the image tokenizer's `UserError`, so `USER_ERRORS` (what the CLI turns
into one line) covers both packages.
"""

from tokenizer_decoder.errors import CheckpointError, TokenizerInputError, UserError, error_summary  # noqa: F401


class TerraError(UserError):
    """Base of every terra error that is the input's fault, not a bug."""


class InputError(TerraError, ValueError):
    """Inputs that cannot be generated from (wrong shape, too few actions, too many frames, bad options)."""


class OutputError(TerraError):
    """An output that exists (without --overwrite) or cannot be written."""


USER_ERRORS = (UserError,)


def import_extra(module: str, message: str):
    """Import an optional dependency, or raise one line (`message`, which names the extra to install)
    before anything loads: a missing extra found deep in a model load would be a traceback."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(message) from None
