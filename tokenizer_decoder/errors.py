"""Errors that are the input's fault, not a bug: callers show them as one line, no traceback.

`terra_cli.errors.TerraError` derives from `UserError`, so one `except UserError` catches both
packages' errors while this package stays importable without terra_cli.
"""


class UserError(Exception):
    """A mistake in what was given (a file, frames, tokens, an option), not a bug."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be found, read, or does not match the model it should fill."""


class TokenizerInputError(UserError, ValueError):
    """Frames or tokens the tokenizer cannot take."""


def error_summary(error: BaseException) -> str:
    """`Type: first line of the message`: why an optional speed-up (a compiled kernel, a green
    context) fell back, in one line of a log or a results file."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
